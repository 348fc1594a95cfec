"""Writes that never replace or follow what is not ours, and paid work that is never silently lost
(issue 37, H6-H8, H10, H11): an output named by a link or a special file is refused or written
through, never replaced; a workspace's own files are never written through links; gc never
deletes through one; a document that cannot be read keeps its last content; an emptied cache is
named. Every write-side case also runs under strace, which must show no file outside the workspace
and the named output written, truncated, replaced or deleted."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SAMPLE_CORPUS, assert_one_line_error, copy_workspace, index, noderag

QUESTION = "Who founded the Sound Maritime Society?"
OUTSIDE = "the owner's own file: never to be touched\n"


@pytest.fixture
def ws(built, tmp_path) -> Path:
    return copy_workspace(built, tmp_path / "ws")


def _outside(tmp_path: Path, name: str = "precious.txt") -> Path:
    target = tmp_path / "elsewhere" / name
    target.parent.mkdir(exist_ok=True)
    target.write_text(OUTSIDE)
    return target


# --------------------------------------------------------------------------- H6: outputs
def test_an_output_named_by_a_link_is_refused_and_its_target_untouched(ws, tmp_path):
    target = _outside(tmp_path)
    link = tmp_path / "page.html"
    link.symlink_to(target)
    for args in (("query", ws, QUESTION, "--html", link), ("export", ws, "--format", "graphml", "--out", link)):
        run = noderag(*args)
        assert run.returncode == 2
        assert_one_line_error(run, "symbolic link")
        assert link.is_symlink() and target.read_text() == OUTSIDE


def test_an_output_that_is_a_fifo_is_written_through_and_stays_a_fifo(ws, tmp_path):
    fifo = tmp_path / "page.fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    run = noderag("query", ws, QUESTION, "--html", fifo)
    reader.join(30)
    assert run.returncode == 0, run.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert received and received[0].startswith(b"<!DOCTYPE html>")


def test_an_output_that_is_a_character_device_is_written_through(ws, tmp_path):
    """As root the page went to `/dev/null` by renaming a regular file over the system's device."""
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the null device, here
    except PermissionError:
        device = Path("/dev/null")  # not root (nothing here could replace it either)
    before = os.lstat(device)
    for args in (("query", ws, QUESTION, "--html", device), ("export", ws, "--format", "graphml", "--out", device)):
        run = noderag(*args)
        assert run.returncode == 0, run.stderr
        after = os.lstat(device)
        assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_an_output_in_a_missing_folder_is_refused_without_making_folders(ws, tmp_path):
    missing = tmp_path / "nonexistent" / "dir"
    for args in (("query", ws, QUESTION, "--html", missing / "p.html"),
                 ("export", ws, "--format", "graphml", "--out", missing / "g.graphml"),
                 ("export", ws, "--format", "csv", "--out", missing / "csv")):
        run = noderag(*args)
        assert run.returncode == 2
        assert_one_line_error(run, "does not exist")
    assert not (tmp_path / "nonexistent").exists()


def test_an_output_on_a_full_device_is_one_line(ws):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    run = noderag("query", ws, QUESTION, "--html", "/dev/full")
    assert run.returncode == 2
    assert_one_line_error(run, "cannot write", "/dev/full")
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


# --------------------------------------------------------------------------- H7: the workspace's own files
@pytest.mark.parametrize("name", [".lock", "noderag.log", "cache.sqlite"])
def test_a_workspace_file_that_is_a_link_is_never_written_through(ws, tmp_path, name):
    target = _outside(tmp_path)
    (ws / name).unlink(missing_ok=True)
    (ws / name).symlink_to(target)
    run = index(ws, SAMPLE_CORPUS, expect=3)
    assert_one_line_error(run, name, "symbolic link", f"rm {ws / name}")
    assert target.read_text() == OUTSIDE


def test_a_workspace_folder_that_is_a_link_is_never_written_into(ws, tmp_path):
    elsewhere = tmp_path / "elsewhere-stages"
    shutil.move(ws / "stages", elsewhere)
    (ws / "stages").symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    run = index(ws, SAMPLE_CORPUS, expect=3)
    assert_one_line_error(run, "stages", "symbolic link")
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


# --------------------------------------------------------------------------- H8: gc
def test_gc_never_deletes_through_a_link_in_generations(built, tmp_path):
    mine = copy_workspace(built, tmp_path / "mine")
    other = copy_workspace(built, tmp_path / "other")
    theirs = other / "generations" / (other / "CURRENT").read_text().strip()
    (mine / "generations" / "g000000").symlink_to(theirs)
    files_before = sorted(p.name for p in theirs.iterdir())
    for args in (("gc", mine), ("index", mine, "--input", SAMPLE_CORPUS)):
        run = noderag(*args)
        assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in theirs.iterdir()) == files_before
    assert not (mine / "generations" / "g000000").exists() and not (mine / "generations" / "g000000").is_symlink()
    assert noderag("query", other, QUESTION, "--context-only").returncode == 0


# --------------------------------------------------------------------------- strace over the cases above
STRACED = "openat,creat,open,rename,renameat,renameat2,unlink,unlinkat,rmdir,truncate,ftruncate,mkdir,mkdirat," \
          "linkat,symlinkat,fchmodat,chmod"
_WRITE_FLAGS = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND")
_PATH = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _touched(trace: str) -> set[str]:
    """Every path a traced process wrote, created, truncated, renamed, linked or removed (succeeded
    calls only), resolved: an open's own descriptor as strace resolved it (-y), else the path given."""
    found = set()
    for line in trace.splitlines():
        call = re.search(r"\b(openat|open|creat|renameat2|renameat|rename|unlinkat|unlink|rmdir|truncate|mkdirat|mkdir|"
                         r"linkat|symlinkat|fchmodat|chmod)\(", line)
        if call is None or re.search(r"= -1 ", line) or "<unfinished" in line:
            continue
        name = call.group(1)
        if name in ("openat", "open") and not _WRITE_FLAGS.search(line):
            continue
        if name in ("openat", "open", "creat"):
            fd = re.search(r"= \d+<([^>]*)>", line)
            if fd:
                found.add(fd.group(1))
            continue
        paths = _PATH.findall(line)
        if paths:
            base = re.search(r"\((?:AT_FDCWD|\d+)<([^>]*)>", line)
            last = paths[-1]
            found.add(last if last.startswith("/") or base is None else os.path.join(base.group(1), last))
    return found


def _allowed(path: str, roots: list[Path]) -> bool:
    if path.startswith(("/proc/", "/dev/pts/", "/dev/shm/", "pipe:", "socket:", "anon_inode:")) or path == "/dev/null":
        return True
    if "/__pycache__/" in path or path.startswith(str(Path(sys.prefix))):  # the interpreter's own caches
        return True
    return any(path == str(root) or path.startswith(str(root) + "/") for root in roots)


@pytest.mark.skipif(shutil.which("strace") is None and not os.environ.get("NODERAG_REQUIRE_TOOLS"),
                    reason="strace is not installed (tests/system_support/install_tools.sh installs it)")
def test_strace_shows_nothing_outside_the_workspace_and_the_output_written(built, tmp_path):
    ws = copy_workspace(built, tmp_path / "ws")
    other = copy_workspace(built, tmp_path / "other")
    target = _outside(tmp_path)
    fifo = tmp_path / "page.fifo"
    os.mkfifo(fifo)
    threading.Thread(target=lambda: fifo.read_bytes(), daemon=True).start()
    (tmp_path / "page.html").symlink_to(target)
    (ws / "generations" / "g000000").symlink_to(other / "generations" / (other / "CURRENT").read_text().strip())
    log = ws / "noderag.log"
    log.unlink(missing_ok=True)
    log.symlink_to(_outside(tmp_path, "log.txt"))
    cases = [(("query", ws, QUESTION, "--html", tmp_path / "page.html"), [ws]),
             (("query", ws, QUESTION, "--html", fifo), [ws, fifo]),
             (("query", ws, QUESTION, "--html", tmp_path / "out" / "p.html"), [ws]),
             (("export", ws, "--format", "graphml", "--out", tmp_path / "page.html"), [ws]),
             (("index", ws, "--input", SAMPLE_CORPUS), [ws]),
             (("gc", ws), [ws])]
    trace_file = tmp_path / "trace"
    for args, roots in cases:
        subprocess.run(["strace", "-f", "-y", "-qq", "-e", f"trace={STRACED}", "-o", str(trace_file), sys.executable,
                        "-m", "noderag_cli.cli", *map(str, args)], cwd=REPO, capture_output=True, timeout=300)
        outside = sorted(p for p in _touched(trace_file.read_text()) if not _allowed(p, roots + [Path("/tmp")]
                                                                                    if args[0] == "index" else roots))
        assert not outside, f"{args[0]} wrote outside its workspace and output: {outside}"
    assert target.read_text() == OUTSIDE and (tmp_path / "elsewhere" / "log.txt").read_text() == OUTSIDE
    assert (other / "generations" / (other / "CURRENT").read_text().strip() / "manifest.json").is_file()


# --------------------------------------------------------------------------- H10, H11: paid work
def _without_read_bypass() -> list[str]:
    """A prefix that runs a command without root's right to read any file (as a user would run it)."""
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


@pytest.mark.llm
def test_a_document_that_becomes_unreadable_keeps_its_last_content_and_its_paid_work(tmp_path):
    """H10: permission denied was "deleted": dropped from the build, its replies collected by gc and
    paid again. Now: a failed item (exit 1) whose content stays; gc keeps its replies; once it can be
    read again nothing is asked again."""
    from devtools.fault_server import FaultServer, llm_section

    if os.geteuid() == 0 and shutil.which("setpriv") is None and not os.environ.get("NODERAG_REQUIRE_TOOLS"):
        pytest.skip("running as root without setpriv: no file can be made unreadable")
    docs = tmp_path / "docs"
    shutil.copytree(SAMPLE_CORPUS, docs, ignore=shutil.ignore_patterns("questions.jsonl", "history"))
    victim = docs / "greyling_medal.md"
    with FaultServer(default="rich") as server:
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10}}))
        ws = tmp_path / "ws"
        prefix = _without_read_bypass()
        first = noderag("index", ws, "--input", docs, "--config", config, "--json", prefix=prefix)
        assert first.returncode == 0, first.stderr
        victim.chmod(0)
        try:
            server.reset()
            for _ in range(2):
                run = noderag("index", ws, "--input", docs, "--config", config, "--json", prefix=prefix)
                assert run.returncode == 1, run.stderr
                assert "could not read greyling_medal.md: unreadable: Permission denied; its last content stays" \
                    in run.stderr
                assert json.loads(run.stdout)["documents"]["deleted"] == 0
            context = noderag("query", ws, "What is the Greyling Medal?", "--json", "--budget", "2000").json()
            assert any("greyling_medal.md" in d for node in context["nodes"] for d in node["documents"])
            assert noderag("gc", ws, prefix=prefix).returncode == 0  # what the kept content needs stays
        finally:
            victim.chmod(0o644)
        server.reset()
        back = noderag("index", ws, "--input", docs, "--config", config, "--json", prefix=prefix)
        assert back.returncode == 0, back.stderr
        asked = [r for r in server.completions() if "Reply with the word OK" not in json.dumps(r.body)]
        assert asked == [], f"{len(asked)} requests paid again"


@pytest.mark.llm
def test_an_emptied_cache_is_named_with_what_it_held(tmp_path):
    """H11: `: > cache.sqlite` passed `stats --verify`, and the next index paid everything again."""
    from devtools.fault_server import FaultServer, llm_section

    with FaultServer(default="rich") as server:
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10}}))
        ws = tmp_path / "ws"
        index(ws, SAMPLE_CORPUS, "--config", config)
        held = json.loads((ws / "manifest.json").read_text())["cache"]
        assert held["paid_replies"] > 0
        (ws / "cache.sqlite").write_bytes(b"")
        verify = noderag("stats", ws, "--verify")
        assert verify.returncode == 3
        assert_one_line_error(verify, "cache.sqlite", f"{held['entries']:,} entries", "paid LLM replies")
        server.reset()
        refused = index(ws, SAMPLE_CORPUS, "--config", config, expect=3)
        assert_one_line_error(refused, "cache.sqlite", "--accept-cache-loss")
        assert server.completions() == []
        accepted = index(ws, SAMPLE_CORPUS, "--config", config, "--accept-cache-loss")
        assert "cache.sqlite holds 0 entries" in accepted.stderr  # said once more, then taken as it is
        assert noderag("stats", ws, "--verify").returncode == 0
