"""The ``fake`` KV transfer backend: every write succeeds at once and moves nothing.

**The decode side's KV is garbage with it**: the rows a request was given on the decode
server keep whatever they held before, so the tokens decoded from them mean nothing. It is for
what does not depend on the KV's values: warming up, and testing the disaggregation's state
machine (the bootstrap exchange, which slots, timeouts, aborts) without a transfer's cost or
failures. SGLang has the same backend (``--disaggregation-transfer-backend fake``).
"""

from __future__ import annotations

from typing import Any

from sgl.transfer import BaseKVTransfer

__all__ = ["FakeKVTransfer"]


class FakeKVTransfer(BaseKVTransfer):
    """Moves nothing: :meth:`write` returns 0 at once (the decode side's KV is garbage)."""

    name = "fake"

    def write(self, peer: dict[str, Any], room: int, src_slots: list[int],
              dst_slots: list[int], timeout: float) -> int:
        return 0
