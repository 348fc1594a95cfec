"""Every error noderag raises on purpose, under one base per exit code; the CLI maps the bases to
codes in one place (`exit_code`). Each message is one line, safe to print as is (never a key)."""

from __future__ import annotations


class NoderagError(Exception):
    exit_code = 1


class BadInputError(NoderagError, ValueError):
    """Bad input or usage: exit 2, and nothing in a workspace is changed."""

    exit_code = 2


class ConfigError(BadInputError):
    """A config file (or a prompt file it names) that cannot be read or does not validate."""


class InputError(BadInputError):
    """The input folder cannot be indexed at all."""


class QueryError(BadInputError):
    """A question that cannot be searched (empty, too long)."""


class QuestionFileError(BadInputError):
    """A question file that cannot be read, or holds no usable question."""


class AblationInputError(BadInputError):
    """Bad input to an ablation run (unknown strategy, bad budget, unusable output folder...)."""


class SpendingCapError(NoderagError, RuntimeError):
    """A run stopped at its spending cap: what it paid for is kept (cached) and the next run with a
    raised cap goes on from there (exit 1, like a run with failed items)."""


class WorkerLostError(NoderagError, RuntimeError):
    """A worker process died every time it ran the same work (exit 1): what finished is kept, and the
    next run goes on from there."""


class OutputError(NoderagError, OSError):
    """Standard output cannot be written (a full disk, an I/O error): exit 1; the workspace is as it was."""


class WorkspaceError(NoderagError, RuntimeError):
    """A workspace that cannot be used as asked (locked, not indexed, damaged, wrong model...): exit 3."""

    exit_code = 3


class NoBuildError(WorkspaceError):
    """A workspace with no complete build to read yet."""


class DamagedError(WorkspaceError):
    """A workspace file that is missing, truncated or altered; the message names it and the repair."""


class EngineError(NoderagError, RuntimeError):
    """The engine cannot work as configured (no key, unknown provider, unreachable server...): exit 4.
    The message is cut to one line of at most 300 characters."""

    exit_code = 4

    def __init__(self, message: str):
        line = " ".join(str(message).split())
        super().__init__(line if len(line) <= 300 else line[:297] + "...")
