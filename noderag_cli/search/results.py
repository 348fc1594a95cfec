"""What a search returns: the chosen nodes with their scores, text, sources and tokens, how they
were reached, and (when asked) the answer with the context lines it cites. Its JSON shape is
`as_dict`, which `query --json` prints."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import paths

PLAIN_TEXT = (".txt", ".md", ".markdown", ".rst")  # their sections are not named in a source: the path says enough
_UNITS = (("pages", "p.", "pp."), ("slides", "slide", "slides"), ("sheets", "sheet", "sheets"))


def place_label(place: dict) -> str:
    """How a place is named where an answer cites it: "reports/q3.pdf pp. 12-13", "deck.pptx
    slide 4", "book.xlsx sheet Q3", "manual.html § Installing" (the first section the chunk is
    in), or the document's path alone."""
    path = place.get("document", "")
    for kind, one, many in _UNITS:
        values = place.get(kind)
        if values:
            numbered = all(isinstance(v, int) for v in values)
            shown = f"{values[0]}-{values[-1]}" if numbered and len(values) > 1 else ", ".join(map(str, values))
            return f"{path} {one if len(values) == 1 else many} {shown}"
    sections = place.get("sections")
    if sections and not path.lower().endswith(PLAIN_TEXT):
        return f"{path} § {re.sub(r'[()]', '', sections[0])}"
    return path


@dataclass
class RetrievedNode:
    id: str
    type: str
    score: float
    text: str
    documents: list[str]
    tokens: int
    locations: list[dict] = field(default_factory=list)  # where it came from: a place per chunk (prepare.places)
    row: int = field(default=-1, repr=False, compare=False)  # its row in the build (not shown)
    via: str = ""  # how the search reached it: exact, vector, bridge (entry points) or walk (search/paths.py)
    path: list[str] = field(default_factory=list)  # node ids from an entry point to it, when explained

    @property
    def sources(self) -> list[str]:
        """Its places as an answer names them (`place_label`), each once; its documents where the
        build records no places."""
        return list(dict.fromkeys(place_label(p) for p in self.locations)) if self.locations else self.documents

    def as_dict(self) -> dict:
        shown = {"id": self.id, "type": self.type, "score": round(self.score, 8), "text": self.text,
                 "documents": self.documents, "locations": self.locations, "tokens": self.tokens, "via": self.via}
        if self.path:
            shown["path"] = self.path
            if len(self.path) > 1:
                shown["from"] = self.path[-2]
                shown["edge"] = paths.edge_kind(self.path[-2][0], self.type)
        return shown


@dataclass
class Retrieval:
    question: str
    nodes: list[RetrievedNode] = field(default_factory=list)
    entry_points: dict[str, list[str]] = field(default_factory=lambda: {"exact": [], "vector": []})
    query_entities: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    answer: str | None = None
    short_answer: str | None = None  # the value the answer names, when the engine gives one (the offline engine)
    smallest_match_tokens: int = 0  # the smallest node the search chose before the budget (0: none chosen)
    citations: list[dict] | None = None  # an LLM answer's [n]: the numbered context node each one names
    invalid_citations: int = 0  # [n] in the answer that number no context node (left out of `citations`)
    path_nodes: list[RetrievedNode] = field(default_factory=list)  # on the nodes' paths, not in the context

    @property
    def context_tokens(self) -> int:
        return sum(n.tokens for n in self.nodes)

    def context_text(self, numbered: bool = False) -> str:
        """What the answer step reads: nodes grouped by type, each with its sources; `numbered`:
        each line starts with [n] (from 1), the number an LLM answer cites it by."""
        lines = []
        for number, node in enumerate(self.nodes, 1):
            source = f" (from {', '.join(node.sources)})" if node.sources else ""
            lines.append((f"[{number}] " if numbered else "") + f"[{node.type}] {node.text}{source}")
        return "\n".join(lines)

    def cite(self) -> None:
        """`citations` from the [n] (or [n, m]) markers of the answer: each number used, once, in
        order, with its node's id and documents; a number outside the context is counted instead."""
        self.citations, self.invalid_citations = [], 0
        seen: set[int] = set()
        for group in re.findall(r"\[(\d+(?:\s*[,;]\s*\d+)*)\]", self.answer or ""):
            for number in map(int, re.split(r"\s*[,;]\s*", group)):
                if not 1 <= number <= len(self.nodes):
                    self.invalid_citations += 1
                elif number not in seen:
                    seen.add(number)
                    node = self.nodes[number - 1]
                    self.citations.append({"n": number, "id": node.id, "documents": node.documents,
                                           "sources": node.sources})

    def as_dict(self) -> dict:
        shown = {"question": self.question, "answer": self.answer, "short_answer": self.short_answer,
                 "context_tokens": self.context_tokens,
                 "query_entities": self.query_entities, "nodes": [n.as_dict() for n in self.nodes],
                 "entry_points": self.entry_points, "timings": {k: round(v, 3) for k, v in self.timings.items()}}
        if self.citations is not None:
            shown |= {"citations": self.citations, "invalid_citations": self.invalid_citations}
        if any(n.path for n in self.nodes):
            shown["path_nodes"] = [n.as_dict() for n in self.path_nodes]
        return shown
