"""An example sgl plugin."""

__all__: list[str] = []
