"""Prefill/decode disaggregation: a prefill server and a decode server share each request.

``--disaggregation-mode prefill`` runs prompts and hands their KV over
(:class:`~sgl_disaggregation.prefill.PrefillSide`); ``decode`` takes requests over and
generates (:class:`~sgl_disaggregation.decode.DecodeSide`). Both are scheduler extensions
(:class:`sgl.engine.extension.SchedulerExtension`). The bytes move through the
``--disaggregation-transfer-backend`` plugin (:class:`sgl.transfer.BaseKVTransfer`); the
coordination, SGLang's bootstrap exchange, is here. docs/disaggregation.md describes it whole.
"""

__all__: list[str] = []
