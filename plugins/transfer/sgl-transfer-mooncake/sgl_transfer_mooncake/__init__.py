"""The ``mooncake`` KV transfer backend for prefill/decode disaggregation: see
:mod:`sgl_transfer_mooncake.backend`."""

__all__: list[str] = []
