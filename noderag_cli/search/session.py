"""A workspace's current build opened for questions: the config it is searched with, the engine
and embedder, and a `Session` that answers many questions from one opening."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..config import Config, SearchConfig, changed, load_config
from ..embeddings import Embedder, check_embedding, model_id
from ..engines import make_engine
from ..errors import ConfigError
from ..generation import Generation, damaged, repair_hint
from ..workspace import Workspace

if TYPE_CHECKING:
    from .results import Retrieval
    from .retriever import Retriever


class Session:
    """An opened build for many questions: everything is opened once. The build stays readable
    (an `index` run does not remove it) until `close`, or the end of the process."""

    def __init__(self, retriever: Retriever):
        self.retriever = retriever

    @property
    def generation(self) -> str:
        """The build the answers come from."""
        return self.retriever.build.generation.name

    def search_settings(self, **changes) -> SearchConfig:
        """This session's search settings with some changed (validated: ConfigError), for `params`."""
        return changed(self.retriever.config.search, **changes)

    def retrieve(self, question: str, params: SearchConfig | None = None, explain: bool = False) -> Retrieval:
        """The context; `explain`: with the path the walk took to each node (search/paths.py)."""
        return self.retriever.retrieve(question, params, explain)

    def ask(self, question: str, answer: bool = True, params: SearchConfig | None = None,
            explain: bool = False) -> Retrieval:
        result = self.retriever.retrieve(question, params, explain)
        return self.retriever.answer(result) if answer else result

    def close(self) -> None:
        self.retriever.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

COMPILED_FROM_QUESTIONS = 1000
"""Questions in one process from which the vector side's compiled kernels pay for their load (they
save about a millisecond per question at 100,000 passages); the CLI opens smaller batches without
them."""


def build_config(generation: Generation, ws: Workspace, config_path: Path | None = None) -> Config:
    """The config to search a build with: the file given (searching with the build's own embedding
    model when it names none), else the config the build was made with."""
    own_path = generation.path("config.yaml")
    own_file = own_path if own_path.is_file() else None
    try:
        own = load_config(own_file)
    except ConfigError as err:  # written by noderag itself: unreadable is damaged, and `index` writes it again
        raise damaged(own_path, ws.root, str(err).split(": ", 1)[-1],
                      repair_hint(ws.root, generation.manifest.get("input"))) from None
    if config_path is None:
        return own
    config = load_config(config_path)
    if "embedding" not in (yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}):
        config = config.model_copy(update={"embedding": own.embedding})
    check_embedding(ws.root, model_id(own.embedding), model_id(config.embedding))
    return config


def open_workspace(workspace: str | Path, config: Config | None = None, config_path: Path | None = None,
                   compiled: bool = True) -> Session:
    """Open a workspace's current build for search, without writing anything to it. A config file
    given here that names no embedding section searches with the build's own embedding model; one
    that names another model is refused. `compiled`: scan the vector side with numba kernels
    (search/kernels.py), for long-lived sessions; the results are the same either way."""
    ws = Workspace(Path(workspace))
    generation = ws.open_generation()
    try:
        if config is None:
            config = build_config(generation, ws, config_path)
        from .retriever import Retriever

        embedder = Embedder(config.embedding, None)
        engine = make_engine(config, ws.read_only_cache(), embedder)
        return Session(Retriever(generation, config, engine, embedder, compiled=compiled))
    except BaseException:
        generation.close()
        raise


def query(workspace: str | Path, question: str, answer: bool = True, config: Config | None = None) -> Retrieval:
    with open_workspace(workspace, config, compiled=False) as session:
        return session.ask(question, answer=answer)
