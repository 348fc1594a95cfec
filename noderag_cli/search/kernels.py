"""The query path's per-node loops, compiled with numba.

The walk and the selection touch a few thousand nodes per question; as numpy they were some
sixty array calls, whose fixed costs, not the arithmetic, made most of a query's time. Here they
are plain loops, compiled once (cached on disk beside this file).

Each kernel performs the same floating-point operations in the same order as its numpy
counterpart, which the retriever keeps and runs when it is opened without kernels (a single CLI
question, where their ~0.7 s load would outweigh what they save): `ppr.shallow_ppr`,
`Retriever.select` and `context.fit_budget`. So the scores and every tie are bit-for-bit the
same either way (tests/test_search_parts.py, tests/test_query.py).
"""

from __future__ import annotations

import numba
import numpy as np

from ..node_types import CHUNK, ENTITY, MAX_RETRIEVABLE_CODE, OVERVIEW, RELATION, UNIT

RETRIEVABLE = MAX_RETRIEVABLE_CODE + 1  # types with a quota of cross nodes, by code


@numba.njit(cache=True)
def ppr_paper(indptr, indices, weights, inverse_degree, entries, start, alpha, iterations, scratch, min_mass=0.0):
    """pi_t = alpha p + (1 - alpha) P^T pi_(t-1) from p = `start` on `entries` (sorted, distinct;
    one share each), as (support sorted, mass). P is given as the adjacency's CSR arrays and each row's
    inverse degree (P's entry is inverse_degree[row] x weight, computed here as scipy computed it),
    a third of P's memory, which is what a step's cost follows. Each step adds every gathered entry
    into `scratch` in row order (as np.bincount does), then scales by (1 - alpha) and adds the
    teleport share on the entries. `scratch` (float64, one slot per node) comes in zeroed and is
    left zeroed; a slot still 0 is a node not reached yet (every contribution is positive)."""
    support = entries.copy()
    mass = start.copy()  # a float64 array, one share per entry
    for _ in range(iterations):
        total = len(entries)
        for i in range(len(support)):
            if mass[i] > min_mass * (indptr[support[i] + 1] - indptr[support[i]]):
                total += indptr[support[i] + 1] - indptr[support[i]]
        touched = np.empty(total, np.int64)
        count = 0
        for i in range(len(support)):
            row, share = support[i], mass[i]
            if share <= min_mass * (indptr[row + 1] - indptr[row]):
                continue  # as shallow_ppr: too faint to spread
            inverse = inverse_degree[row]
            for j in range(indptr[row], indptr[row + 1]):
                column = indices[j]
                if scratch[column] == 0.0:
                    touched[count] = column
                    count += 1
                scratch[column] += (inverse * weights[j]) * share
        for entry in entries:
            if scratch[entry] == 0.0:
                touched[count] = entry
                count += 1
        if count * 8 < len(scratch):
            support, mass = _kept_sorted(touched[:count], scratch, entries, alpha, start, min_mass)
            continue
        # most of the graph reached (deep walks): one pass over the nodes beats sorting them
        support = np.empty(count, np.int64)
        k = entry = 0
        for node in range(len(scratch)):
            is_entry = entry < len(entries) and node == entries[entry]
            if is_entry:
                entry += 1
            if is_entry or scratch[node] != 0.0:
                support[k] = node
                k += 1
        mass = np.empty(count)
        entry = kept = 0
        for i in range(count):
            node = support[i]
            value = scratch[node] * (1 - alpha)
            if entry < len(entries) and node == entries[entry]:
                value += alpha * start[entry]
                entry += 1
            scratch[node] = 0.0
            if value > min_mass:  # as shallow_ppr: let go of what carries min_mass or less
                support[kept] = node
                mass[kept] = value
                kept += 1
        support, mass = support[:kept], mass[:kept]
    return support, mass


@numba.njit(cache=True)
def _kept_sorted(touched, scratch, entries, alpha, start, min_mass):
    """A step's new (support, mass) from the nodes it touched (unordered): each node's value
    computed as the loop at the end of `ppr_paper` computes it, the nodes carrying more than
    min_mass kept, and only those sorted (a few thousand, where the touched may be ten times as
    many); `scratch` left zeroed."""
    entry_values = np.empty(len(entries))
    for k in range(len(entries)):
        entry_values[k] = scratch[entries[k]] * (1 - alpha) + alpha * start[k]
        scratch[entries[k]] = -1.0 - k  # a mark: no contribution is negative
    nodes = np.empty(len(touched), np.int64)
    values = np.empty(len(touched))
    kept = 0
    for i in range(len(touched)):
        node = touched[i]
        mark = scratch[node]
        value = entry_values[int(-mark - 1.0)] if mark < 0.0 else mark * (1 - alpha)
        scratch[node] = 0.0
        if value > min_mass:
            nodes[kept] = node
            values[kept] = value
            kept += 1
    order = np.argsort(nodes[:kept])
    return nodes[:kept][order], values[:kept][order]


@numba.njit(inline="always")
def _offer(best_at, best, size, quota, position, value):
    """Keep the `quota` best (value descending, earlier position first) of the offers in
    best_at/best; positions arrive in ascending order, so an equal value never displaces."""
    if size < quota:
        slot = size
        size += 1
    elif value > best[quota - 1]:
        slot = quota - 1
    else:
        return size
    while slot > 0 and best[slot - 1] < value:
        best[slot] = best[slot - 1]
        best_at[slot] = best_at[slot - 1]
        slot -= 1
    best[slot] = value
    best_at[slot] = position
    return size


@numba.njit(cache=True)
def select_walk(support, mass, entries, start, alpha, codes, similarity, relation_similarity, leads_indptr,
                leads_indices, quotas, cross_a, chunk_weight):
    """Positions in `support` of the retrieved nodes, ascending, and their scores, as
    `Retriever.select` defines them for rank "walk_similarity": entry points of retrievable
    types; the A and H nodes next to entry N and O nodes and to the `cross_a` entities of most
    walk mass; and per type T, S, A, H, R the `quotas` best non-entry nodes by
    sqrt(walk) x similarity (chunks x `chunk_weight`; R nodes at `relation_similarity`)."""
    n = len(support)
    is_entry = np.zeros(n, np.bool_)
    walk = mass.copy()
    entry = 0
    for i in range(n):
        while entry < len(entries) and entries[entry] < support[i]:
            entry += 1  # an entry point the walk let go of
        if entry < len(entries) and support[i] == entries[entry]:
            is_entry[i] = True
            walk[i] = max(walk[i] - alpha * start[entry], 0.0)
            entry += 1
    chosen = np.zeros(n, np.bool_)
    leaders = np.empty(n + max(cross_a, 0), np.int64)
    count = 0
    top_at, top = np.empty(max(cross_a, 1), np.int64), np.empty(max(cross_a, 1))
    entities = 0
    for i in range(n):
        code = codes[i]
        if is_entry[i]:
            if code <= MAX_RETRIEVABLE_CODE:
                chosen[i] = True
            elif code == ENTITY or code == OVERVIEW:
                leaders[count] = i
                count += 1
        elif code == ENTITY and walk[i] > 0 and cross_a > 0:
            entities = _offer(top_at, top, entities, cross_a, i, walk[i])
    for k in range(entities):
        leaders[count] = top_at[k]
        count += 1
    for k in range(count):
        node = support[leaders[k]]
        for j in range(leads_indptr[node], leads_indptr[node + 1]):
            chosen[np.searchsorted(support, leads_indices[j])] = True  # reached from mass: in the support
    width = max(quotas.max(), 1)
    best_at, best = np.empty((RETRIEVABLE, width), np.int64), np.empty((RETRIEVABLE, width))
    sizes = np.zeros(RETRIEVABLE, np.int64)
    score = np.zeros(n)
    for i in range(n):
        code = codes[i]
        if code > MAX_RETRIEVABLE_CODE:
            continue
        value = np.sqrt(walk[i]) * (relation_similarity if code == RELATION else similarity[i])
        if code == CHUNK:
            value *= chunk_weight
        score[i] = value
        if not is_entry[i] and value > 0 and quotas[code] > 0:
            sizes[code] = _offer(best_at[code], best[code], sizes[code], quotas[code], i, value)
    for code in range(RETRIEVABLE):
        for k in range(sizes[code]):
            chosen[best_at[code, k]] = True
    positions = np.flatnonzero(chosen)
    return positions, score[positions]


@numba.njit(cache=True)
def fit_budget(rows, priority, tokens, budget, key_indptr, key_ids, shown, doc_indptr, doc_codes, taken, powers):
    """`context.fit_budget` with sentence keys and the diversity factor, on key ids: of `rows`, those
    that fit the budget and repeat no sentence already kept, taken best first by priority x
    powers[k] (k: the nodes already kept from the node's documents, the most of any of them; ties
    by row). A node's sentence keys are key_ids[key_indptr[node]:key_indptr[node + 1]]; `shown`
    (one flag per key id) and `taken` (one count per document) come in cleared and are left cleared.
    With powers all 1 this is the plain order by priority."""
    n = len(rows)
    smallest = budget + 1
    for node in rows:
        if tokens[node] <= budget and tokens[node] < smallest:
            smallest = tokens[node]
    current = priority.copy()
    alive = np.ones(n, np.bool_)
    kept = np.empty(n, np.int64)
    count, used = 0, 0
    for _ in range(n):
        best = -1
        for i in range(n):
            if alive[i] and (best < 0 or current[i] > current[best] or (current[i] == current[best] and rows[i] < rows[best])):
                best = i
        if best < 0:
            break
        alive[best] = False
        node = rows[best]
        cost = tokens[node]
        if cost > budget or used + cost > budget:
            continue
        repeats = False
        for j in range(key_indptr[node], key_indptr[node + 1]):
            if shown[key_ids[j]]:
                repeats = True
                break
        if repeats:
            continue
        for j in range(key_indptr[node], key_indptr[node + 1]):
            shown[key_ids[j]] = True
        kept[count] = node
        count += 1
        used += cost
        if budget - used < smallest:
            break
        if doc_indptr[node + 1] > doc_indptr[node]:
            for j in range(doc_indptr[node], doc_indptr[node + 1]):
                taken[doc_codes[j]] += 1
            for i in range(n):
                if alive[i]:
                    other = rows[i]
                    seen = 0
                    for j in range(doc_indptr[other], doc_indptr[other + 1]):
                        seen = max(seen, taken[doc_codes[j]])
                    current[i] = priority[i] * powers[seen]
    for k in range(count):
        node = kept[k]
        for j in range(key_indptr[node], key_indptr[node + 1]):
            shown[key_ids[j]] = False
        for j in range(doc_indptr[node], doc_indptr[node + 1]):
            taken[doc_codes[j]] = 0
    return kept[:count]


@numba.njit(cache=True)
def bridge_candidates(indptr, indices, codes, doc_indptr, doc_codes, best, chunks, exclude, crowded, marks):
    """`rounds.bridge_candidates`: the entities (sorted) named by the units of the first `chunks`
    chunks (same document) that the `best` units come from (in rank order, a unit's chunks by
    row), less `exclude` (sorted) and those no unit outside those chunks names (checked for
    entities of at most `crowded` edges). `marks` (int8, one per node) comes in and is left cleared."""
    chosen = np.empty(max(chunks, 1), np.int64)
    count = 0
    for u in best:
        if count == chunks:
            break
        own = np.empty(indptr[u + 1] - indptr[u], np.int64)
        size = 0
        for j in range(indptr[u], indptr[u + 1]):
            c = indices[j]
            if codes[c] == CHUNK and _same_first_document(c, u, doc_indptr, doc_codes):
                own[size] = c
                size += 1
        for c in np.sort(own[:size]):
            seen = False
            for k in range(count):
                seen = seen or chosen[k] == c
            if not seen and count < chunks:
                chosen[count] = c
                count += 1
    room = 0
    for k in range(count):
        room += indptr[chosen[k] + 1] - indptr[chosen[k]]
    members = np.empty(room, np.int64)
    size = 0
    for k in range(count):
        c = chosen[k]
        for j in range(indptr[c], indptr[c + 1]):
            m = indices[j]
            if codes[m] == UNIT and marks[m] == 0 and _same_first_document(m, c, doc_indptr, doc_codes):
                marks[m] = 1
                members[size] = m
                size += 1
    members = members[:size]
    room = 0
    for m in members:
        room += indptr[m + 1] - indptr[m]
    found = np.empty(room, np.int64)
    size = 0
    for m in members:
        for j in range(indptr[m], indptr[m + 1]):
            e = indices[j]
            if codes[e] == ENTITY and marks[e] == 0:
                marks[e] = 2
                found[size] = e
                size += 1
    found = found[:size]
    kept = np.empty(len(found), np.int64)
    n = 0
    for e in np.sort(found):
        marks[e] = 0
        at = np.searchsorted(exclude, e)
        if at < len(exclude) and exclude[at] == e:
            continue
        elsewhere = indptr[e + 1] - indptr[e] > crowded
        for j in range(indptr[e], indptr[e + 1]):
            if elsewhere:
                break
            other = indices[j]
            elsewhere = codes[other] == UNIT and marks[other] != 1
        if elsewhere:
            kept[n] = e
            n += 1
    for m in members:
        marks[m] = 0
    return kept[:n]


@numba.njit(inline="always")
def _same_first_document(a, b, doc_indptr, doc_codes):
    """Whether two nodes' first documents agree (`rounds._same_document`)."""
    if doc_indptr[a + 1] <= doc_indptr[a] or doc_indptr[b + 1] <= doc_indptr[b]:
        return False
    return doc_codes[doc_indptr[a]] == doc_codes[doc_indptr[b]]


HALF_TO_SINGLE = np.float32(2.0**112)
"""A half's magnitude bits moved into a float32's place (13 bits left) read as 2^112 times the
half's value, normal or subnormal: one exact multiplication restores it."""


@numba.njit(cache=True)
def widen_half(codes, rows, out):
    """out[i] = row rows[i] of half-precision vectors (their bits as uint16), as float32, exactly:
    the magnitude bits shifted into place, the sign bit moved, then scaled by `HALF_TO_SINGLE`
    (finite halves only, which is all a unit vector holds). Loops without branches or tables,
    so they vectorise: the same values as `vectors.widen`'s table, several times faster."""
    bits = out.view(np.uint32)
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(codes.shape[1]):
            h = np.uint32(codes[r, j])
            bits[i, j] = ((h & np.uint32(0x7FFF)) << np.uint32(13)) | ((h & np.uint32(0x8000)) << np.uint32(16))
        for j in range(out.shape[1]):
            out[i, j] *= HALF_TO_SINGLE


@numba.njit(cache=True)
def int8_scores(codes, positions, query, out):
    """out[i] = codes[positions[i]] . query, int8 codes against an int8-rounded query (as int32),
    summed in int32: exact, so equal to numpy's float32 product of the same integers."""
    for i in range(positions.shape[0]):
        p = positions[i]
        total = np.int32(0)
        for j in range(codes.shape[1]):
            total += np.int32(codes[p, j]) * query[j]
        out[i] = np.float32(total)


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) for the array types the retriever
    passes, so that no query pays for it."""
    indptr, indices = np.array([0, 1, 2], np.int32), np.array([1, 0], np.int32)
    support, mass = ppr_paper(indptr, indices, np.ones(2, np.uint8), np.ones(2), np.array([0], np.int64), np.ones(1),
                              0.5, 1, np.zeros(2), 0.0)
    select_walk(support, mass, np.array([0], np.int64), np.ones(1), 0.5, np.array([UNIT, ENTITY], np.int8),
                np.zeros(len(support)), 0.0, indptr, indices, np.ones(RETRIEVABLE, np.int64), 1, 0.3)
    int8_scores(np.ones((2, 4), np.int8), np.array([1], np.int64), np.ones(4, np.int32), np.empty(1, np.float32))
    fit_budget(np.array([0, 1], np.int64), np.ones(2), np.ones(2, np.int32), 10, np.array([0, 1, 1], np.int32),
               np.array([0], np.int32), np.zeros(1, np.bool_), np.array([0, 1, 2], np.int32), np.array([0, 0], np.int32),
               np.zeros(1, np.int64), np.ones(3))
    widen_half(np.zeros((2, 4), np.uint16), np.array([1], np.int64), np.zeros((1, 4), np.float32))
    bridge_candidates(indptr, indices, np.array([UNIT, ENTITY], np.int8), np.array([0, 1, 2], np.int32),
                      np.array([0, 0], np.int32), np.array([0], np.int64), 2, np.zeros(0, np.int64), 256,
                      np.zeros(2, np.int8))
