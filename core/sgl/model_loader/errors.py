"""The one error type of model loading."""

from __future__ import annotations

__all__ = ["ModelLoadError"]


class ModelLoadError(RuntimeError):
    """The model could not be found, read or matched to an installed model plugin.

    The message says what was wrong and what to do about it; callers show it to the user as is.
    """
