"""How deeply a JSON document nests arrays and objects, found without recursion.

Invariant: :func:`nesting_depth` is exact for valid JSON (brackets inside strings do not
count) and takes time linear in the input and constant Python stack, so a body nested 100 000
levels deep is measured before anything that recurses (the JSON decoder, the API's own walks
over the decoded value) sees it. For invalid JSON the number may be off; the decoder refuses
such a body anyway.
"""

from __future__ import annotations

import re
from itertools import accumulate

# A JSON string: quote, then runs of ordinary characters and escapes ("unrolled" so that a
# long string costs no backtracking), then the closing quote.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# [ and { become +1, ] and } become -1 (0xFF read as a signed byte), the rest is deleted
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(raw: bytes) -> int:
    """The deepest level of nested arrays / objects in ``raw`` (0 for a scalar)."""
    brackets = _STRING.sub(b"", raw).translate(_STEPS, _NOT_BRACKETS)
    return max(accumulate(memoryview(brackets).cast("b")), default=0)
