"""How deep a JSON message nests, found before decoding it.

The sink and the stream processors both refuse a message nested deeper than
:data:`MAX_DEPTH` before they decode it: decoding, ``repr`` or encoding it back would
otherwise recurse past what orjson, msgspec or Python allow. (numpy does the counting;
the producers, which never import this module, do not need it.)
"""

from __future__ import annotations

import re

import numpy as np

#: Deepest nesting of arrays and objects a message may have: far more than producers
#: send (their values stop at depth 32, see producers.encode), and far less than what
#: breaks decoding or encoding back (orjson refuses depth 1024 when reading and 255
#: when writing; msgspec and repr() recurse in C and may raise RecursionError).
MAX_DEPTH = 100

_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def _max_depth(brackets: bytes) -> int:
    if not brackets:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int32).max())


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> int:
    """0 when the arrays and objects of JSON ``data`` nest at most ``limit`` deep, else
    how deep they nest. Counting brackets bounds the depth from above in C passes
    (strings included); only when that bound exceeds ``limit`` are strings cut out
    (a regular expression, also in C) to find the exact depth."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return 0
    if _max_depth(data.translate(None, _BRACKETS)) <= limit:
        return 0
    depth = _max_depth(_STRING.sub(b"", data).translate(None, _BRACKETS))
    return depth if depth > limit else 0
