"""The seven node types: their letters, groups and codes, in one place for every table, array and
compiled kernel.

A letter is a node id's prefix (`S_…`) and its `type` column. A code numbers the type in arrays
(a build's `type_codes.npy`) and in the kernels: retrievable types first, so `code <=
MAX_RETRIEVABLE_CODE` says retrievable. Changing a code changes what every build holds on disk
(bump `search/prepare.VERSION`).
"""

from __future__ import annotations

import numpy as np

NODE_TYPES = ("T", "S", "N", "R", "A", "H", "O")  # the paper's order (tables, stats)
RETRIEVABLE_TYPES = ("T", "S", "A", "H", "R")
EMBEDDED_TYPES = ("T", "S", "A", "H")

CODE_ORDER = "TSAHRNO"  # retrievable types first
TYPE_CODE = {t: i for i, t in enumerate(CODE_ORDER)}
TYPE_LETTERS = np.array(list(CODE_ORDER), dtype="<U1")  # by type code
CHUNK, UNIT, ATTRIBUTE, HIGH_LEVEL, RELATION, ENTITY, OVERVIEW = (TYPE_CODE[t] for t in "TSAHRNO")
MAX_RETRIEVABLE_CODE = TYPE_CODE["R"]
assert set(CODE_ORDER) == set(NODE_TYPES) and max(TYPE_CODE[t] for t in RETRIEVABLE_TYPES) == MAX_RETRIEVABLE_CODE
