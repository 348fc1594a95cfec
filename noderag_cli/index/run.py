"""An `index` run: the config it uses, the workspace lock, a damaged manifest or cache set aside
and salvaged, the spending cap checked before anything changes, then the pipeline (pipeline.py)."""

from __future__ import annotations

import errno
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ..cache import cache_damage, salvage_cache
from ..config import Config, changed, load_config
from ..embeddings import Embedder
from ..engines import make_engine
from ..errors import DamagedError, WorkspaceError
from ..executor import make_executor
from ..workspace import Workspace
from .pipeline import IndexResult, run_config, run_pipeline
from .scan import check_input_folder
from .stages import Reporter
from .state import Manifest, cache_loss


@dataclass(frozen=True)
class Reading:
    """What to read of the input folder, as `index`'s flags say it (None: as the config says); kept
    in the workspace's config, so the next run reads the same."""

    follow_symlinks: bool | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None


def workspace_config(ws: Workspace, config_path: Path | None = None, reading: Reading | None = None) -> Config:
    """The config an `index` run uses: the file given, else the workspace's own snapshot, else
    defaults; `reading` (the CLI's flags), where given, over its `chunk` settings."""
    if config_path is None and ws.config_path.is_file():
        config_path = ws.config_path
    config = load_config(config_path)
    changes = {k: v for k, v in vars(reading or Reading()).items() if v is not None}
    if changes:
        config = config.model_copy(update={"chunk": changed(config.chunk, **changes)})
    return config

_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ENOENT,
                errno.ENOTDIR, errno.EISDIR}


def index(
    workspace: str | Path, input_folder: str | Path, config: Config | None = None, config_path: Path | None = None,
    reporter: Reporter | None = None, stop_after: str | None = None, reading: Reading | None = None,
    max_cost_usd: float | None = None, accept_cache_loss: bool = False, exact: bool = False, rebuild: bool = False,
) -> IndexResult:
    """Index (or update) WORKSPACE from every document under input_folder. `reading`, where given,
    over the config's `chunk` settings of what to read (and kept in its snapshot); `max_cost_usd`
    over `llm.max_cost_usd`, for this run. A cache that lost paid LLM replies since the last run
    (emptied or replaced) stops the run unless `accept_cache_loss` (`_check_cache_kept`). `exact`:
    this run updates in exact mode; `rebuild`: a full build (`run_pipeline`).

    Raises InputError (bad input folder), ConfigError, BadInputError (the estimate is over the
    spending cap), WorkspaceError (path is a file, locked, other embedding model, cannot be
    written), SpendingCapError (stopped at the cap, the work paid for kept); nothing is created
    before the input is checked.
    """
    ws = Workspace(Path(workspace))
    ws.check_usable()
    check_input_folder(Path(input_folder))
    config = config or workspace_config(ws, config_path, reading)
    if max_cost_usd is not None:
        config = config.model_copy(update={"llm": changed(config.llm, max_cost_usd=max_cost_usd)})
    cap = None
    if config.llm.max_cost_usd is not None:
        from .estimate import spending_cap

        cap = spending_cap(ws, Path(input_folder), run_config(config, exact), rebuild)  # before anything is changed: refused runs change nothing
    with ws.lock():
        aside = ws.set_aside_manifest()
        if aside is not None:
            message = (f"workspace file {ws.manifest_path} was damaged: kept as {aside.name}; every stage runs again, "
                       "its work taken from the cache (nothing is paid twice)")
            ws.logger().warning(message)
            if reporter is not None:
                reporter.warn(message)
        problem = cache_damage(ws.cache_path, thorough=True)  # every page read once: a flipped bit is found here
        if problem:
            _salvage_damaged_cache(ws, problem, reporter)
        else:
            _check_cache_kept(ws, Path(input_folder), reporter, accept_cache_loss)
        try:
            return _run_index(ws, Path(input_folder), config, reporter, stop_after, cap, exact, rebuild)
        except sqlite3.DatabaseError as err:  # found damaged while the run read it: salvaged, then one more go
            _salvage_damaged_cache(ws, str(err), reporter)
        try:
            return _run_index(ws, Path(input_folder), config, reporter, stop_after, cap, exact, rebuild)
        except sqlite3.DatabaseError as err:
            raise WorkspaceError(f"workspace file {ws.cache_path} is still unusable after salvage ({err}); "
                                 "move it aside and run `noderag index` again") from err


def _run_index(ws: Workspace, input_folder: Path, config: Config, reporter: Reporter | None,
               stop_after: str | None, cap=None, exact: bool = False, rebuild: bool = False) -> IndexResult:
    executor = make_executor(config.executor)
    try:
        reporter = reporter or Reporter()
        embedder = Embedder(config.embedding, ws.cache, executor, cap=cap)
        engine = make_engine(config, ws.cache, embedder, executor, notice=reporter.warn, cap=cap)
        return run_pipeline(ws, input_folder, config, engine, embedder, executor, reporter, stop_after, exact, rebuild)
    except OSError as err:
        if isinstance(err, ConnectionError) or err.errno not in _DISK_ERRORS:
            raise
        where = f" ({err.filename})" if err.filename else ""
        raise WorkspaceError(f"cannot write workspace {ws.root}: {err.strerror or err}{where}") from err
    finally:
        executor.close()
        ws.close()


def _check_cache_kept(ws: Workspace, input_folder: Path, reporter: Reporter | None, accept: bool) -> None:
    """A cache emptied or replaced since the last run is named with what it held (`cache_loss`): a
    warning when only free work is lost; DamagedError (exit 3) when paid LLM replies are, unless the
    run was told to pay for them again."""
    loss = cache_loss(ws, Manifest.load(ws))
    if loss is None:
        return
    message, paid = loss
    if paid and not accept:
        raise DamagedError(f"{message}; restore it from a backup, or run `noderag index {ws.root} --input {input_folder} "
                           f"--accept-cache-loss` to compute (and pay for) its {paid:,} lost LLM replies again")
    message += "; what a run needs of it is computed (and paid for) again"
    ws.logger().warning(message)
    if reporter is not None:
        reporter.warn(message)


def _salvage_damaged_cache(ws: Workspace, problem: str, reporter: Reporter | None) -> None:
    """A damaged cache.sqlite: keep what SQLite can still read, keep the damaged file beside it,
    say so, and go on (what is lost is recomputed, LLM replies included)."""
    kept, rows = salvage_cache(ws.cache_path)
    message = (f"workspace file {ws.cache_path} was damaged ({problem}); kept {rows:,} readable entries, "
               f"the damaged file is now {kept.name}")
    ws.logger().warning(message)
    if reporter is not None:
        reporter.warn(message)
