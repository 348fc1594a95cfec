"""The search's parts against their definitions: PPR, per-type selection, budget, name matching."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from noderag_cli.search.context import (
    fit_budget,
    sentence_key_hash,
    sentence_key_ids,
    sentence_keys,
    top_per_group,
)
from noderag_cli.search.entry import NameIndex
from noderag_cli.search.ppr import WalkMatrix, shallow_ppr


def transition(adjacency: sp.csr_matrix) -> sp.csr_matrix:
    """P = diag(1 / weighted degree) @ A, as scipy computes it: the reference `WalkMatrix` must equal."""
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    inverse = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
    return (sp.diags(inverse) @ adjacency).tocsr()


def dense_ppr(adjacency: np.ndarray, entries, alpha: float, iterations: int, variant: str,
              min_mass: float = 0.0) -> np.ndarray:
    """The paper's formula, written out with dense matrices. With `min_mass`: a node spreads only
    when its mass exceeds min_mass per edge, and after each step mass of min_mass or less is zeroed."""
    degree = adjacency.sum(axis=1, keepdims=True)
    p_matrix = np.divide(adjacency, degree, out=np.zeros_like(adjacency), where=degree > 0)
    p = np.zeros(len(adjacency))
    p[entries] = 1 / len(entries)
    pi = p.copy()
    for _ in range(iterations):
        edges = (adjacency > 0).sum(axis=1)
        walked = p_matrix.T @ np.where(pi > min_mass * edges, pi, 0.0)
        pi = alpha * p + (1 - alpha) * walked if variant == "paper" else alpha * walked + (1 - alpha) * pi
        pi[pi <= min_mass] = 0.0
    return pi


@pytest.mark.parametrize("variant", ["paper", "lazy"])
@pytest.mark.parametrize("iterations", [1, 2, 5])
def test_shallow_ppr_equals_the_formula(variant, iterations):
    rng = np.random.default_rng(7)
    upper = np.triu(rng.random((60, 60)) * (rng.random((60, 60)) < 0.08), 1)
    adjacency = upper + upper.T
    entries = np.array([3, 17, 42])
    support, mass = shallow_ppr(WalkMatrix.from_adjacency(sp.csr_matrix(adjacency)), entries, 0.5, iterations, variant)
    got = np.zeros(60)
    got[support] = mass
    np.testing.assert_allclose(got, dense_ppr(adjacency, entries, 0.5, iterations, variant), atol=1e-12)
    assert np.all(np.diff(support) > 0) and np.all(mass > 0)
    assert got.sum() == pytest.approx(dense_ppr(adjacency, entries, 0.5, iterations, variant).sum())


@pytest.mark.parametrize("variant", ["paper", "lazy"])
def test_a_minimum_mass_lets_go_of_the_faint_nodes_after_each_step(variant):
    rng = np.random.default_rng(8)
    upper = np.triu(rng.random((200, 200)) * (rng.random((200, 200)) < 0.05), 1)
    adjacency = upper + upper.T
    walk, entries = WalkMatrix.from_adjacency(sp.csr_matrix(adjacency)), np.array([3, 17, 42])
    full_support, _ = shallow_ppr(walk, entries, 0.5, 3, variant)
    support, mass = shallow_ppr(walk, entries, 0.5, 3, variant, min_mass=2e-3)
    got = np.zeros(200)
    got[support] = mass
    np.testing.assert_allclose(got, dense_ppr(adjacency, entries, 0.5, 3, variant, 2e-3), atol=1e-12)
    assert np.all(mass > 2e-3) and 0 < len(support) < len(full_support)


def test_top_per_group_equals_a_full_sort_per_group():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        scores = np.round(rng.random(n), 1) * (rng.random(n) < 0.8)  # many ties, some zeros
        groups = rng.integers(0, 5, n)
        eligible = rng.random(n) < 0.9
        quotas = {int(g): int(rng.integers(0, 12)) for g in rng.permutation(5)}
        expected = []
        for group, quota in quotas.items():
            members = [i for i in range(n) if groups[i] == group and eligible[i] and scores[i] > 0]
            expected += sorted(members, key=lambda i: (-scores[i], i))[:quota]
        assert top_per_group(scores, groups, eligible, quotas).tolist() == expected


def test_top_per_group_takes_the_best_of_each_group_ties_by_position():
    scores = np.array([0.5, 0.9, 0.9, 0.1, 0.0, 0.7, 0.3])
    groups = np.array([0, 0, 0, 1, 1, 1, 2])
    eligible = np.array([True, True, True, True, True, True, False])
    picked = top_per_group(scores, groups, eligible, {0: 2, 1: 5, 2: 1})
    assert picked.tolist() == [1, 2, 5, 3]  # group 1 drops its zero score; group 2 is not eligible


def test_budget_is_never_exceeded_and_repeated_statements_are_skipped():
    texts = np.array(["Vessmouth: The town was founded in 1641.", "The town was founded in 1641. It grew fast.",
                      "Edda Marrow: She was born on Skarra.", "x" * 10], dtype=object)
    tokens = np.array([10, 12, 9, 50])
    rows = np.arange(4)
    key_indptr, key_ids = sentence_key_ids(texts.tolist())
    assert len(np.unique(key_ids)) == 3 and key_ids[key_indptr[0]:key_indptr[1]].tolist() == [
        sentence_key_hash("the town was founded in 1641.")]  # row 1 shares row 0's key
    keys = (key_indptr, key_ids)
    kept = fit_budget(rows, np.array([0.9, 0.8, 0.7, 0.6]), tokens, 40, keys)
    assert kept.tolist() == [0, 2]  # row 1 repeats row 0's sentence: skipped; row 3 would overflow
    kept = fit_budget(np.array([1, 0]), np.array([0.9, 0.8]), tokens, 40, keys)
    assert kept.tolist() == [1]  # row 0's only sentence is already in row 1
    assert fit_budget(rows, np.array([0.6, 0.7, 0.8, 0.9]), tokens, 21).tolist() == [2, 1]  # no dedupe: 9 + 12
    assert sentence_keys("A: B: Some statement here. Another one here!") == {"some statement here.", "another one here!"}


def test_names_match_longest_first_whole_words_and_fold_diacritics():
    names = ["Summer Olympics", "Summer", "Olympics", "Aschenbrödel", "Ten", "Nobel Prize", "the Nobel Prize's"]
    index = NameIndex.build(names, np.arange(len(names)))
    assert index.match("the 1920 Summer Olympics") == [0]
    assert index.match("Who wrote Aschenbrodel?") == [3]
    assert index.match("a tenant", require_capital=True) == []  # "ten" is not a whole word here
    assert index.match("the Nobel Prize's history") == [5, 6]  # one name, two nodes
    assert index.match("Olympics and Summer") == [2, 1]
    assert index.match("summer is warm", require_capital=True) == []  # lower-case one-word n-gram


def _random_graph(rng, n: int, density: float, integer: bool, largest: int = 6) -> sp.csr_matrix:
    weights = rng.integers(1, largest + 1, (n, n)) if integer else rng.random((n, n))
    upper = np.triu(rng.random((n, n)) < density, 1) * weights
    return sp.csr_matrix((upper + upper.T).astype(np.float64))


@pytest.mark.parametrize(("integer", "largest", "widest"), [(True, 6, np.uint8), (True, 255, np.uint8),
                                                           (True, 256, np.uint16), (True, 65535, np.uint16),
                                                           (True, 70000, np.float64), (False, 1, np.float64)])
def test_the_compact_walk_matrix_is_the_transition_matrix(integer, largest, widest):
    """The walk's compact form holds P's entries in P's order, with the same bits, whether read
    whole or a few rows at a time (a row's degree is summed from the weights it gathers); whole-number
    weights travel as one byte, or two when one passes 255, and P's values past that."""
    rng = np.random.default_rng(11)
    kinds = set()
    for _ in range(40):
        n = int(rng.integers(5, 400))
        adjacency = _random_graph(rng, n, float(rng.uniform(0.003, 0.2)), integer, largest)
        p_matrix = transition(adjacency)
        walk = WalkMatrix.from_adjacency(adjacency)
        heaviest = adjacency.data.max(initial=0)
        assert walk.weights.dtype == (np.float64 if not integer or heaviest > 65535 else
                                      np.uint16 if heaviest > 255 else np.uint8)
        kinds.add(walk.weights.dtype.type)
        assert np.array_equal(walk.as_csr().indices, p_matrix.indices)
        assert np.array_equal(walk.as_csr().data, p_matrix.data)
        rows = np.random.default_rng(n).choice(n, size=7, replace=False)  # the graphs' draws stay as they were
        columns, values = walk.entries(rows)
        assert np.array_equal(columns, np.concatenate([p_matrix[r].indices for r in rows]))
        assert np.array_equal(values, np.concatenate([p_matrix[r].data for r in rows]))
        degree = np.asarray(adjacency.sum(axis=1)).ravel()[rows]
        expected = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0) if walk.whole else np.ones(len(rows))
        assert np.array_equal(walk.inverse_degrees(rows), expected)
    assert widest in kinds


def test_half_precision_rows_widen_exactly_both_ways():
    """Every finite half value, as the stored vectors hold them, widens to the same float32 bits
    through the compiled kernel, the numpy table and numpy's own cast; rows are gathered in the
    order asked."""
    from noderag_cli.search import kernels
    from noderag_cli.search.vectors import widen

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = every[np.isfinite(every)]
    vectors = np.concatenate([finite, np.zeros(-len(finite) % 256, np.float16)]).reshape(-1, 256)
    rows = np.arange(len(vectors))[::-1].copy()
    compiled = np.empty((len(rows), 256), np.float32)
    kernels.widen_half(vectors.view(np.uint16), rows, compiled)
    expected = vectors[rows].astype(np.float32)
    assert np.array_equal(compiled.view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(widen(vectors, rows).view(np.uint32), expected.view(np.uint32))


def test_edge_parts_give_scipys_sums_bit_for_bit():
    """`EdgeParts.adjacency` (the walk's structural edges plus w x its similarity edges) against
    scipy's (whole - similar) + w x similar over the same edge table: the same entries, the same
    bits, cancelled entries dropped. Weights come from a few values and pairs of weight 1 found by
    the similarity stage alone cancel exactly; a self-loop is one entry of twice its weight, as in
    scipy's M + M^T."""
    import pyarrow as pa

    from noderag_cli.search.prepare import edge_parts

    rng = np.random.default_rng(7)
    n = 300
    ids = [f"S_{i:016x}" for i in range(n)]
    pairs = np.unique(np.sort(rng.integers(0, n, (2500, 2)), axis=1), axis=0)
    pairs = np.vstack([pairs[pairs[:, 0] != pairs[:, 1]], [[5, 5], [9, 9]]])  # two self-loops
    m = len(pairs)
    hnsw = rng.random(m) < 0.4
    weight = np.where(hnsw & (rng.random(m) < 0.5), 1.0, rng.choice([1.0, 2.0, 3.0, 1.5], m)) + hnsw
    hnsw[-1] = True
    edges = pa.table({"source": pa.array([ids[i] for i in pairs[:, 0]]), "target": pa.array([ids[i] for i in pairs[:, 1]]),
                      "weight": pa.array(weight.astype(np.float32)), "hnsw": pa.array(hnsw)})
    parts = edge_parts(pa.table({"id": pa.array(ids)}), edges)

    def symmetric(values: np.ndarray) -> sp.csr_matrix:
        upper = sp.csr_matrix((values, (pairs[:, 0], pairs[:, 1])), shape=(n, n))
        return (upper + upper.T).tocsr()

    whole, similar = symmetric(weight.astype(np.float32).astype(np.float64)), symmetric(hnsw.astype(np.float64))
    for scale in (0.0, 1.0, 0.37):
        expected = ((whole - similar) + similar * scale).tocsr()
        expected.eliminate_zeros()
        expected.sort_indices()
        got = parts.adjacency(scale)
        assert np.array_equal(got.indptr, expected.indptr)
        assert np.array_equal(got.indices, expected.indices)
        assert got.data.tobytes() == expected.data.astype(np.float64).tobytes()
        if scale == 0.0:  # the pairs only the similarity stage found are gone
            assert len(got.indices) < len(parts.indices)
    walk = parts.adjacency(1.0)
    row = slice(walk.indptr[5], walk.indptr[6])
    assert walk.data[row][walk.indices[row] == 5].tolist() == [2 * weight[-2]]


def test_id_hashes_give_the_ids_back_and_refuse_other_ids():
    """The query maps each node id as a uint64 beside its type code; the ids come back exactly
    (also from a slice of a column, whose bytes start inside its buffer), and an id not of the form
    `<type>_<16 lower-case hex>` with its own type letter is refused rather than stored wrong."""
    import pyarrow as pa

    from noderag_cli.search.prepare import id_hashes, node_ids, type_codes_of

    rng = np.random.default_rng(3)
    ids = sorted({f"{t}_{int(v):016x}" for t in "SNT" for v in rng.integers(0, 2**63, 200, dtype=np.int64)})
    ids += ["T_0000000000000000", "T_ffffffffffffffff"]
    column = pa.chunked_array([pa.array(ids[:300]), pa.array(ids[300:])])
    codes = type_codes_of(pa.array([i[0] for i in ids]))
    assert node_ids(id_hashes(column, codes), codes) == ids
    assert node_ids(id_hashes(pa.array(ids).slice(7, 50), codes[7:57]), codes[7:57]) == ids[7:57]
    assert id_hashes(pa.array([], pa.string()), codes[:0]).dtype == np.uint64
    for bad, letter in (("S_00000000000000zz", "S"), ("S-0000000000000000", "S"), ("S_000000000000000A", "S"),
                        ("S_00000", "S"), ("N_0000000000000000", "S")):
        with pytest.raises(ValueError, match="not <type>_<16 hex>"):
            id_hashes(pa.array([bad]), type_codes_of(pa.array([letter])))


def test_places_are_each_chunks_json_and_one_place_chunks_lie_on_one_page():
    """Every place is what json.dumps writes for its document, hash, span and marks, whatever the
    path holds (quotes, a backslash, a control character, non-ASCII); a node's places come by path,
    then position; a chunk two documents share is a place in each, and a missing document shows as
    its id. Only a chunk over one page (or none) lies on one place."""
    import json

    import pyarrow as pa

    from noderag_cli.search.prepare import one_place_chunks, places, type_codes_of

    documents = pa.table({"doc_id": ["D_a", "D_b", "D_c"], "path": ['say "hi".pdf', "b\\slash\tx.md", "zé/ü.txt"],
                          "content_hash": ["h1", "h2", "h3"]})
    chunks = pa.table({
        "chunk_id": ["T_2", "T_1", "T_3", "T_2", "T_4"],
        "doc_id": ["D_b", "D_a", "D_c", "D_c", "D_gone"],
        "start": [10, 0, 5, 7, 0], "end": [20, 9, 15, 17, 3],
        "location": ['{"pages":[1,2],"sections":[["A é",0]]}', '{"pages":[3]}', None, "{}", '{"sheets":["S"]}']})
    nodes = pa.table({"id": ["N_x", "S_1", "T_1", "T_2", "T_3", "T_4"], "type": ["N", "S", "T", "T", "T", "T"],
                      "chunk_ids": [["T_1"], ["T_2", "T_1"], ["T_1"], ["T_2"], ["T_3"], ["T_4"]]})
    indptr, rows, table = places(nodes, type_codes_of(nodes["type"]), documents, chunks)
    by_doc = {d: (p, h) for d, p, h in zip(*documents.to_pydict().values(), strict=True)}
    ordered = sorted(chunks.to_pylist(), key=lambda c: (c["chunk_id"], c["doc_id"]))
    expected = [json.dumps({"document": by_doc.get(c["doc_id"], (c["doc_id"], ""))[0],
                            "content_hash": by_doc.get(c["doc_id"], (c["doc_id"], ""))[1],
                            "span": [c["start"], c["end"]], "marks": json.loads(c["location"] or "{}")},
                           ensure_ascii=False, separators=(",", ":")) for c in ordered]
    assert table["place"].to_pylist() == expected
    assert table["chunk_node"].to_pylist() == [2, 3, 3, 4, 5]
    shown = [[json.loads(expected[r])["document"] for r in rows[indptr[i]:indptr[i + 1]]] for i in range(6)]
    assert shown == [[], ["b\\slash\tx.md", 'say "hi".pdf', "zé/ü.txt"], ['say "hi".pdf'],
                     ["b\\slash\tx.md", "zé/ü.txt"], ["zé/ü.txt"], ["D_gone"]]
    # T_2's last row (D_c, no marks) decides: one place; T_1 is on page 3, T_3 has none, T_4 one sheet
    assert one_place_chunks(nodes, chunks).tolist() == [False, False, True, True, True, True]
    chunks = chunks.set_column(4, "location", pa.array(["{}", '{"pages":[3]}', None, '{"slides":[1,2]}', "{}"]))
    assert one_place_chunks(nodes, chunks).tolist() == [False, False, True, False, True, True]
    # a build whose documents table lost every row still shows each place under its document id
    empty = documents.slice(0, 0)
    _, _, table = places(nodes, type_codes_of(nodes["type"]), empty, chunks)
    assert [json.loads(p)["document"] for p in table["place"].to_pylist()] == ["D_a", "D_b", "D_c", "D_c", "D_gone"]
