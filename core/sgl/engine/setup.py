"""What a scheduler process sets before it builds its model, and the model runner it builds:
the CPU kernels' library and instruction-set level, torch's and the kernels' threads (see
:mod:`sgl.threads`), and the :class:`~sgl.engine.model_runner.ModelRunner` the settings
describe. Leaders and followers of a parallel group alike (:mod:`sgl.engine.scheduler_process`);
then, for the leader's scheduler, its cache policy and the decode forwards recorded for replay.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sgl.kernels import cpu
from sgl.kvcache import BaseCachePolicy, NoPrefixCache
from sgl.layers.tp import get_tp_group
from sgl.threads import ThreadPlan, plan_threads

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.model_runner import ModelRunner
    from sgl.plugins import SglPluginManager

__all__ = ["build_runner", "configure_threads", "eos_token_ids", "make_cache_policy",
           "prepare_process", "record_decode_forwards"]

logger = logging.getLogger("sgl.scheduler")


def configure_threads(num_threads: int | None, kernel_threads: int | None) -> ThreadPlan:
    """Set torch's and sgl's kernel threads as the scheduler runs them (see :mod:`sgl.threads`;
    after ``cpu.set_isa``, which decides whether the kernels run). ValueError for counts that
    would fight over the cores."""
    kernels = cpu.load() is not None
    plan = plan_threads(num_threads, kernel_threads, kernels=kernels)
    torch.set_num_threads(plan.torch_threads)
    cpu.set_threads(plan.kernel_threads)
    if kernel_threads is not None and not kernels:
        logger.warning("--kernel-threads %d has no effect: sgl's CPU kernels do not run here "
                       "(%s)", kernel_threads, cpu.describe_isa())
    elif kernels and not plan.kernels_on:
        logger.warning("torch runs on %d threads: sgl's CPU matmul kernels and the replayed "
                       "decode forwards are off (they need --num-threads 1)", plan.torch_threads)
    return plan


def prepare_process(settings: ServerSettings, pm: SglPluginManager) -> ThreadPlan:
    """What a scheduler process sets before it builds its model: the CPU kernels' library and
    level, and the threads."""
    cpu.use_plugins(pm)  # the kernel library of the plugins this process loaded
    cpu.set_isa(settings.cpu_isa)
    return configure_threads(settings.num_threads, settings.kernel_threads)


def build_runner(settings: ServerSettings, pm: SglPluginManager) -> ModelRunner:
    """The model runner the settings describe."""
    from sgl.engine.model_runner import ModelRunner

    return ModelRunner(
        model_path=settings.model_path, dtype=settings.dtype,
        quantization=settings.quantization,
        int8_activations=settings.int8_activations, attention_backend=settings.attention_backend, registries=pm.registries,
        plugin_manager=pm, max_total_tokens=settings.max_total_tokens,
        mem_fraction=settings.mem_fraction_static,
        max_running_requests=settings.max_running_requests,
        context_length=settings.context_length, page_size=settings.page_size,
        device=settings.device, cpu_graphs=not settings.disable_cpu_graph,
        cuda_graphs=not settings.disable_cuda_graph, cuda_graph_max_bs=settings.cuda_graph_max_bs,
        show_progress=get_tp_group().rank == 0)  # one bar, not one per rank


def record_decode_forwards(runner: ModelRunner, settings: ServerSettings) -> list[int]:
    """Make the runner's decode graphs ready before serving for batch sizes up to
    ``--cpu-graph-max-bs`` (:meth:`~sgl.kernels.library.DecodeGraphs.prepare`); the sizes
    ready. The scheduler calls it only where its decode steps stay plain one-token steps (not
    with speculative decoding, not on a prefill server)."""
    graphs = runner.decode_graphs
    if graphs is None:
        return []
    return graphs.prepare(settings.cpu_graph_max_bs, settings.max_running_requests,
                          show_progress=get_tp_group().rank == 0)


def make_cache_policy(settings: ServerSettings, pm: SglPluginManager,
                      runner: ModelRunner) -> BaseCachePolicy:
    """The cache policy the settings ask for: ``--cache-policy``, else ``radix`` when a plugin
    registers it, else none; ``--disable-radix-cache`` always means none."""
    name = settings.cache_policy
    if name is None and "radix" in pm.registries.cache:
        name = "radix"
    if settings.disable_radix_cache or name is None:
        cls: type[BaseCachePolicy] = NoPrefixCache
    else:
        cls = pm.registries.cache.load(name)
    logger.info("prefix cache: %s; schedule policy: %s", cls.name, settings.schedule_policy)
    return cls(kv_pool=runner.kv_pool, page_size=settings.page_size)


def eos_token_ids(hf_config: Any) -> list[int]:
    """The model's end-of-sequence token ids (its config's ``eos_token_id``, one or a list)."""
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
