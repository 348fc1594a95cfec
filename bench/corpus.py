"""A deterministic corpus of any size from the dev sets: MuSiQue's and HotpotQA's passages, then
renamed copies of them, one passage per file (title on the first line).

    python -m bench.corpus OUT --passages 100000 [--data ../shared/eval]

A renamed copy replaces every capitalised word of a title and a text by a pseudo-word drawn from a
hash of the word and the copy's number, so each copy brings new texts, titles and entities, while
numbers, dates and the rest of the wording stay (as the same years and common words recur across
a real corpus). The first N passages of the sequence copy 0, copy 1, ... make the corpus of size N,
so a smaller corpus is a prefix of a larger one. Files already holding the right text are left
alone, so regenerating an existing folder costs a read per file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "ba", "de", "fi", "go", "hu", "ja"]
CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "eval"


def pseudo_word(word: str, copy: int) -> str:
    digest = hashlib.blake2b(f"{copy}\x1f{word}".encode(), digest_size=8).digest()
    return "".join(SYLLABLES[b % len(SYLLABLES)] for b in digest[: 2 + digest[7] % 3]).capitalize()


def renamed(text: str, copy: int) -> str:
    return text if copy == 0 else CAPITALISED.sub(lambda m: pseudo_word(m.group(0), copy), text)


def available(data: Path) -> bool:
    return (data / "musique" / "corpus.json").is_file() and (data / "hotpotqa" / "corpus.json").is_file()


def passages(data: Path) -> list[tuple[str, str]]:
    """The dev sets' passages as (title, text), MuSiQue's first."""
    musique = json.loads((data / "musique" / "corpus.json").read_text(encoding="utf-8"))
    hotpot = json.loads((data / "hotpotqa" / "corpus.json").read_text(encoding="utf-8"))
    return [(p["title"], p["text"]) for p in musique] + [(t, "".join(s)) for t, s in hotpot.items()]


def write_corpus(data: Path, folder: Path, count: int) -> int:
    """The first `count` passages of the sequence into `folder` (c<copy>/p<position>.txt); files of
    an earlier, larger call are removed. Returns the raw text's size in bytes."""
    base = passages(data)
    wanted: set[Path] = set()
    size = 0
    for number in range(count):
        copy, position = divmod(number, len(base))
        title, text = base[position]
        target = folder / f"c{copy:03d}" / f"p{position:05d}.txt"
        body = f"{renamed(title, copy)}\n{renamed(text, copy)}\n"
        data_bytes = body.encode("utf-8")
        size += len(data_bytes)
        wanted.add(target)
        if not target.is_file() or target.read_bytes() != data_bytes:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data_bytes)
    for path in folder.rglob("*.txt"):
        if path not in wanted:
            path.unlink()
    return size


def write_small_files(data: Path, folder: Path, count: int) -> int:
    """`count` files of one sentence each (the passages' sentences in order, then renamed copies), a
    thousand to a folder: the many-small-files case. Returns the raw text's size in bytes."""
    sentences = [s for _, text in passages(data) for s in SENTENCE_END.split(text) if s.strip()]
    size = 0
    for number in range(count):
        copy, position = divmod(number, len(sentences))
        target = folder / f"d{number // 1000:04d}" / f"s{number % 1000:03d}.txt"
        data_bytes = f"{renamed(sentences[position].strip(), copy)}\n".encode()
        size += len(data_bytes)
        if not target.is_file() or target.read_bytes() != data_bytes:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data_bytes)
    return size


def sync_folder(source: Path, target: Path) -> None:
    """Make `target` hold `source`'s files, writing only those that differ and deleting those gone,
    as a user's folder changes in place (or rsync updates a copy): the files that stay keep their
    inode and times, so a scan knows them by their size and times."""
    wanted = {p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()}
    if target.is_dir():
        for path in [p for p in target.rglob("*") if p.is_file()]:
            if path.relative_to(target).as_posix() not in wanted:
                path.unlink()
    for name in sorted(wanted):
        data, path = (source / name).read_bytes(), target / name
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--passages", type=int, required=True)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    if not available(args.data):
        print(f"no MuSiQue and HotpotQA corpora under {args.data}", file=sys.stderr)
        return 2
    size = write_corpus(args.data, args.out, args.passages)
    print(f"{args.passages:,} passages, {size / 1e6:.1f} MB of text in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
