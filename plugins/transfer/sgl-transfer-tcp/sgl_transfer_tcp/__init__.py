"""The ``tcp`` KV transfer backend for prefill/decode disaggregation: see
:mod:`sgl_transfer_tcp.backend`."""

__all__: list[str] = []
