"""The ``fake`` KV transfer backend (moves nothing): see :mod:`sgl_transfer_fake.backend`."""

__all__: list[str] = []
