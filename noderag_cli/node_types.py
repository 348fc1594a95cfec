"""The seven node types and every fact about them, in one place for every table, array, compiled
kernel, page and export: `TYPES`, one record per type; the tuples and codes below are derived.

A letter is a node id's prefix (`S_…`) and its `type` column. A code numbers the type in arrays
(a build's `type_codes.npy`) and in the kernels: retrievable types first, so `code <=
MAX_RETRIEVABLE_CODE` says retrievable. Changing a code changes what every build holds on disk
(bump `search/prepare.VERSION`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NodeType:
    letter: str
    name: str  # what a reader calls it (the page's legend)
    label: str  # its name in exports (GraphML, CSV)
    colour: str  # on the page
    retrievable: bool = False  # may be in a context
    embedded: bool = False  # has a vector
    quota: str | None = None  # the search setting that caps its cross nodes (paper §2.5)
    context_rank: int | None = None  # where a context shows it (lower first); None: shown last
    restates: bool = False  # restates what other nodes say: what a context gives up first to show a chunk whole
    community_content: bool = False  # what a community's summary is written from


TYPES = (  # the paper's order (tables, stats)
    NodeType("T", "text chunk", "Text", "#7f7f7f", retrievable=True, embedded=True, quota="cross_t", context_rank=4),
    NodeType("S", "semantic unit", "SemanticUnit", "#1f77b4", retrievable=True, embedded=True, quota="cross_s",
             context_rank=2, community_content=True),
    NodeType("N", "entity", "Entity", "#d62728"),
    NodeType("R", "relationship", "Relationship", "#ff7f0e", retrievable=True, quota="cross_r", context_rank=3,
             restates=True),
    NodeType("A", "attribute", "Attribute", "#2ca02c", retrievable=True, embedded=True, quota="cross_a",
             context_rank=1, restates=True, community_content=True),
    NodeType("H", "high-level element", "HighLevelElement", "#9467bd", retrievable=True, embedded=True,
             quota="cross_h", context_rank=0, restates=True),
    NodeType("O", "overview", "HighLevelOverview", "#8c564b"),
)
BY_LETTER = {t.letter: t for t in TYPES}
NODE_TYPES = tuple(t.letter for t in TYPES)

CODE_ORDER = "TSAHRNO"  # retrievable types first
TYPE_CODE = {t: i for i, t in enumerate(CODE_ORDER)}
TYPE_LETTERS = np.array(list(CODE_ORDER), dtype="<U1")  # by type code
CHUNK, UNIT, ATTRIBUTE, HIGH_LEVEL, RELATION, ENTITY, OVERVIEW = (TYPE_CODE[t] for t in "TSAHRNO")
RETRIEVABLE_TYPES = tuple(t for t in CODE_ORDER if BY_LETTER[t].retrievable)  # by code
EMBEDDED_TYPES = tuple(t for t in CODE_ORDER if BY_LETTER[t].embedded)
COMMUNITY_CONTENT_TYPES = tuple(t for t in CODE_ORDER if BY_LETTER[t].community_content)
CONTEXT_ORDER = tuple(sorted((t.letter for t in TYPES if t.context_rank is not None),
                             key=lambda letter: BY_LETTER[letter].context_rank))
RESTATING_CODES = frozenset(TYPE_CODE[t.letter] for t in TYPES if t.restates)
MAX_RETRIEVABLE_CODE = len(RETRIEVABLE_TYPES) - 1
QUOTA_SETTINGS = tuple(BY_LETTER[t].quota for t in RETRIEVABLE_TYPES)  # by code
assert set(CODE_ORDER) == set(NODE_TYPES) and CODE_ORDER[: len(RETRIEVABLE_TYPES)] == "".join(RETRIEVABLE_TYPES)
