"""What hostile input costs (issue 37): chunking time per megabyte from 1 to 100 MB of text, and
the spending cap against providers that bill more than they are estimated at.

    python -m bench.bench_hardening [--work bench-out/hardening] [--sizes 1 10 100] [--quick]

Chunking: a Markdown file, a PDF and an HTML page of the same generated prose at each size, read
by their reader in its contained process (with limits raised past what the sizes need) and cut
into chunks by the chunk stage's own function (`chunk.chunk_batch`); reading and cutting timed
apart, the median of the rounds (one round at the largest size). Flat seconds per megabyte mean
linear work.

The cap: `noderag index` against the fault server (devtools/fault_server.py) on four of
the sample corpus's documents, each case from a fresh workspace, priced at $2 / $8 per million
input / output tokens: the spend is what the server billed (its usage figures), the dearest
request the largest single bill among them. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import yaml

from devtools import documents as make
from devtools.fault_server import llm_section
from noderag_cli.index import chunk
from noderag_cli.index.scan import content_hash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
PRICE = {"input": 2.0, "output": 8.0}
LINE_CHARS, PAGE_LINES = 95, 60


SECTIONS_PER_MB = 980  # of make.sections' prose, about a kilobyte each


def _prose(megabytes: float) -> list[make.Section]:
    return make.sections(11, max(1, int(megabytes * SECTIONS_PER_MB)))


def _write_text_pdf(path: Path, title: str, parts: list[make.Section]) -> None:
    """A PDF of the sections as plain text lines (reportlab takes minutes for 100 MB): a heading line
    and wrapped paragraph lines, PAGE_LINES to a page, in Helvetica."""
    lines = [title, ""]
    for heading, paragraphs in parts:
        lines += [heading, ""]
        for paragraph in paragraphs:
            lines += make._wrap(paragraph, LINE_CHARS) + [""]
    pages = [lines[i:i + PAGE_LINES] for i in range(0, len(lines), PAGE_LINES)]
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", None, b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for page in pages:
        body = b"BT /F1 10 Tf 12 TL 50 780 Td " + b"".join(
            b"(" + line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1", "replace")
            + b") Tj T* " for line in page) + b"ET"
        stream = zlib.compress(body, 6)
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream")
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 3 0 R >> >> >>" % (len(objects)))
        kids.append(b"%d 0 R" % len(objects))
    objects[1] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(pages)
    make._write_pdf_objects(path, objects)


def _document(folder: Path, kind: str, megabytes: float) -> Path:
    path = folder / f"prose-{megabytes:g}mb-{SECTIONS_PER_MB}.{kind}"  # (the generator's scale in the name)
    if path.is_file():
        return path
    parts = _prose(megabytes)
    if kind == "md":
        make.write_markdown(path, "Prose", parts)
    elif kind == "html":
        make.write_html(path, "Prose", parts)
    else:
        _write_text_pdf(path, "Prose", parts)
    return path


def _chunk_once(path: Path, kind: str) -> tuple[float, float, int, int]:
    """(seconds reading, seconds cutting, characters of text, chunks) for one document."""
    from noderag_cli import readers
    from noderag_cli.readers import contained

    limits = (3600.0, 16_000, 4096)
    started = time.perf_counter()
    if kind == "md":
        text, title, parts = path.read_text(encoding="utf-8"), "", []
    else:
        extracted = contained.extract(str(path), readers.Limits(*limits), content_hash(path.read_bytes()))
        text, title, parts = extracted.text, extracted.title, [list(p) for p in extracted.parts]
    read = time.perf_counter() - started
    started = time.perf_counter()
    [cut] = chunk.chunk_batch(([(str(path), "markdown", None, "", (text, title, parts), "")], 512, 0, limits))
    return read, time.perf_counter() - started, len(text), len(cut.chunks)


def chunking_section(work: Path, sizes: list[float], rounds: int) -> list[str]:
    work.mkdir(parents=True, exist_ok=True)
    lines = ["## Chunking time per megabyte (issue 37, H3)", "",
             f"Command: `python -m bench.bench_hardening` (sizes {', '.join(f'{s:g}' for s in sizes)} MB). "
             "A document of generated prose in each format, read by its reader in the contained process (limits "
             "raised past what the sizes need: 3,600 s, 16 GB) and cut by `chunk.chunk_batch` (512-token chunks); "
             f"median of {rounds} rounds, one at the largest size. s/MB per megabyte of the document's text.", "",
             "| format | file MB | text MB | chunks | reading s | reading s/MB | cutting s | cutting s/MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    chunk.chunk_texts(["Warm-up: the tokenizer loads once per process."], 512)
    for kind in ("md", "pdf", "html"):
        for size in sizes:
            path = _document(work, kind, size)
            times = [_chunk_once(path, kind) for _ in range(1 if size == max(sizes) else rounds)]
            read = statistics.median(t[0] for t in times)
            cut = statistics.median(t[1] for t in times)
            text_mb = times[0][2] / 1e6
            lines.append(f"| {kind} | {path.stat().st_size / 1e6:.1f} | {text_mb:.1f} | {times[0][3]:,} | {read:.1f} | "
                         f"{read / text_mb:.2f} | {cut:.1f} | {cut / text_mb:.2f} |")
    return lines


# --------------------------------------------------------------------------- the spending cap
def _docs(work: Path) -> Path:
    folder = work / "cap-docs"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for path in sorted((ROOT / "sample_corpus").glob("*.md"))[:4]:
            shutil.copy(path, folder / path.name)
    return folder


def _index(work: Path, name: str, config: dict, *extra: str) -> tuple[int, str]:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    ws = work / f"ws-{name}"
    shutil.rmtree(ws, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "noderag_cli.cli", "index", str(ws), "--input", str(_docs(work)),
                           "--config", str(path), "--json", *extra], capture_output=True, text=True, cwd=ROOT, timeout=900)
    return done.returncode, done.stdout


def _bills(server) -> list[float]:
    return [(r.usage.get("prompt_tokens", 0) * PRICE["input"] + r.usage.get("completion_tokens", 0) * PRICE["output"]) / 1e6
            for r in server.records if r.status == 200 and r.path.endswith(("/chat/completions", "/embeddings"))]


def _llm(server, **settings) -> dict:
    return {"llm": {**llm_section(server.url), "timeout_seconds": 10,
                    "price_per_million_tokens": PRICE, **settings}}


def _embeddings(server) -> dict:
    return {"embedding": {"backend": "litellm", "model": "openai/fault-embed", "api_base": server.url, "dim": 16,
                          "batch_size": 8, "price_per_million_tokens": {"input": PRICE["input"]}}}


def cap_section(work: Path) -> list[str]:
    from devtools.fault_server import FaultServer

    work.mkdir(parents=True, exist_ok=True)
    rows = []

    def case(label: str, server, config: dict, cap_of) -> None:
        """`cap_of(real cost, estimate)`: the cap, from what an uncapped run of the same case was billed
        and what the dry run estimated."""
        server.reset()
        _index(work, "full", config)
        full = sum(_bills(server))
        server.reset()
        _, planned = _index(work, "plan", config, "--dry-run")
        estimate = json.loads(planned)["llm"]["total"]["cost_usd"]
        cap = cap_of(full, estimate)
        server.reset()
        code, _ = _index(work, "capped", config, "--max-cost", f"{cap:.6f}")
        bills = _bills(server)
        spent = sum(bills)
        rows.append(f"| {label} | {estimate:.4f} | {full:.4f} | {cap:.4f} | {spent:.4f} | {spent / cap:.0%} | "
                    f"{max(spent - cap, 0):.4f} | {max(bills, default=0):.4f} | {len(bills)} | {code} |")

    for concurrency in (1, 8, 32):
        with FaultServer(default="rich") as server:
            case(f"LLM, concurrency {concurrency}, cap 1.1 x the estimate", server, _llm(server, concurrency=concurrency),
                 lambda full, estimate: estimate * 1.1)
        with FaultServer(default="reasoning:3000") as server:
            case(f"LLM billing 3,000 reasoning tokens a reply, concurrency {concurrency}, cap 1.1 x the estimate",
                 server, _llm(server, concurrency=concurrency), lambda full, estimate: estimate * 1.1)
    with FaultServer(default="reasoning:50000") as server:
        case("LLM billing 50,000 reasoning tokens a reply past max_output_tokens 512, cap 0.3 x the real cost",
             server, _llm(server, max_output_tokens=512), lambda full, estimate: full * 0.3)
    with FaultServer(token_factor=10) as server:
        case("priced embeddings (offline engine), provider counting 10 x the tokens, cap 0.4 x the real cost",
             server, _embeddings(server), lambda full, estimate: full * 0.4)
    with FaultServer(default="rich", token_factor=10) as server:
        case("LLM and embeddings, 10 x the tokens, concurrency 32, cap 0.5 x the real cost", server,
             {**_llm(server, concurrency=32), **_embeddings(server)}, lambda full, estimate: full * 0.5)
    return ["## The spending cap against what providers bill (issue 37, H12-H14)", "",
            "Command: `python -m bench.bench_hardening`. Each case: an uncapped run (its bill is the real cost), the "
            "dry run's estimate, then a fresh run with `--max-cost` where the case says. Exit 0: finished in one run; exit 1: "
            "stopped at the cap, its paid work kept. The cap's promise: a run whose real cost is under the cap "
            "finishes, and the spend passes the cap by no more than one request's bill.", "",
            "| case | estimate $ | real cost $ | cap $ | spent $ | spent / cap | over the cap $ | dearest request $ | "
            "requests | exit |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "hardening")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 100])
    parser.add_argument("--quick", action="store_true", help="sizes 1 and 10 MB, one round")
    args = parser.parse_args(argv)
    sizes = [1, 10] if args.quick else args.sizes
    lines = chunking_section(args.work, sizes, 1 if args.quick else 3) + [""] + cap_section(args.work)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
