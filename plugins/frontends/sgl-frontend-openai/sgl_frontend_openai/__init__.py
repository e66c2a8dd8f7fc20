"""The OpenAI-compatible frontend of sgl."""

__all__: list[str] = []
