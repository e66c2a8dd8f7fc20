"""``ModelRunner``: owns the model, its KV memory and the attention backend of one process.

It turns a model path into a loaded :class:`~sgl.models.BaseCausalLM` (architecture chosen
from the registries that plugins filled), sizes the KV pool, and runs forward passes on
:class:`~sgl.forward_batch.ForwardBatch` objects built with
:func:`~sgl.engine.batch_builder.make_forward_batch`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sgl.engine.cuda_graph import CudaGraphRunner, CudaGraphUnsupported
from sgl.forward_batch import ForwardMode
from sgl.devices import describe_device, resolve_device
from sgl.engine.memory import kv_pool_bytes
from sgl.kernels import cpu
from sgl.kvcache.pool import KVPool, ReqToTokenPool
from sgl.layers.attention import Attention
from sgl.layers.embedding import ParallelLMHead
from sgl.layers.quantized import deferred_weights, resolve_int8_activations
from sgl.layers.tp import get_tp_group, tp_min
from sgl.model_loader.gguf_archs import gguf_archs_of
from sgl.model_loader import (
    ModelLoadError,
    is_gguf,
    load_hf_config,
    open_weights,
    resolve_model_path,
)
from sgl.model_loader.formats import (
    CORE_CHOICES,
    ROUNDING_CHOICES,
    installed_weight_formats,
    weight_formats_of,
)
from sgl.parallel.base import GroupFailure

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.kernels.library import DecodeGraphs
    from sgl.model_loader.formats import WeightFormat
    from sgl.attention.base import BaseAttentionBackend
    from sgl.forward_batch import ForwardBatch
    from sgl.models.base import BaseCausalLM
    from sgl.parallel.base import RunnerMirror
    from sgl.plugins import Registries

__all__ = ["CUDA_GRAPH_MAX_BS", "SUPPORTED_DTYPES", "ModelRunner",
           "auto_cpu_dtype", "resolve_architecture", "resolve_dtype", "resolve_model_class",
           "resolve_quantization", "weights_bytes"]

logger = logging.getLogger(__name__)

#: the default ``--cuda-graph-max-bs`` when ``--max-running-requests`` is larger (SGLang's
#: default for most GPUs)
CUDA_GRAPH_MAX_BS = 160

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16}


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``"auto"``: on CPU see :func:`auto_cpu_dtype`; on accelerators the checkpoint's half type
    (else bfloat16)."""
    if name in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[name]
    if name != "auto":
        raise ValueError(f"unsupported dtype {name!r}; supported: auto, {', '.join(SUPPORTED_DTYPES)}")
    if device.type == "cpu":
        return auto_cpu_dtype()[0]
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def auto_cpu_dtype() -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` runs on this CPU, and why (for the log).

    bfloat16 where sgl's kernels run at a level with bfloat16 instructions, where its bfloat16
    matmuls read half the bytes and decode faster than float32
    (:meth:`~sgl.kernels.library.KernelLibrary.bfloat16_faster`; docs/benchmarks.md, "dtype
    `auto` on CPU"). Elsewhere float32. bfloat16's greedy tokens leave float32's within a few
    dozen, as transformers' own bfloat16 does; ``--dtype float32`` keeps them."""
    from sgl.kernels import cpu

    level = cpu.cpu_isa()
    if cpu.bfloat16_faster():
        return torch.bfloat16, f"bfloat16: the CPU kernels run at {level}, where it decodes faster"
    return torch.float32, (f"float32: the CPU kernels run at {level}, without bfloat16 "
                           "instructions")


def resolve_quantization(name: str, path: Path, config: PretrainedConfig,
                         formats: Mapping[str, type[WeightFormat]] | None = None) -> str:
    """The quantization mode of ``--quantization name`` for the model at ``path``: ``none``,
    ``gguf``, ``int8``/``int4``/``w8a8_int8`` (:data:`~sgl.model_loader.formats.CORE_CHOICES`), or the name
    of a checkpoint weight format of ``formats`` (the plugins'; default the installed ones);
    ValueError naming what fits when it does not apply."""
    formats = installed_weight_formats() if formats is None else formats
    choices = (*CORE_CHOICES, *formats)
    if name not in choices:
        raise ValueError(f"unknown quantization {name!r}; supported: {', '.join(choices)}")

    def needs(fmt: str) -> str:
        return f"--quantization {fmt} needs {formats[fmt].description} checkpoint"

    gguf = is_gguf(path)
    if gguf:
        if name in ROUNDING_CHOICES:
            raise ValueError(f"--quantization {name} rounds a Hugging Face checkpoint's weights; "
                             f"{path.name} is a GGUF file, served with its own blocks (auto) or "
                             "dequantized (none)")
        if name in formats:
            raise ValueError(f"{needs(name)}; {path.name} is a GGUF file (auto or gguf)")
        return "none" if name == "none" else "gguf"
    if name == "gguf":
        raise ValueError(f"--quantization gguf needs a .gguf file, not {path}")
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = str(quant.get("quant_method") or "").lower()
    if method in formats:
        formats[method].check(quant, path.name)
        if name in ROUNDING_CHOICES and name != method:
            raise ValueError(f"--quantization {name} rounds a dense checkpoint's weights; "
                             f"{path.name} is already quantized ({method}): serve it as it is "
                             "(auto) or dequantized (none)")
        if name not in ("auto", "none", method):
            raise ValueError(f"{needs(name)}; {path.name} is {formats[method].description} "
                             f"checkpoint (auto, {method} or none)")
        return "none" if name == "none" else method
    if name in formats and name not in ROUNDING_CHOICES:  # w8a8_int8 also rounds
        raise ValueError(f"{needs(name)}; {path.name} is {method or 'dense'}")
    if method and name != "none":
        served = ", ".join(f.description.split(" ", 1)[1] for f in formats.values())
        raise ValueError(f"{path.name} is a {method} checkpoint; sgl cannot load {method} "
                         f"weights (it runs GGUF files, {served or 'no other'} checkpoints, "
                         "and --quantization int8/int4 on a dense checkpoint)")
    return "none" if name == "auto" else name


def weights_bytes(model: torch.nn.Module) -> int:
    """Memory of ``model``'s weights: its parameters and buffers (a tied weight once), plus the
    copies the linear layers keep packed for the CPU kernels."""
    storages: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    packed: dict[int, int] = {}
    for module in model.modules():
        copy = getattr(module, "packed", None)
        tensor = getattr(copy, "tensor", None)
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            packed[id(tensor)] = tensor.untyped_storage().nbytes()
        elif isinstance(tensor, torch.Tensor):  # an opaque oneDNN tensor
            packed[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(storages.values()) + sum(packed.values())


def resolve_architecture(config: PretrainedConfig, registries: Registries,
                         plugin_manager: Any = None) -> str:
    """The registered architecture name for ``config.architectures``, else the one a plugin
    claims through ``sgl_resolve_model_arch``; :class:`ModelLoadError` naming the supported
    ones otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    supported = ", ".join(registries.models.names()) or "none (install a model plugin)"
    name = next((a for a in archs if a in registries.models), None)
    if name is None and plugin_manager is not None:
        name = plugin_manager.hook.sgl_resolve_model_arch(hf_config=config)
        if name is not None and name not in registries.models:
            raise ModelLoadError(f"a plugin resolved the model to {name!r}, which is not a "
                                 f"registered architecture; supported architectures: {supported}")
    if name is None:
        wanted = ", ".join(archs) or f"(none; model_type {getattr(config, 'model_type', '?')!r})"
        raise ModelLoadError(
            f"model architecture {wanted} is not provided by any installed plugin; supported "
            f"architectures: {supported}"
        )
    return name


def resolve_model_class(config: PretrainedConfig, registries: Registries,
                        plugin_manager: Any = None) -> type[BaseCausalLM]:
    """The model class :func:`resolve_architecture` picks, imported."""
    return _import_model_class(resolve_architecture(config, registries, plugin_manager),
                               registries)


def _import_model_class(name: str, registries: Registries) -> type[BaseCausalLM]:
    entry = registries.models.entry(name)
    try:
        return entry.load()
    except Exception as exc:
        raise ModelLoadError(
            f"plugin {entry.owner!r} registered {name!r} as {entry.target!r}, which failed to "
            f"import: {type(exc).__name__}: {exc}"
        ) from exc


def _kv_layout(model: BaseCausalLM, config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` from the model's attention layers."""
    specs = [m.spec for m in model.modules() if isinstance(m, Attention)]
    if specs:
        shapes = {(s.num_kv_heads, s.head_dim) for s in specs}
        if len(shapes) > 1:
            raise ModelLoadError(f"attention layers differ in KV shape {sorted(shapes)}; "
                                 "the KV pool needs one shape")
        (kv_heads, head_dim), = shapes
        return max(s.layer_id for s in specs) + 1, kv_heads, head_dim
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


class ModelRunner:
    """The model, the KV pool, the request table and the attention backend of one process.

    :param model_path: Hugging Face folder or ``.gguf`` file; None for the bundled SmolLM2.
    :param dtype: ``"auto"`` (:func:`auto_cpu_dtype` on CPU), ``"float32"``, ``"bfloat16"`` or
        ``"float16"``.
    :param quantization: ``auto``, ``none``, ``gguf``, ``int8``, ``int4`` or a registered
        weight format's name (:func:`resolve_quantization`).
    :param int8_activations: whether the quantized matmuls round activations to int8:
        ``auto``, ``on`` or ``off`` (:func:`sgl.layers.quantized.resolve_int8_activations`).
    :param attention_backend: a name registered by an attention plugin (``"torch"``).
    :param registries: the plugin manager's registries (models, attention backends).
    :param plugin_manager: asked through ``sgl_resolve_model_arch`` when no registered class
        matches ``config.architectures``; may be None.
    :param max_total_tokens: KV pool size in tokens; None sizes it from free memory.
    :param mem_fraction: on CUDA, the share of the GPU's total memory the weights and the KV
        pool take together (SGLang's ``--mem-fraction-static``, default
        :data:`~sgl.engine.memory.DEFAULT_GPU_MEM_FRACTION`); elsewhere the share of free host
        memory (after loading the weights) the KV pool takes (default
        :data:`~sgl.engine.memory.DEFAULT_CPU_MEM_FRACTION`).
    :param max_running_requests: rows of ``req_to_token`` (concurrent requests).
    :param context_length: longest sequence; None uses ``max_position_embeddings``.
    :param page_size: KV page size passed to the pool.
    :param device: where the model, the KV pool and the batches' tensors live: ``"auto"``,
        ``"cpu"``, ``"cuda"`` or any torch device (:func:`sgl.devices.resolve_device`).
    :param show_progress: draw a progress bar while loading weights.
    :param cpu_graphs: on CPU, replay decode forwards the kernel library recorded
        (:meth:`~sgl.kernels.library.KernelLibrary.decode_graphs`).
    :param cuda_graphs: on CUDA, capture decode forwards as CUDA graphs at start-up
        (:mod:`sgl.engine.cuda_graph`).
    :param cuda_graph_max_bs: the largest batch captured (at most ``max_running_requests``);
        None: :data:`CUDA_GRAPH_MAX_BS`.
    """

    def __init__(self, *, model_path: str | None = None, dtype: str = "auto",
                 quantization: str = "auto", int8_activations: str = "auto",
                 attention_backend: str = "torch",
                 registries: Registries,
                 plugin_manager: Any = None, max_total_tokens: int | None = None,
                 mem_fraction: float | None = None, max_running_requests: int = 64,
                 context_length: int | None = None, page_size: int = 1,
                 device: str | torch.device = "cpu", show_progress: bool = True,
                 cpu_graphs: bool = True, cuda_graphs: bool = True,
                 cuda_graph_max_bs: int | None = None) -> None:
        self.device = resolve_device(device)
        self.model_path = resolve_model_path(model_path)
        #: the GGUF architectures the plugins registered (a .gguf model is read with them)
        self.gguf_archs = gguf_archs_of(registries)
        #: the checkpoint weight formats the plugins registered
        self.weight_formats = weight_formats_of(registries)
        self.hf_config = load_hf_config(self.model_path, self.gguf_archs, self.weight_formats)
        self.dtype = resolve_dtype(dtype, self.hf_config, self.device)
        if dtype == "auto" and self.device.type == "cpu":
            logger.info("dtype auto -> %s", auto_cpu_dtype()[1])
        elif dtype == "auto":
            logger.info("dtype auto -> %s on %s", str(self.dtype).removeprefix("torch."),
                        describe_device(self.device))
        self.vocab_size = int(self.hf_config.vocab_size)
        self.context_length = self._context_length(context_length)
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be at least 1, got {max_running_requests}")

        self.quantization = resolve_quantization(quantization, self.model_path, self.hf_config,
                                                 self.weight_formats)
        self.architecture = resolve_architecture(self.hf_config, registries, plugin_manager)
        model_cls = _import_model_class(self.architecture, registries)
        backend_cls = registries.attention.load(attention_backend)  # fail before loading weights
        #: whether the quantized matmuls round x to int8 (--int8-activations resolved)
        self.round_x = resolve_int8_activations(int8_activations, self.quantization,
                                                self.device)
        with contextlib.ExitStack() as stack:
            if self.quantization != "none":
                stack.enter_context(deferred_weights(self.quantization, round_x=self.round_x))
            self.model: BaseCausalLM = model_cls(self.hf_config, dtype=self.dtype,
                                                 device=self.device)
        self.model.eval()
        self._load_weights(show_progress)
        self.weights_bytes = weights_bytes(self.model)
        logger.info("weights: %.1f MiB (%s)", self.weights_bytes / 2**20,
                    self._describe_weights())
        self._log_int8_activations(int8_activations)

        num_layers, kv_heads, head_dim = _kv_layout(self.model, self.hf_config)
        per_token = KVPool.bytes_per_token(num_layers=num_layers, num_kv_heads=kv_heads,
                                           head_dim=head_dim, dtype=self.dtype)
        # tensor-parallel ranks share slot numbers (the leader hands them out): one size
        size = tp_min(self._pool_size(max_total_tokens, mem_fraction, per_token,
                                      max_running_requests * self.context_length))
        self.kv_pool = KVPool(size=size, num_layers=num_layers, num_kv_heads=kv_heads,
                              head_dim=head_dim, dtype=self.dtype, device=self.device,
                              page_size=page_size)
        self.kv_pool_bytes = size * per_token
        self.req_to_token_pool = ReqToTokenPool(max_requests=max_running_requests,
                                                max_context_len=self.context_length,
                                                device=self.device)
        self.attn_backend: BaseAttentionBackend = backend_cls(
            kv_pool=self.kv_pool, req_to_token_pool=self.req_to_token_pool, device=self.device)
        #: whether decode steps write the KV a prefill of the same tokens would (then the
        #: prefix cache may keep finished answers; see BaseAttentionBackend.decode_matches_prefill)
        self.decode_matches_prefill = self.attn_backend.decode_matches_prefill(
            [m.spec for m in self.model.modules() if isinstance(m, Attention)], self.dtype)
        #: tells the other tensor-parallel ranks about each forward and logits call (set on
        #: the leader by the parallel strategy); None in a single process
        self.mirror: RunnerMirror | None = None
        self._last_hidden: torch.Tensor | None = None
        #: the LM head whose logits ``logits_at(reuse=True)`` writes into ``_logits_buffer``
        self._lm_head = _lm_head(self.model)
        self._logits_buffer: torch.Tensor | None = None
        #: replays of recorded decode forwards (CUDA graphs, or the CPU kernel library's
        #: recordings); None when off
        self.decode_graphs: DecodeGraphs | None = None
        tensor_parallel = get_tp_group().size > 1  # a replay cannot run the all-reduces
        graphs_off = "off"
        library = cpu.load() if self.device.type == "cpu" else None
        if cpu_graphs and library is not None and not tensor_parallel:
            self.decode_graphs = library.decode_graphs(self.model, self.attn_backend)
        elif cuda_graphs and self.device.type == "cuda" and not tensor_parallel:
            # a batch never holds more than max_running_requests sequences
            max_bs = min(cuda_graph_max_bs or CUDA_GRAPH_MAX_BS, max_running_requests)
            try:
                graphs = CudaGraphRunner(
                    self.model, self.attn_backend, kv_pool=self.kv_pool,
                    req_to_token_pool=self.req_to_token_pool, max_bs=max_bs,
                    device=self.device, show_progress=show_progress)
                graphs.capture()
                self.decode_graphs = graphs
            except CudaGraphUnsupported as exc:
                graphs_off = f"off ({exc})"
                logger.warning("CUDA graphs are off: %s", exc)
        logger.info("model %s (%s, %s) on %s: KV pool of %d tokens (%.1f MiB), backend %s, "
                    "decode graphs %s, CPU kernels %s", self.model_path.name,
                    model_cls.__name__, self.dtype, describe_device(self.device), size,
                    self.kv_pool_bytes / 2**20, attention_backend,
                    f"on ({type(self.decode_graphs).__name__})"
                    if self.decode_graphs is not None else
                    "off (tensor parallel)" if tensor_parallel else graphs_off,
                    cpu.describe_isa() if self.device.type == "cpu" else "not used")

    def _context_length(self, requested: int | None) -> int:
        limit = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        if requested is None:
            if not limit:
                raise ModelLoadError("the model config has no max_position_embeddings; "
                                     "pass a context length")
            return limit
        if requested < 1 or (limit and requested > limit):
            raise ValueError(f"context_length must be between 1 and the model's "
                             f"max_position_embeddings ({limit}), got {requested}")
        return requested

    def _load_weights(self, show_progress: bool) -> None:
        from tqdm.auto import tqdm

        source = open_weights(self.model_path, self.dtype,
                              quantized=self.quantization not in ("none", "int8", "int4"),
                              gguf_archs=self.gguf_archs, weight_formats=self.weight_formats)
        stream = tqdm(source, total=len(source), desc="Loading weights", unit="tensor",
                      disable=not show_progress)
        self.model.load_weights((name, t.to(self.device)) for name, t in stream)
        # layers that keep a derived copy of their weights (packed CPU matmuls) build it now,
        # before the KV pool is sized from the memory that is left
        for module in self.model.modules():
            process = getattr(module, "process_weights_after_loading", None)
            if callable(process):
                process()

    def _log_int8_activations(self, mode: str) -> None:
        """Say whether the quantized matmuls round activations to int8 (``--int8-activations``),
        where the model has quantized layers."""
        layouts = {getattr(m, "weight_layout", None) for m in self.model.modules()}
        layouts.update(layout for m in self.model.modules()
                       if isinstance(getattr(m, "layouts", None), dict)
                       for layout in m.layouts.values())
        quantized = bool(layouts & {"q4", "q8", "q6", "q4x16", "q8x16", "q6x16"})
        if not quantized:
            return
        if self.round_x:
            why = "" if mode == "on" else " (auto: a GGUF file, multiplied as llama.cpp does)"
            logger.info("int8 activations on%s: every quantized matmul rounds its activations to "
                        "int8 per block of 32 and multiplies integers; greedy output is the same "
                        "alone, batched and after a prefix-cache hit; --int8-activations off "
                        "keeps every product exact", why)
        elif mode == "auto" and self.quantization == "gguf" and self.device.type == "cpu":
            logger.info("int8 activations off (auto: no faster with the CPU kernels at %s); "
                        "every quantized product exact", cpu.describe_isa())
        else:
            logger.info("int8 activations off: every quantized product exact%s",
                        "" if mode == "off" else "; --int8-activations on rounds them to int8 "
                        "as llama.cpp does")

    def _describe_weights(self) -> str:
        layouts = Counter(getattr(m, "weight_layout", None) or "dense"
                          for m in self.model.modules() if hasattr(m, "weight_layout"))
        experts = Counter(layout or "dense" for m in self.model.modules()
                          if isinstance(getattr(m, "layouts", None), dict)
                          for layout in m.layouts.values())
        held = ", ".join(f"{n} {kind}" for kind, n in sorted(layouts.items()))
        if experts:  # the stacked experts of mixture-of-experts layers, a projection each
            held += "; expert projections: " + ", ".join(
                f"{n} {kind}" for kind, n in sorted(experts.items()))
        return f"quantization {self.quantization}; layers: {held}" if held else \
            f"quantization {self.quantization}"

    def _pool_size(self, max_total_tokens: int | None, mem_fraction: float | None,
                   per_token: int, cap: int) -> int:
        if max_total_tokens is not None:
            if max_total_tokens < 1:
                raise ValueError(f"max_total_tokens must be positive, got {max_total_tokens}")
            return max_total_tokens
        free = kv_pool_bytes(self.device, mem_fraction)
        size = min(free // max(per_token, 1), cap)
        if size < 1:
            raise ModelLoadError(
                f"no memory left for the KV cache ({free / 2**20:.0f} MiB for it, "
                f"{per_token} bytes per token); pass max_total_tokens or raise "
                "mem_fraction_static"
            )
        if size < self.context_length:
            logger.warning("the KV pool holds %d tokens, less than one full context (%d)",
                           size, self.context_length)
        return size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; hidden states ``[num_tokens, hidden]`` of every new token."""
        if self.mirror is None:
            return self._forward(batch)
        self.mirror.forward(batch)
        try:
            self._last_hidden = self._forward(batch)
        except Exception as exc:  # the other ranks are in (or past) the same collectives
            raise GroupFailure(f"a tensor-parallel forward failed: {exc}") from exc
        return self._last_hidden

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        decoding = batch.mode == ForwardMode.DECODE
        graphs = self.decode_graphs
        if decoding and graphs is not None and graphs.can_run(batch):
            return graphs.forward(batch)  # (plans what it replays)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch)

    @torch.inference_mode()
    def logits_at(self, hidden: torch.Tensor, indices: torch.Tensor, *,
                  reuse: bool = False) -> torch.Tensor:
        """float32 logits ``[len(indices), vocab]`` of the chosen token rows of ``hidden``
        (with tensor parallelism: of the last forward's hidden states, which the other ranks
        hold too).

        :param reuse: write them into a buffer that the next call with ``reuse`` overwrites,
            not into a new tensor: for a caller done with them by then (the scheduler's
            sampling). A new float32 tensor of a batch's logits every step often came from
            fresh pages, the heap having split the last one for small objects, and its page
            faults slowed the step (docs/benchmarks.md, "Page faults in the decode step").
        """
        rows = hidden.index_select(0, indices.to(hidden.device))
        if self.mirror is not None:
            if hidden is not self._last_hidden:
                raise ValueError("with tensor parallelism, logits_at takes the hidden states "
                                 "the last forward returned")
            self.mirror.logits_at(indices)
        head = self._lm_head if reuse else None
        if head is not None:
            head.logits_scratch = self._logits_scratch(rows.shape[0], head.num_embeddings)
        try:
            return self.model.compute_logits(rows)
        except Exception as exc:
            if self.mirror is None:
                raise
            raise GroupFailure(f"a tensor-parallel logits computation failed: {exc}") from exc
        finally:
            if head is not None:
                head.logits_scratch = None

    def _logits_scratch(self, rows: int, vocab: int) -> torch.Tensor:
        """The buffer of ``logits_at(reuse=True)``, grown to hold ``rows`` rows."""
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab:
            least = self.req_to_token_pool.max_requests if buffer is None else buffer.shape[0]
            buffer = self._logits_buffer = torch.empty(
                max(rows, least), vocab, dtype=torch.float32, device=self.device)
        return buffer

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; float32 logits ``[batch_size, vocab]`` of each sequence's last new
        token (the next-token distribution)."""
        hidden = self.forward(batch)
        last = torch.cumsum(batch.extend_seq_lens, dim=0) - 1
        return self.logits_at(hidden, last)


def _lm_head(model: torch.nn.Module) -> ParallelLMHead | None:
    """The model's LM head, where it is sgl's :class:`~sgl.layers.ParallelLMHead`."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, ParallelLMHead) else None
