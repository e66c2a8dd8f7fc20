"""SGLang's native HTTP API as an sgl frontend plugin."""

__all__: list[str] = []
