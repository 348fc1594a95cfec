"""The similarity edges (index/similarity_edges.py) on real vectors from the bundled model:
exact scores, HNSW's selection rule, and an update that equals a fresh computation."""

from __future__ import annotations

import numpy as np
import pytest

from noderag_cli.config import EmbeddingConfig
from noderag_cli.embeddings import Embedder
from noderag_cli.index import similarity_edges as se

K = 8


@pytest.fixture(scope="module")
def corpus():
    words = ("river mill bridge medal society village founder archive harbour granite lighthouse orchard "
             "railway council glacier chapel ferry quarry museum canal").split()
    rng = np.random.default_rng(5)
    texts = sorted({" ".join(rng.choice(words, size=rng.integers(2, 7))) for _ in range(400)})
    vectors = Embedder(EmbeddingConfig()).embed(texts)
    keys = np.asarray([f"S_{i:05d}" for i in range(len(texts))], dtype=object)
    return keys, vectors


def brute_force(vectors: np.ndarray, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """Candidates and kept lists computed pair by pair in float64 on the same 1/2048 grid."""
    grid = np.rint(vectors.astype(np.float64) * se.QUANT)
    sims = grid @ grid.T
    candidates, kept = [], []
    for row in range(len(vectors)):
        order = sorted((c for c in range(len(vectors)) if c != row), key=lambda c: (-sims[row, c], c))[:k]
        chosen = []
        for c in order:
            if all(sims[c, r] <= sims[row, c] for r in chosen):
                chosen.append(c)
        candidates.append(order)
        kept.append(chosen)
    return candidates, kept


def test_lists_match_a_pair_by_pair_computation(corpus):
    keys, vectors = corpus
    keys, vectors = keys[:150], vectors[:150]
    result = se.neighbour_lists(keys, vectors, K)
    candidates, kept = brute_force(vectors, K)
    assert result.candidates[:, :K].tolist() == candidates
    assert [result.candidates[r, :K][result.kept[r]].tolist() for r in range(len(keys))] == kept
    assert 1 <= result.kept.sum(axis=1).min() and result.kept.sum(axis=1).max() < K  # the rule prunes


def test_update_equals_fresh_computation(corpus):
    keys, vectors = corpus
    rng = np.random.default_rng(11)
    n = len(keys)
    base = np.sort(rng.choice(n, size=int(n * 0.8), replace=False))
    previous = se.to_table(keys[base], se.neighbour_lists(keys[base], vectors[base], K))
    rest = np.setdiff1d(np.arange(n), base)
    deleted = rng.choice(base, size=12, replace=False)
    final = np.sort(np.setdiff1d(np.concatenate([base, rest[:40]]), deleted))
    final_keys = keys[final].copy()
    final_vectors = vectors[final].copy()
    moved = rng.choice(len(final), size=5, replace=False)  # same node, new text: a new key
    final_vectors[moved] = vectors[rest[40:45]]
    final_keys[moved] = [f"{k}:changed" for k in final_keys[moved]]
    order = np.argsort(final_keys)
    final_keys, final_vectors = final_keys[order], final_vectors[order]

    fresh = se.neighbour_lists(final_keys, final_vectors, K)
    update = se.neighbour_lists(final_keys, final_vectors, K, previous)
    assert update.searched < len(final_keys) and update.pruned <= len(final_keys)
    assert np.array_equal(update.candidates[:, :K], fresh.candidates[:, :K])
    assert np.array_equal(update.kept, fresh.kept)
    assert np.array_equal(se.pairs(update), se.pairs(fresh))


def test_an_update_that_changes_every_list_prunes_them_on_their_scores(corpus):
    """Deletions of a kept candidate of every remaining list: every row is pruned again, the reused
    ones on scores recomputed from the grid (none are stored), as a fresh run finds."""
    keys, vectors = corpus
    base = se.neighbour_lists(keys, vectors, K)
    deleted = np.zeros(len(keys), bool)
    for row in range(len(keys)):  # until every remaining row has lost one of the candidates it kept
        if not deleted[row] and not deleted[base.candidates[row, :K][base.kept[row]]].any():
            deleted[base.candidates[row, 0]] = True  # a list's best candidate is always kept
    final = np.flatnonzero(~deleted)
    update = se.neighbour_lists(keys[final], vectors[final], K, se.to_table(keys, base))
    fresh = se.neighbour_lists(keys[final], vectors[final], K)
    assert update.searched < len(final) and update.pruned == len(final)  # lists reused, every one pruned
    assert np.array_equal(update.candidates[:, :K], fresh.candidates[:, :K])
    assert np.array_equal(update.kept, fresh.kept)


def test_an_update_prunes_again_only_the_lists_whose_kept_candidates_can_change(corpus):
    """A flag depends only on the kept candidates ahead of it: a list that loses a candidate it did
    not keep, or gains a new row it does not keep, keeps its flags without being pruned again, and
    they are still a fresh run's flags."""
    keys, vectors = corpus
    n = len(keys)
    base = np.arange(n - 40)
    before = se.neighbour_lists(keys[base], vectors[base], K)
    passed_over = np.bincount(before.candidates[:, :K][~before.kept], minlength=len(base))
    kept_by = np.bincount(before.candidates[:, :K][before.kept], minlength=len(base))
    deleted = np.argsort(kept_by - passed_over, kind="stable")[:10]  # in many lists, kept by few
    final = np.setdiff1d(np.arange(n), deleted)
    update = se.neighbour_lists(keys[final], vectors[final], K, se.to_table(keys[base], before))
    fresh = se.neighbour_lists(keys[final], vectors[final], K)
    assert np.array_equal(update.candidates[:, :K], fresh.candidates[:, :K])
    assert np.array_equal(update.kept, fresh.kept)

    names = lambda lists, rows, row: [rows[c] for c in lists.candidates[row, :K]]  # noqa: E731
    place = {node: row for row, node in enumerate(final)}
    changed = sum(names(before, base, row) != names(fresh, final, place[row]) for row in base if row not in deleted)
    assert changed > 10 and update.pruned < update.searched + changed  # some changed lists kept their flags
    assert fresh.kept[np.isin(fresh.candidates[:, :K], np.flatnonzero(final >= n - 40))].any()  # and new rows were kept


def test_new_rows_that_tie_with_listed_ones_are_placed_by_column(corpus):
    """New rows whose vectors equal listed rows' score the same for every row: each list places
    them by column among their equals, as a fresh run sorts them."""
    keys, vectors = corpus
    base = np.arange(0, len(keys) - 30)
    before = se.neighbour_lists(keys[base], vectors[base], K)
    twins = before.candidates[:30, 0]  # rows many lists hold near their top
    final_keys = np.concatenate([keys[base], [f"{keys[t]}:twin{side}" for t in twins for side in "ab"]])
    final_vectors = np.concatenate([vectors[base], np.repeat(vectors[twins], 2, axis=0)])
    order = np.argsort(final_keys)
    final_keys, final_vectors = final_keys[order], final_vectors[order]
    update = se.neighbour_lists(final_keys, final_vectors, K, se.to_table(keys[base], before))
    fresh = se.neighbour_lists(final_keys, final_vectors, K)
    assert update.searched < len(final_keys)
    assert np.array_equal(update.candidates, fresh.candidates)
    assert np.array_equal(update.kept, fresh.kept)


def test_scores_do_not_depend_on_the_block(corpus):
    _, vectors = corpus
    grid = se.quantised(vectors)
    full = se.scores_against(grid, np.arange(len(vectors)))
    for rows in (np.array([7]), np.array([3, 200]), np.arange(0, len(vectors), 9)):
        assert np.array_equal(se.scores_against(grid, rows), full[rows])
    assert np.array_equal(full, full.T)
    rows = np.tile(np.arange(0, len(vectors), 5), 6)  # a list's scores recomputed (the stored lists keep
    # none), over several blocks scored on threads: the same bits
    candidates = np.random.default_rng(3).integers(-1, len(vectors), (len(rows), 19))
    assert np.array_equal(se.exact_scores(grid, rows, candidates),
                          np.where(candidates >= 0, full[rows[:, None], np.maximum(candidates, 0)], -np.inf))


def test_pruning_from_a_start_gives_the_flags_of_pruning_whole():
    """A row's kept flags before its first changed position are taken as they were and only the
    rest decided: the same flags as deciding every one (the maintained lists rely on it)."""
    from noderag_cli import ivf

    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((3000, 24)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = np.asarray([f"S_{i:05d}" for i in range(len(vectors))], dtype=object)
    lists = se.neighbour_lists(keys, vectors, 16)
    grid = ivf.quantised(vectors)
    candidates = lists.candidates[:, :16]
    scores = se.exact_scores(grid, np.arange(len(vectors)), candidates)
    whole = se.prune(grid, candidates, scores)
    assert np.array_equal(whole, lists.kept) and whole.any() and not whole.all()
    start = rng.integers(0, 17, len(vectors))
    stale = whole ^ (rng.random(whole.shape) < 0.3)  # flags at and after the start are not read
    stale[np.arange(16) < start[:, None]] = whole[np.arange(16) < start[:, None]]
    assert np.array_equal(se.prune(grid, candidates, scores, start, stale), whole)


def test_the_stage_reads_the_stored_half_precision_rows_block_by_block(tmp_path):
    """The similarity stage maps a build's half-precision vectors instead of holding a float32 copy:
    the grid, the row names and the lists are the same bits as from the float32 rows."""
    from noderag_cli import ivf

    rng = np.random.default_rng(5)
    n = 2 * ivf.BLOCK + 37  # blocks, and a part of one
    vectors = rng.standard_normal((n, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    path = tmp_path / "vectors.faiss"
    import faiss

    faiss.write_index(ivf.flat_index(vectors), str(path))
    stored, wide = ivf.read_stored(path), ivf.read_flat(path)
    assert stored.dtype == ivf.STORED_DTYPE and wide.dtype == np.float32
    expected = np.rint(wide * ivf.QUANT).astype(np.float32)
    assert ivf.quantised(stored).tobytes() == expected.tobytes() == ivf.quantised(wide).tobytes()
    ids = [f"S_{i:016x}" for i in range(n)]
    assert se.keys(ids, stored).tolist() == se.keys(ids, wide).tolist()
    a, b = se.neighbour_lists(se.keys(ids, stored)[:300], stored[:300], 8), se.neighbour_lists(se.keys(ids, wide)[:300], wide[:300], 8)
    assert np.array_equal(a.candidates, b.candidates) and np.array_equal(a.kept, b.kept)
