"""Prefill/decode disaggregation: a prefill server and a decode server share each request.

``--disaggregation-mode prefill`` runs prompts and hands their KV over
(:class:`~sgl.engine.disaggregation.prefill.PrefillSide`); ``decode`` takes requests over and
generates (:class:`~sgl.engine.disaggregation.decode.DecodeSide`). The bytes move through the
``--disaggregation-transfer-backend`` plugin (:class:`sgl.transfer.BaseKVTransfer`); the
coordination, SGLang's bootstrap exchange, is here. docs/disaggregation.md describes it whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.engine.disaggregation.bootstrap import advertised_host
from sgl.transfer import KVBuffers

if TYPE_CHECKING:
    from sgl.engine.disaggregation.decode import DecodeSide
    from sgl.engine.disaggregation.prefill import PrefillSide
    from sgl.engine.scheduler import Scheduler

__all__ = ["disaggregation_side"]


def disaggregation_side(scheduler: Scheduler) -> PrefillSide | DecodeSide | None:
    """The side ``--disaggregation-mode`` gives this scheduler (None: not disaggregated), with
    its transfer backend over the scheduler's KV pool."""
    settings = scheduler.settings
    if settings.disaggregation_mode == "null":
        return None
    cls = scheduler.plugins.registries.transfer.load(settings.disaggregation_transfer_backend)
    pool = scheduler.runner.kv_pool
    backend = cls(KVBuffers([*pool.k_buffer, *pool.v_buffer]),
                  role=settings.disaggregation_mode, host=advertised_host(settings.host))
    if settings.disaggregation_mode == "prefill":
        from sgl.engine.disaggregation.prefill import PrefillSide

        return PrefillSide(scheduler, backend)
    from sgl.engine.disaggregation.decode import DecodeSide

    return DecodeSide(scheduler, backend)
