"""Digests of what a refactor must leave alone: a dev set's build (the contents of its node, edge
and document tables, its vectors) and every question's retrieval (timings left out), for the
checkout it runs in. Run it at two commits and compare the lines.

    python -m bench.digests WORK_FOLDER [--data ../shared/eval]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from noderag_cli import api
from noderag_cli.evaluate.datasets import load_hotpotqa, load_musique

ROOT = Path(__file__).resolve().parents[1]
BUILD_FILES = ("nodes.parquet", "edges.parquet", "documents.parquet", "vectors.faiss")


def digest_of(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def file_digest(path: Path) -> str:
    """A parquet file's digest is its table's (an Arrow IPC stream of it): a change of compression
    leaves it alone. Other files: their bytes."""
    if path.suffix != ".parquet":
        return digest_of(path.read_bytes())
    sink = pa.BufferOutputStream()
    table = pq.read_table(path)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return digest_of(sink.getvalue().to_pybytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="folder for the corpora and workspaces (emptied per dataset)")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "eval")
    args = parser.parse_args(argv)
    for name, load in (("musique", load_musique), ("hotpotqa", load_hotpotqa)):
        if not (args.data / name).is_dir():
            print(f"{name}: skipped, {args.data / name} is absent")
            continue
        corpus, ws = args.work / f"{name}-corpus", args.work / f"{name}-ws"
        questions = load(args.data / name, corpus)
        api.index(ws, corpus)
        generation = ws / "generations" / (ws / "CURRENT").read_text().strip()
        digests = {file: file_digest(generation / file) for file in BUILD_FILES}
        session = api.open_workspace(ws)
        retrieved = hashlib.blake2b(digest_size=8)
        for question in questions:
            result = session.retriever.retrieve(question.question).as_dict()
            result.pop("timings", None)
            retrieved.update(json.dumps(result, sort_keys=True).encode())
        session.close()
        digests["retrieval"] = retrieved.hexdigest()
        print(f"{name}: {json.dumps(digests)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
