"""The five LLM tasks of NodeRAG behind one small interface.

Every task is batched (a stage hands the engine all its items at once) so that an
engine with network calls can run them concurrently; the offline engine just loops.
A task item either succeeds or comes back as a `Failure`, which a stage records and
never stores as content.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Advance = Callable[[int], None]
"""Called with the number of items just finished, so a stage can advance its bar (a
`index/stages.Reporter`'s `advance`)."""



@dataclass(frozen=True)
class Unit:
    """One semantic unit of a chunk: a self-contained statement, its entities and triples."""

    text: str
    entities: tuple[str, ...] = ()
    relations: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Element:
    """One high-level element of a community: a keyword title (O) and its description (H)."""

    title: str
    description: str


@dataclass(frozen=True)
class Failure:
    reason: str


@dataclass(frozen=True)
class ChunkInput:
    chunk_id: str
    text: str
    title: str = ""


@dataclass(frozen=True)
class AttributeInput:
    """An important entity and the texts of its S and R neighbours (not raw chunks)."""

    entity: str
    texts: tuple[str, ...]


@dataclass(frozen=True)
class CommunityInput:
    """A community's S and A member texts, already cut to the configured token budget."""

    community: int
    texts: tuple[str, ...]


@dataclass
class TaskStats:
    """LLM accounting for one task, shown by `noderag stats` per stage."""

    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    ungrounded: int = 0  # names, relationships, units... a reply gave that its input does not support
    rate_limit_waits: int = 0  # 429 replies waited out
    connection_checks: int = 0  # the tiny call before a run's first request (its tokens are counted too)
    rate_limit_seconds: float = 0.0  # how long those waits took in total

    def add(self, other: TaskStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class EngineStats:
    by_task: dict[str, TaskStats] = field(default_factory=dict)
    failure_reasons: Counter = field(default_factory=Counter)

    def task(self, name: str) -> TaskStats:
        return self.by_task.setdefault(name, TaskStats())


class Engine:
    """What a stage may ask of an engine: the five tasks, and the optional capabilities with their
    defaults here, so that no caller probes for them. `identity` (engines/identity.py) goes into
    stage fingerprints and cache keys; `name` is its short form. Whatever a run wants of an engine
    (where to show its waits, a spending cap) is given when it is made."""

    name: str
    identity: dict
    stats: EngineStats
    pure_decompose: Callable[[ChunkInput], list[Unit] | Failure] | None = None
    """A decomposition that is a pure function of the chunk, which indexing may run on worker
    processes; None: every chunk goes through `decompose`, in the indexing process."""
    price_known: bool | None = None
    """False once a request's tokens had no price (its cost is then unknown, never $0)."""
    failures_are_final: bool = False
    """Whether an item it fails on fails the same way on every run (a deterministic engine): such a
    failure is reported by the run that meets it and kept in the failures tables, but no run retries
    it or exits 1 for it again."""
    asks_a_model: bool = False
    """Whether its tasks are requests to a language model: replies that cost money and time, kept in
    the cache and counted by `index --dry-run`; what only a model can write (HyDE's passage, an
    answer judged by a model) needs one."""
    cites_context: bool = False
    """Whether its answer reads the context numbered and cites it ([n]); otherwise the answer names
    its sources itself."""

    def decompose(self, chunks: Sequence[ChunkInput], progress: Advance | None = None) -> list[list[Unit] | Failure]:
        raise NotImplementedError

    def attributes(self, items: Sequence[AttributeInput], progress: Advance | None = None) -> list[str | Failure]:
        raise NotImplementedError

    def community_elements(
        self, items: Sequence[CommunityInput], progress: Advance | None = None
    ) -> list[list[Element] | Failure]:
        raise NotImplementedError

    def query_entities(self, question: str) -> list[str]:
        raise NotImplementedError

    def answer(self, question: str, context: str) -> str:
        raise NotImplementedError

    def passage(self, question: str) -> str:
        """A hypothetical passage that answers `question` (HyDE), when it `asks_a_model`."""
        raise NotImplementedError

    def answer_parts(self, question: str, context: str) -> tuple[str | None, str]:
        """(the short answer, or None when the engine gives none or the context holds none; the
        answer as printed). An LLM's answer is one text: no short answer of its own."""
        return None, self.answer(question, context)

    def answer_batch(self, items: Sequence[tuple[str, str]], progress: Advance | None = None) -> list[str | Failure]:
        """Answers for (question, context) pairs (evaluation runs); an engine with network calls
        makes them concurrently."""
        replies = []
        for question, context in items:
            replies.append(self.answer(question, context))
            if progress:
                progress(1)
        return replies
