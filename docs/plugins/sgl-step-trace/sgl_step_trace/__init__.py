"""Example sgl plugin: a scheduler extension that records each step (see README.md)."""

__all__: list[str] = []
