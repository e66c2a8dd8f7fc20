"""Sessions: a conversation kept in the prefix cache from one request to the next.

``/open_session`` opens one; each request naming it (``session_params.id``) leaves its whole
sequence, prompt and answer, protected in the cache in place of the previous turn's, so the next
turn finds it; ``/close_session`` lets the cache evict it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sgl.kvcache import BaseCachePolicy, PrefixMatch

__all__ = ["MAX_OPEN_SESSIONS", "Sessions"]

#: the most sessions open at once (each is an entry here and a protected cache prefix)
MAX_OPEN_SESSIONS = 1024


class Sessions:
    """The open sessions, each with the cached conversation it protects (empty until its first
    request)."""

    def __init__(self) -> None:
        self.open: dict[str, PrefixMatch] = {}

    def __len__(self) -> int:
        return len(self.open)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.open

    def open_session(self, session_id: str) -> dict[str, Any]:
        if session_id in self.open:
            return {"success": False, "message": f"session {session_id!r} is already open"}
        if len(self.open) >= MAX_OPEN_SESSIONS:
            return {"success": False, "message": f"{MAX_OPEN_SESSIONS} sessions are open, the "
                    "most this server keeps; close one (/close_session) first"}
        self.open[session_id] = PrefixMatch()
        return {"success": True, "session_id": session_id}

    def close_session(self, session_id: str, cache: BaseCachePolicy) -> dict[str, Any]:
        match = self.open.pop(session_id, None)
        if match is None:
            return {"success": False, "message": f"session {session_id!r} is not open"}
        cache.unprotect(match)
        return {"success": True, "session_id": session_id}

    def keep(self, session_id: str, token_ids: Sequence[int], cache: BaseCachePolicy) -> None:
        """After a session's request: protect its whole conversation in the cache, in place of
        the previous turn's."""
        previous = self.open.get(session_id)
        if previous is None:
            return
        match = cache.match_prefix(token_ids)
        cache.protect(match)
        cache.unprotect(previous)
        self.open[session_id] = match

    def forget_cached(self) -> None:
        """The cache was flushed: every session starts over."""
        self.open = dict.fromkeys(self.open, PrefixMatch())
