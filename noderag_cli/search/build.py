"""A build opened for search: every array and table a question reads, memory-mapped from the
build's generation (search/prepare.py derived them at index time), so opening costs the same at
any size; and the whole-graph views an evaluation strategy asks for (the full tables, the graph,
the walk matrix of another similarity weight), made only then. The query steps: retriever.py."""

from __future__ import annotations

import functools

import faiss
import numpy as np
import pyarrow as pa

from .. import ivf
from ..errors import WorkspaceError
from ..generation import Generation
from ..graph import Graph
from ..node_types import NODE_TYPES, TYPE_CODE, TYPE_LETTERS
from .entry import NameIndex
from .ppr import WalkMatrix
from .prepare import VERSION as PREPARED_VERSION
from .prepare import WALK_ARRAYS, edge_parts, node_ids, walk_matrix
from .vectors import VectorSide


def _mapped(array: np.ndarray) -> np.ndarray:
    """A plain ndarray over a memory-mapped one (the kernels are compiled for plain arrays)."""
    return np.asarray(array)


class Build:
    """The current build of a workspace, opened for search (`Retriever` asks it)."""

    def __init__(self, generation: Generation, vector_probes: int, dim: int):
        self.generation = generation
        meta = generation.meta
        if meta.get("version") != PREPARED_VERSION:
            raise generation.damaged("manifest.json", f"its search structures are of version {meta.get('version')}, "
                                                      f"this noderag reads {PREPARED_VERSION}")
        vector_index = self._read_index("vectors.faiss")
        scan8_index = self._read_index("scan8.faiss") if "scan8" in meta else None
        if vector_index.d != dim:
            raise WorkspaceError(f"workspace vectors have dimension {vector_index.d}, the embedder gives {dim}")
        vectors = ivf.stored_vectors(vector_index)
        self.text_column = generation.arrow("node_text")["text"]
        self.type_codes = _mapped(generation.array("type_codes"))
        self.id_hash = _mapped(generation.array("id_hash"))
        self.tokens = _mapped(generation.array("tokens"))
        scan8 = (scan8_index, meta["scan8"]["scale"], meta["scan8"]["error"]) if "scan8" in meta else None
        clusters = tuple(_mapped(generation.array(name)) for name in ("cluster_centroids", "cluster_indptr", "cluster_rows",
                                                                 "cluster_codes")) if "clusters" in meta else None
        self.vector_side = VectorSide(vectors, self.type_codes, _mapped(generation.array("vector_of_node")),
                                      _mapped(generation.array("node_of_vector")), _mapped(generation.array("scanned_rows")),
                                      scan8, clusters, vector_probes)
        self._walks = {float(meta["walk_similarity_weight"]): WalkMatrix(*(_mapped(generation.array(n)) for n in WALK_ARRAYS))}
        self.leads_rows, self.leads_indptr, self.leads_indices = (_mapped(generation.array(name)) for name in
                                                                  ("leads_rows", "leads_indptr", "leads_indices"))
        self.value_kinds, self.unit_chunk = _mapped(generation.array("value_kinds")), _mapped(generation.array("unit_chunk"))
        self.key_indptr, self.key_ids = _mapped(generation.array("key_indptr")), _mapped(generation.array("key_ids"))
        self.doc_indptr, self.doc_codes = _mapped(generation.array("doc_indptr")), _mapped(generation.array("doc_codes"))
        self.document_names = generation.arrow("document_names")["path"]
        self._paths: dict[int, str] = {}  # filled as paths are shown
        self.place_indptr, self.place_rows = _mapped(generation.array("place_indptr")), _mapped(generation.array("place_rows"))
        self.places = generation.arrow("places")
        self.shown_places: dict[int, tuple[dict, int]] = {}  # (place, its chunk's T row), filled as places are shown
        self.names = NameIndex({name: _mapped(generation.array(name)) for name in NameIndex.ARRAYS},
                               generation.arrow("name_keys")["key"])

    def _read_index(self, file: str) -> faiss.Index:
        path = self.generation.path(file)
        try:
            return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
        except RuntimeError as err:
            raise self.generation.damaged(file, f"unreadable: {str(err).splitlines()[0][:120]}") from None

    def close(self) -> None:
        """Let go of the build (an `index` run may then remove it once it is no longer current)."""
        self.generation.close()

    # whole-graph views, for evaluation strategies and tests; the query path never builds them
    @functools.cached_property
    def ids(self) -> np.ndarray:
        return np.asarray(node_ids(self.id_hash, self.type_codes), dtype=object)

    @functools.cached_property
    def types(self) -> np.ndarray:
        return TYPE_LETTERS[self.type_codes]

    @functools.cached_property
    def texts(self) -> np.ndarray:
        return np.asarray(self.text_column.to_pylist(), dtype=object)

    @functools.cached_property
    def rows_by_type(self) -> dict[str, np.ndarray]:
        return {t: np.flatnonzero(self.type_codes == TYPE_CODE[t]) for t in NODE_TYPES}

    @property
    def sentence_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """Each node's sentence keys as ids, for `context.fit_budget`."""
        return self.key_indptr, self.key_ids

    @functools.cached_property
    def _tables(self) -> tuple[pa.Table, pa.Table]:
        return (self.generation.table("nodes", ["id", "type"]), self.generation.table("edges"))

    @functools.cached_property
    def graph(self) -> Graph:
        return Graph.from_tables(*self._tables)

    @functools.cached_property
    def _edge_parts(self):
        return edge_parts(*self._tables)

    def id_of(self, rows: np.ndarray) -> list[str]:
        rows = np.asarray(rows, dtype=np.int64)
        return node_ids(self.id_hash[rows], self.type_codes[rows])

    def walk_matrix(self, similarity_weight: float) -> WalkMatrix:
        """P of structural edges + similarity_weight x similarity edges: the build's own for its
        configured weight, any other built once per weight from the tables."""
        weight = float(similarity_weight)
        if weight not in self._walks:
            self._walks[weight] = walk_matrix(self._edge_parts, weight)
        return self._walks[weight]

    def document_paths(self, codes: np.ndarray) -> list[str]:
        """Document paths by code, each read from the mapped build once per session: a context
        lists hundreds of paths, mostly the same few, and Python strings made afresh cost more
        than the search."""
        paths = self._paths
        codes = codes.tolist()
        missing = sorted({c for c in codes if c not in paths})
        if missing:
            paths.update(zip(missing, self.document_names.take(pa.array(missing, pa.int64())).to_pylist(), strict=True))
        return [paths[c] for c in codes]

