"""The Ollama-compatible frontend of sgl (``/api/chat``, ``/api/generate``, ...)."""

__all__: list[str] = []
