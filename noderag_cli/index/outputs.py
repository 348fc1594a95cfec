"""Every file an indexing stage writes, declared once as a handle: (the stage, the file name).

A stage's outputs are its handles, and its inputs are the handles its code reads (stages.py):
its fingerprint holds the checksum of each input (pipeline.fingerprint), so it runs again when a
file it reads changes and only then, and it cannot read a file its reuse check does not watch
(`StageRun.read` refuses a handle the stage did not declare). Code outside a stage (the build, `stats`, `status`) reads
stage files through these handles too, never by a name of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from ..workspace import EDGES, NODES, Workspace


@dataclass(frozen=True)
class Output:
    stage: str
    file: str

    def path(self, ws: Workspace) -> Path:
        return ws.stage_path(self.stage, self.file)

    def read(self, ws: Workspace, columns: list[str] | None = None) -> pa.Table:
        return ws.read_table(self.path(ws), columns)


FAILURES = "failures.parquet"

DOCUMENTS = Output("chunk", "documents.parquet")
CHUNKS = Output("chunk", "chunks.parquet")
CHUNK_IDS = Output("chunk", "chunk_ids.parquet")  # the chunks' ids alone, sorted: a rename leaves it as it is

DECOMPOSE_NODES = Output("decompose", NODES)
DECOMPOSE_EDGES = Output("decompose", EDGES)
DECOMPOSE_FAILURES = Output("decompose", FAILURES)
OCCURRENCES = Output("decompose", "occurrences.parquet")  # each chunk's units and entities, as rows
LINKS = Output("decompose", "links.parquet")

ATTRIBUTE_NODES = Output("attributes", NODES)
ATTRIBUTE_EDGES = Output("attributes", EDGES)
ATTRIBUTE_FAILURES = Output("attributes", FAILURES)
ATTRIBUTE_SUMMARIES = Output("attributes", "summaries.parquet")  # what an incremental update keeps (anchor.py)
ANCHOR_CHUNKS = Output("attributes", "anchor_chunks.parquet")

COMMUNITY_NODES = Output("communities", NODES)
COMMUNITY_EDGES = Output("communities", EDGES)
ASSIGNMENTS = Output("communities", "assignments.parquet")
COMMUNITY_FAILURES = Output("communities", FAILURES)
COMMUNITY_SUMMARIES = Output("communities", "summaries.parquet")
SEMANTIC_CENTROIDS = Output("communities", "centroids.parquet")

TEXT_NODES = Output("text", NODES)
TEXT_EDGES = Output("text", EDGES)

VECTOR_IDS = Output("embed", "ids.parquet")
VECTORS = Output("embed", "vectors.faiss")

NEIGHBOURS = Output("similarity", "neighbours.parquet")
SIMILARITY_CENTROIDS = Output("similarity", "centroids.parquet")
SIMILARITY_EDGES = Output("similarity", EDGES)

NODE_OUTPUTS = (DECOMPOSE_NODES, ATTRIBUTE_NODES, COMMUNITY_NODES, TEXT_NODES)
EDGE_OUTPUTS = (DECOMPOSE_EDGES, ATTRIBUTE_EDGES, COMMUNITY_EDGES, TEXT_EDGES, SIMILARITY_EDGES)


class Reads(Protocol):
    """How a stage's code reads its declared inputs (`stages.StageRun` is the one implementation;
    modules below the stage table take it by this name, not by import)."""

    ws: Workspace

    def input_path(self, output: Output) -> Path: ...

    def read(self, output: Output, columns: list[str] | None = None) -> pa.Table: ...

    def nodes(self, *outputs: Output) -> pa.Table: ...

    def edges(self, *outputs: Output) -> pa.Table: ...
