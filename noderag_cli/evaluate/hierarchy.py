"""Community hierarchies for the seed systems `noderag ablate` compares, re-implemented on our graph:

- GraphRAG's levels C0-C3: hierarchical Leiden on the S/N/R/A graph (the communities of one level
  are split again by Leiden while larger than GRAPHRAG_MAX_CLUSTER nodes, as graspologic's
  `hierarchical_leiden` does for GraphRAG), one report per community per level;
- ArchRAG's attributed communities: the entity graph (entities joined by a relationship or a
  shared unit) augmented with similarity edges to each entity's nearest entities, every edge
  weighted by the cosine of its endpoints' description vectors; weighted Leiden gives the first
  layer of communities, each summarised; the communities, joined where their members are and to
  their nearest by summary vector, are clustered again, layer by layer, until a layer stops
  shrinking (ARCHRAG_MAX_LAYERS at most).

A report is the engine's `community_elements` over the community's statements (its members' S
and A texts; for an upper ArchRAG layer, its member communities' reports), written as one
"title: description" line per element. The offline engine writes them extractively; an LLM
engine's replies go through the workspace cache, so a second run pays nothing.

A hierarchy is built only when a variant asks for it, and kept in the workspace's evaluation
folder under a digest of the build, the engine, the embeddings and these settings: a second
ablate run reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import scipy.sparse as sp

from .. import nlp
from ..engines.base import CommunityInput, Failure
from ..files import atomic_write_bytes, json_digest, parquet_bytes
from ..graph import distinct, row_entries
from ..index.communities import leiden_labels
from ..node_types import COMMUNITY_CONTENT_TYPES
from ..search.results import RetrievedNode
from ..workspace import Workspace

VERSION = 1
GRAPHRAG_LEVELS = 4  # C0 (the coarsest) to C3
GRAPHRAG_MAX_CLUSTER = 10  # a community larger than this is split again at the next level
ARCHRAG_MAX_LAYERS = 4  # community layers above the entities, at most
SIMILAR_NEIGHBOURS = 10  # the similarity edges of an entity or a community: to its nearest by vector
SHRINK = 0.9  # a new ArchRAG layer must have at most this share of the layer below's nodes


@dataclass
class Hierarchy:
    """Reports over a base set of workspace nodes. `labels[level]` gives, per base node, the index
    of its report at that level (-1: in no reported community). Reports of all levels share the
    per-report arrays; `within[r]` are report r's nearest reports of its own level (ArchRAG's
    in-layer links; empty for GraphRAG)."""

    base: np.ndarray  # workspace node rows, int64
    labels: list[np.ndarray]
    level: np.ndarray  # per report
    text: list[str]
    tokens: np.ndarray
    documents: list[list[str]]
    vectors: np.ndarray  # (reports, dim) float32
    within: list[np.ndarray]

    @property
    def levels(self) -> int:
        return len(self.labels)

    def at(self, level: int) -> np.ndarray:
        """The reports of one level (an empty level has none)."""
        return np.flatnonzero(self.level == level)

    def children(self, report: int) -> np.ndarray:
        """The reports one level down whose members belong to `report` (ArchRAG's inter-layer links);
        at the first level, the base positions of its members."""
        level = int(self.level[report])
        inside = self.labels[level] == report
        if level == 0:
            return np.flatnonzero(inside)
        below = self.labels[level - 1][inside]
        return distinct(below[below >= 0])


# --------------------------------------------------------------------------- stored
def _digest(retriever, engine, kind: str, settings: dict) -> str:
    files = retriever.build.generation.manifest.get("files", {})
    return json_digest({"version": VERSION, "kind": kind, "build": files, "engine": engine.identity,
                        "vectors": retriever.embedder.vector_id, "settings": settings})[:16]


def load_or_build(setup, kind: str, build) -> Hierarchy:
    """The hierarchy of `kind` for this workspace and engine: read back from the workspace's
    evaluation folder, else built by `build()` and written there (atomically)."""
    retriever = setup.retriever
    settings = {"seed": retriever.config.graph.seed, "resolution": retriever.config.graph.leiden_resolution,
                "max_tokens": retriever.config.graph.max_community_tokens, "levels": GRAPHRAG_LEVELS,
                "max_cluster": GRAPHRAG_MAX_CLUSTER, "layers": ARCHRAG_MAX_LAYERS, "neighbours": SIMILAR_NEIGHBOURS}
    folder = Workspace(setup.workspace).evaluation_dir
    path = folder / f"{kind}-{_digest(retriever, setup.engine, kind, settings)}.parquet"
    if path.is_file():
        try:
            return _read(path)
        except (OSError, ValueError, KeyError, pa.ArrowException):
            setup.notes.append(f"{path.name}: unreadable, rebuilt")
    hierarchy = build()
    try:
        atomic_write_bytes(path, _to_bytes(hierarchy))
    except OSError as err:  # it is a cache: the run goes on, and says so
        setup.notes.append(f"{folder}: cannot write there ({err.strerror or err}); the {kind} hierarchy was "
                           "built for this run only and will be built again next time")
    return hierarchy


def _to_bytes(h: Hierarchy) -> pa.Buffer:
    reports = pa.table({"level": pa.array(h.level, pa.int32()), "text": pa.array(h.text, pa.string()),
                        "tokens": pa.array(h.tokens, pa.int32()), "documents": pa.array(h.documents, pa.list_(pa.string())),
                        "vector": _vector_column(h.vectors),
                        "within": pa.array([w.astype(np.int32) for w in h.within], pa.list_(pa.int32()))})
    labels = np.stack(h.labels).astype(np.int32) if h.labels else np.zeros((0, len(h.base)), np.int32)
    arrays = {b"noderag-base": h.base.astype(np.int32).tobytes().hex().encode(),
              b"noderag-labels": labels.tobytes().hex().encode(), b"noderag-levels": str(len(labels)).encode()}
    return parquet_bytes(reports.replace_schema_metadata(arrays))


def _vector_column(vectors: np.ndarray) -> pa.ListArray:
    """One list of float32 per row, built from the flat buffer (not a Python list per vector)."""
    rows, dim = vectors.shape
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * dim)
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(vectors, np.float32).ravel()))


def _read(path) -> Hierarchy:
    table = pq.read_table(path)
    meta = table.schema.metadata
    base = np.frombuffer(bytes.fromhex(meta[b"noderag-base"].decode()), np.int32).astype(np.int64)
    labels = np.frombuffer(bytes.fromhex(meta[b"noderag-labels"].decode()), np.int32).astype(np.int64)
    labels = labels.reshape(int(meta[b"noderag-levels"]), len(base))
    dim = len(table["vector"][0]) if table.num_rows else 0
    vectors = pc.list_flatten(table["vector"]).to_numpy().astype(np.float32).reshape(table.num_rows, dim)
    return Hierarchy(base, list(labels), table["level"].to_numpy().astype(np.int32), table["text"].to_pylist(),
                     table["tokens"].to_numpy().astype(np.int64), table["documents"].to_pylist(), vectors,
                     [np.asarray(w, np.int64) for w in table["within"].to_pylist()])


# --------------------------------------------------------------------------- shared steps
def _upper(matrix: sp.spmatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    upper = sp.triu(matrix, k=1).tocoo()
    order = np.lexsort((upper.col, upper.row))
    return upper.row[order].astype(np.int64), upper.col[order].astype(np.int64), upper.data[order]


def nearest(vectors: np.ndarray, k: int, block: int = 2048) -> np.ndarray:
    """Each row's k nearest other rows by inner product, ties by index: (n, min(k, n-1)) int64."""
    n = len(vectors)
    k = min(k, n - 1)
    if k <= 0:
        return np.zeros((n, 0), np.int64)
    out = np.zeros((n, k), np.int64)
    for start in range(0, n, block):
        scores = vectors[start : start + block] @ vectors.T
        scores[np.arange(len(scores)), np.arange(start, start + len(scores))] = -np.inf
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        values = np.take_along_axis(scores, top, axis=1)
        order = np.lexsort((top, -values), axis=1)
        out[start : start + len(scores)] = np.take_along_axis(top, order, axis=1)
    return out


def _labels_in_order(labels: np.ndarray) -> np.ndarray:
    """Labels renumbered 0.. in order of first appearance (-1 kept)."""
    out = np.full(len(labels), -1, np.int64)
    valid = labels >= 0
    distinct, first = np.unique(labels[valid], return_index=True)
    rank = np.empty(len(distinct), np.int64)
    rank[np.argsort(first)] = np.arange(len(distinct))
    out[valid] = rank[np.searchsorted(distinct, labels[valid])]
    return out


def _cut(texts: list[str], tokens: list[int], max_tokens: int) -> tuple[str, ...]:
    kept, used = [], 0
    for text, size in zip(texts, tokens, strict=True):
        if used + size > max_tokens:
            break
        kept.append(text)
        used += size
    return tuple(kept)


def summarise(engine, statements: list[tuple[str, ...]]) -> list[str]:
    """One report per group of statements ("" where the engine failed, or for fewer than two
    statements, which say nothing beyond themselves): each element as a "title: description" line.
    Equal groups are summarised once."""
    distinct = list(dict.fromkeys(g for g in statements if len(g) >= 2))
    results = engine.community_elements([CommunityInput(i, g) for i, g in enumerate(distinct)]) if distinct else []
    text = {}
    for group, result in zip(distinct, results, strict=True):
        if not isinstance(result, Failure):
            text[group] = "\n".join(f"{e.title.strip()}: {e.description.strip()}" for e in result
                                    if e.title.strip() and e.description.strip())
    return [text.get(g, "") for g in statements]


def _documents(retriever, rows: np.ndarray) -> list[str]:
    """The paths of the documents the given workspace nodes come from, sorted."""
    codes = distinct(retriever.build.doc_codes[row_entries(retriever.build.doc_indptr, np.asarray(rows, np.int64))])
    return sorted(retriever.build.document_paths(codes))


# --------------------------------------------------------------------------- GraphRAG
def graphrag(setup) -> Hierarchy:
    """C0-C3 over the S/N/R/A graph (see the module docstring)."""
    side = setup.graph_side()
    retriever = setup.retriever
    graph_config = retriever.config.graph
    types = retriever.build.types
    base = np.flatnonzero(np.isin(types, ["S", "N", "R", "A"]))
    structure = sum(side.kind[k] for k in ("S-N", "R-N", "S-R", "A-N")).tocsr()[base][:, base]
    rows, cols, weights = _upper(structure)
    labels = [_labels_in_order(leiden_labels(len(base), rows, cols, np.ones(len(rows)), graph_config.seed,
                                             graph_config.leiden_resolution))]
    for _ in range(1, GRAPHRAG_LEVELS):
        above = labels[-1]
        below = above.copy()
        next_label = int(above.max(initial=-1)) + 1
        for community in distinct(above[above >= 0]).tolist():
            members = np.flatnonzero(above == community)
            if len(members) <= GRAPHRAG_MAX_CLUSTER:
                continue
            r, c, w = _upper(structure[members][:, members])
            parts = leiden_labels(len(members), r, c, np.ones(len(r)), graph_config.seed, graph_config.leiden_resolution)
            if len(distinct(parts)) > 1:
                below[members[parts > 0]] = next_label + parts[parts > 0] - 1
                next_label += int(parts.max())
        labels.append(_labels_in_order(below))
    degree = np.asarray(structure.sum(axis=1)).ravel()
    content = np.isin(types[base], COMMUNITY_CONTENT_TYPES)
    order = np.lexsort((base, -degree, types[base] != "A"))  # attributes first, then best connected
    texts, tokens = retriever.build.texts, retriever.build.tokens
    groups, level, members_of = [], [], []
    for depth, label in enumerate(labels):
        for community in range(int(label.max(initial=-1)) + 1):
            picked = order[(label[order] == community) & content[order]]
            groups.append(_cut([str(texts[base[p]]) for p in picked], [int(tokens[base[p]]) for p in picked],
                               graph_config.max_community_tokens))
            level.append(depth)
            members_of.append(np.flatnonzero(label == community))
    return _assemble(setup, base, labels, level, summarise(setup.engine, groups), members_of, within=False)


# --------------------------------------------------------------------------- ArchRAG
def archrag(setup, augment: bool = True) -> Hierarchy:
    """ArchRAG's layers over the entities (see the module docstring); `augment` False: plain Leiden
    on the structural entity graph, unweighted, at every layer (the "Leiden instead" ablation)."""
    side = setup.graph_side()
    retriever = setup.retriever
    graph_config = retriever.config.graph
    base = side.entities
    structure, statements = _entity_graph(side, retriever)
    vectors = side.entity_vectors
    labels: list[np.ndarray] = []
    level: list[int] = []
    reports: list[str] = []
    members_of: list[np.ndarray] = []
    layer_of_base = np.arange(len(base))  # each base node's node in the current layer
    layer_vectors, layer_structure = vectors, structure
    layer_statements = [tuple(st[1]) for st in statements]
    layer_tokens = [st[2] for st in statements]
    for depth in range(ARCHRAG_MAX_LAYERS):
        n = len(layer_vectors)
        if n < 2:
            break
        edges = layer_structure.copy()
        if augment:
            near = nearest(layer_vectors, SIMILAR_NEIGHBOURS)
            similar = sp.csr_matrix((np.ones(near.size), (np.repeat(np.arange(n), near.shape[1]), near.ravel())),
                                    shape=(n, n))
            edges = edges + similar + similar.T
        r, c, _ = _upper(edges)
        w = np.maximum(np.einsum("ij,ij->i", layer_vectors[r], layer_vectors[c]), 1e-3) if augment else np.ones(len(r))
        parts = _labels_in_order(leiden_labels(n, r, c, w, graph_config.seed, graph_config.leiden_resolution))
        count = int(parts.max(initial=-1)) + 1
        if count < 1 or count > n * SHRINK:
            break
        first = len(level)
        groups = []
        for community in range(count):
            inside = np.flatnonzero(parts == community)
            order = inside[np.lexsort((inside, -np.asarray(layer_structure[inside].sum(axis=1)).ravel()))]
            groups.append(_cut([t for i in order.tolist() for t in layer_statements[i]],
                               [t for i in order.tolist() for t in layer_tokens[i]], graph_config.max_community_tokens))
        texts_now = summarise(setup.engine, groups)
        reports += texts_now
        level += [depth] * count
        label_of_base = np.full(len(base), -1, np.int64)
        placed = layer_of_base >= 0
        label_of_base[placed] = first + parts[layer_of_base[placed]]
        labels.append(label_of_base)
        members_of += [np.flatnonzero(label_of_base == first + k) for k in range(count)]
        # the next layer: these communities, by their reports, joined where their members are
        report_tokens = nlp.count_tokens(texts_now)
        layer_statements = [(text,) if text else () for text in texts_now]
        layer_tokens = [[size] if text else [] for text, size in zip(texts_now, report_tokens, strict=True)]
        layer_vectors = retriever.embedder.embed([t or " " for t in texts_now])
        assign = sp.csr_matrix((np.ones(n), (np.arange(n), parts)), shape=(n, count))
        layer_structure = _unweighted(assign.T @ layer_structure @ assign)
        layer_of_base[placed] = parts[layer_of_base[placed]]
    return _assemble(setup, base, labels, level, reports, members_of, within=True)


def _entity_graph(side, retriever) -> tuple[sp.csr_matrix, list[tuple]]:
    """ArchRAG's base layer: entities joined where a relationship or a unit names both
    (unweighted), and each entity's statements (name, texts, token counts): its attribute, else
    the units that mention it, best connected first, at most three."""
    base = side.entities
    joined = side.kind["R-N"][side.relations][:, base]
    shared = side.kind["S-N"][retriever.build.rows_by_type["S"]][:, base]
    structure = _unweighted((joined.T @ joined) + (shared.T @ shared))
    described = side.kind["described"][base].tocsr()
    texts, tokens, types = retriever.build.texts, retriever.build.tokens, retriever.build.types
    statements = []
    for i in range(len(base)):
        rows = described.indices[described.indptr[i] : described.indptr[i + 1]]
        rows = rows[np.lexsort((rows, types[rows] != "A"))]
        statements.append((texts[base[i]], [str(texts[r]) for r in rows[:3]], [int(tokens[r]) for r in rows[:3]]))
    return structure, statements


def _unweighted(matrix) -> sp.csr_matrix:
    """The pairs of `matrix`, each of weight 1, without self-loops."""
    matrix = matrix.tocsr()
    matrix.setdiag(0)
    matrix.eliminate_zeros()
    matrix.data[:] = 1.0
    return matrix


def _assemble(setup, base, labels, level, text, members_of, within: bool) -> Hierarchy:
    """The reports' tokens, documents and vectors, and (`within`) each report's nearest reports
    of its own level."""
    retriever = setup.retriever
    tokens = np.asarray(nlp.count_tokens(text), np.int64) if text else np.zeros(0, np.int64)
    tokens[[not t for t in text]] = 0
    vectors = retriever.embedder.embed([t or " " for t in text]) if text else np.zeros((0, retriever.embedder.dim),
                                                                                          np.float32)
    level = np.asarray(level, np.int32)
    documents = [_documents(retriever, base[m]) if t else [] for t, m in zip(text, members_of, strict=True)]
    links = [np.zeros(0, np.int64) for _ in text]
    if within:
        for depth in distinct(level).tolist():
            rows = np.flatnonzero(level == depth)
            for row, near in zip(rows.tolist(), nearest(vectors[rows], SIMILAR_NEIGHBOURS), strict=True):
                links[row] = rows[near]
    return Hierarchy(np.asarray(base, np.int64), [np.asarray(x, np.int64) for x in labels], level, list(text), tokens,
                     documents, np.asarray(vectors, np.float32), links)


# --------------------------------------------------------------------------- in a context
def fill_reports(h: Hierarchy, candidates: np.ndarray, scores: np.ndarray, allowance: int) -> tuple[list[int], int]:
    """Reports for a context section: the candidates best score first (ties by index) while they
    fit in `allowance` tokens, skipping empty reports and those scored 0. Returns them and the tokens used."""
    order = np.lexsort((candidates, -scores))
    chosen, used = [], 0
    for i in order.tolist():
        report = int(candidates[i])
        size = int(h.tokens[report])
        if size == 0 or scores[i] <= 0 or used + size > allowance:
            continue
        chosen.append(report)
        used += size
    return chosen, used


def report_nodes(h: Hierarchy, kind: str, chosen: list[int], score_of: dict[int, float]) -> list[RetrievedNode]:
    """Context nodes for reports: type H (a summary of a community, which support recall does not
    count), an id naming the system's letter, the level and the report ("H_C0-000012"), the
    documents of its members."""
    return [RetrievedNode(f"H_{kind}{int(h.level[r])}-{r:06d}", "H", float(score_of[r]), h.text[r], h.documents[r],
                          int(h.tokens[r])) for r in chosen]
