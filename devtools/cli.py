"""The real `noderag` CLI in a child process (`python -m noderag_cli.cli`), so exit codes, stderr
and SIGKILL behave exactly as for a user; and what a clean failure looks like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def noderag(*args, env: dict | None = None, prefix: list[str] | None = None, timeout: float = 300) -> Run:
    """Run `noderag ARGS...` as a child process; env adds to (a copy of) the current environment."""
    full_env = {k: v for k, v in os.environ.items() if k != "NODERAG_TEST_KILL_AT"}
    full_env.update({"COLUMNS": "200", "NO_COLOR": "1", **(env or {})})
    command = [*(prefix or []), sys.executable, "-m", "noderag_cli.cli", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)
    return Run([str(a) for a in args], done.returncode, done.stdout, done.stderr)


def assert_one_line_error(run: Run, *fragments: str) -> None:
    """A clean failure: no traceback, an `error:` line naming what is wrong."""
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
