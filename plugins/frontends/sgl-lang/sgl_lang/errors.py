"""The language's exceptions."""

from __future__ import annotations

__all__ = ["BackendError", "LangError"]


class LangError(RuntimeError):
    """A program used the language wrongly (a role inside a role, no backend, ...)."""


class BackendError(RuntimeError):
    """The backend refused a request or could not be reached. ``status`` is the HTTP status
    (``None`` when the server could not be reached) and the message is the server's."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
