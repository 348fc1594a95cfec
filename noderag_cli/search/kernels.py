"""The vector side's scans, compiled with numba: widening half-precision rows and scoring probed
members by their int8 codes touch every element of a few thousand rows per question, where numpy
pays for temporaries (at 100,000 passages the vector side took 2.4 ms a question as numpy, 1.3 ms
compiled). Compiled once, cached on disk beside this file. Each gives exactly what its numpy
counterpart gives (`vectors.widen`, the float32 product of the same integers), so a search opened
without them finds the same (tests/test_search_parts.py, tests/test_scale.py). The graph steps have
one implementation, in numpy (steps.py).
"""

from __future__ import annotations

import numba
import numpy as np

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
    int8_scores(np.ones((2, 4), np.int8), np.array([1], np.int64), np.ones(4, np.int32), np.empty(1, np.float32))
    widen_half(np.zeros((2, 4), np.uint16), np.array([1], np.int64), np.zeros((1, 4), np.float32))
