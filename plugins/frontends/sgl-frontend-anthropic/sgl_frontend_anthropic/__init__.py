"""The Anthropic-compatible frontend of sgl (``POST /v1/messages``)."""

__all__: list[str] = []
