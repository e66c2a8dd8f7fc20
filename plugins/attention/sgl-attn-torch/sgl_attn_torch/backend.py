"""``TorchAttentionBackend``: attention over the paged KV pool with plain PyTorch, and with sgl's
CPU kernels (``sgl::decode_attention``, ``sgl::extend_attention``) where they run.

On CPU with the kernels, decode and extend are one kernel call per layer that reads the keys
and values straight from the pool through ``req_to_token`` and shares the batch out over the
kernels' threads; in a mixed step (the running requests' one new token each, then prompt
chunks) the running requests' rows (``ForwardBatch.decode_seqs``) go to the decode kernel, which
attends them faster than the extend kernel's tiles of query rows, and prompt tokens to the
extend kernel; the two give a query row the same bits (``decode_matches_prefill``), so a
token's result does not depend on which took it. Otherwise, extend runs one SDPA call per sequence
over its cached prefix plus its new tokens, so there is no padding to the longest sequence. When
a sequence has no cached prefix its new keys are used directly and SDPA's causal mode does the
masking.

Decode gathers the KV of several sequences at once into a padded block (``index_select``
through ``req_to_token``) with a key-padding mask, in chunks of at most
``DECODE_CHUNK_TOKENS`` padded keys so that the gathered block stays in cache (one block for
the whole batch falls out of cache; one SDPA call per sequence pays its overhead each time;
docs/kernels.md, "Decode attention without the kernels"). Gathering with ``index_select`` is
faster than advanced indexing (``pool[idx]``) on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sgl.attention.base import AttentionLayerSpec, BaseAttentionBackend
from sgl.forward_batch import ForwardMode
from sgl.kernels import cpu
from sgl.kernels.library import KernelLibrary
from sgl_attn_torch.kernels import attend, decode_mask, extend_mask

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sgl.forward_batch import ForwardBatch

__all__ = ["DECODE_CHUNK_TOKENS", "TorchAttentionBackend", "TorchAttentionMetadata"]

DECODE_CHUNK_TOKENS = 8192


@dataclass
class _ExtendSeq:
    q_start: int
    q_end: int
    prefix_len: int
    kv_indices: torch.Tensor | None  # [seq_len] pool slots, when there is a cached prefix
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    tree: torch.Tensor | None = None  # [n, n] bool over the new tokens (a token tree)


@dataclass
class _DecodeChunk:
    start: int  # first batch row
    end: int
    max_len: int
    kv_indices: torch.Tensor  # [(end - start) * max_len] pool slots, row-major
    seq_lens: torch.Tensor  # [end - start]
    padded: bool  # some sequence is shorter than max_len
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


@dataclass
class TorchAttentionMetadata:
    """What :meth:`TorchAttentionBackend.init_forward_metadata` plans once per batch."""

    mode: ForwardMode
    extend: list[_ExtendSeq] = field(default_factory=list)
    decode: list[_DecodeChunk] = field(default_factory=list)
    native: _NativeDecode | None = None  # sgl's CPU decode kernel, when it can run
    native_extend: _NativeExtend | None = None  # sgl's CPU extend kernel, when it can run
    batch: ForwardBatch | None = None  # for planning ``decode`` late, if a layer needs it


@dataclass
class _NativeDecode:
    """The per-batch arguments of ``sgl::decode_attention`` (see :mod:`sgl.kernels.ops`)."""

    kernels: KernelLibrary
    rows: torch.Tensor  # [batch] int64, contiguous
    lens: torch.Tensor
    loc: torch.Tensor
    table: torch.Tensor


@dataclass
class _NativeExtend:
    """The per-batch arguments of ``sgl::extend_attention`` (see :mod:`sgl.kernels.ops`)."""

    kernels: KernelLibrary
    rows: torch.Tensor  # [batch] int64, contiguous
    q_starts: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    table: torch.Tensor
    #: int32 [tokens]: the new tokens each token of a token tree sees (bit j: new token j of
    #: its sequence), -1 elsewhere; None without trees
    tree_bits: torch.Tensor | None = None
    #: the batch's leading sequences of one new token on a cached prefix (the running requests
    #: of a mixed step), which the decode kernel attends faster than extend tiles can; the
    #: other arguments then describe only the sequences after them
    decodes: _NativeDecode | None = None


def _tree_bits(seqs: list[_ExtendSeq], tokens: int) -> torch.Tensor | None:
    """``sgl::extend_attention``'s ``tree_bits`` for a batch with token trees: row i of a tree
    has bit j set where it sees new token j; -1 for the other rows. None when a tree has more
    than 32 tokens (the kernel's limit)."""
    bits = torch.full((tokens,), -1, dtype=torch.int32)
    for seq in seqs:
        if seq.tree is None:
            continue
        n = seq.q_end - seq.q_start
        if n > 32:
            return None
        weights = torch.ones(n, dtype=torch.int64) << torch.arange(n)
        packed = (seq.tree.to("cpu", torch.int64) * weights).sum(dim=1)
        bits[seq.q_start:seq.q_end] = packed.to(torch.int64).where(packed < 2**31,
                                                                  packed - 2**32).to(torch.int32)
    return bits


def _cpu_list(values: list[int], tensor: torch.Tensor) -> list[int]:
    return values if values else [int(x) for x in tensor.tolist()]


class TorchAttentionBackend(BaseAttentionBackend):
    """Extend and decode attention for ragged batches, GQA, sliding window and soft-capping."""

    name = "torch"
    supports_tree_mask = True

    def decode_matches_prefill(self, layers: Sequence[AttentionLayerSpec],
                               dtype: torch.dtype) -> bool:
        """True where every layer runs on sgl's CPU kernels, whose decode kernel gives each
        query row the extend kernel's arithmetic (``csrc/kernels_avx512.c``, "paged decode
        attention"); torch's operators sum in orders that depend on the batch."""
        kernels = cpu.load() if self.device.type == "cpu" else None
        if kernels is None or not self.kv_pool.v_buffer:
            return False
        v_dim = self.kv_pool.v_buffer[0].shape[-1]
        return (dtype in cpu.DTYPES
                and kernels.extend_attention_faster(dtype)
                and all(layer.num_heads // layer.num_kv_heads <= 64
                        and kernels.decode_attention_fits(layer.num_heads, layer.num_kv_heads,
                                                          layer.head_dim, v_dim)
                        for layer in layers))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = _cpu_list(batch.seq_lens_cpu, batch.seq_lens)
        if batch.mode == ForwardMode.DECODE:
            batch.attn_metadata = self._plan_decode(batch, seq_lens)
        else:
            batch.attn_metadata = self._plan_extend(batch, seq_lens)

    def _plan_extend(self, batch: ForwardBatch, seq_lens: list[int]) -> TorchAttentionMetadata:
        prefix_lens = _cpu_list(batch.extend_prefix_lens_cpu, batch.extend_prefix_lens)
        table = self.req_to_token_pool.req_to_token
        rows = _cpu_list(batch.req_pool_indices_cpu, batch.req_pool_indices)
        plan = TorchAttentionMetadata(ForwardMode.EXTEND)
        start = 0
        trees = batch.tree_masks or [None] * len(rows)
        for row, prefix, total, tree in zip(rows, prefix_lens, seq_lens, trees):
            end = start + total - prefix
            indices = table[row, :total] if prefix > 0 else None
            plan.extend.append(_ExtendSeq(start, end, prefix, indices, tree=tree))
            start = end
        kernels = cpu.load() if self.device.type == "cpu" else None
        tree_bits = _tree_bits(plan.extend, start) if batch.tree_masks is not None else None
        if batch.tree_masks is not None and tree_bits is None:
            kernels = None  # a tree of more than 32 tokens: the torch path
        if kernels is not None and table.dtype == torch.int64 and table.stride(1) == 1:
            seqs = plan.extend
            # the leading decode rows (generated tokens, each row i of q) go to the decode
            # kernel; prompt tokens, a lone last one after a cache hit too, to the extend kernel
            d = 0
            limit = batch.decode_seqs or 0
            if tree_bits is None:
                while (d < min(limit, len(seqs)) and seqs[d].q_start == d
                       and seqs[d].q_end == d + 1 and seqs[d].prefix_len > 0):
                    d += 1
            decodes = None
            if d:
                decodes = _NativeDecode(kernels, torch.tensor(rows[:d], dtype=torch.int64),
                                        torch.tensor(seq_lens[:d], dtype=torch.int64),
                                        batch.out_cache_loc[:d].contiguous(), table)
            rest = seqs[d:]
            plan.native_extend = _NativeExtend(
                kernels, torch.tensor(rows[d:], dtype=torch.int64),
                torch.tensor([seq.q_start for seq in rest], dtype=torch.int64),
                torch.tensor(prefix_lens[d:], dtype=torch.int64),
                torch.tensor([seq.q_end - seq.q_start for seq in rest], dtype=torch.int64),
                table, tree_bits, decodes)
        return plan

    def _plan_decode(self, batch: ForwardBatch, seq_lens: list[int]) -> TorchAttentionMetadata:
        plan = TorchAttentionMetadata(ForwardMode.DECODE)
        kernels = cpu.load() if self.device.type == "cpu" else None
        if kernels is not None:
            table = self.req_to_token_pool.req_to_token
            plan.native = _NativeDecode(
                kernels, batch.req_pool_indices.contiguous(),
                batch.seq_lens.contiguous(), batch.out_cache_loc.contiguous(), table)
            plan.batch = batch  # the chunks are planned only if a layer cannot use the kernel
            return plan
        self._plan_decode_chunks(plan, batch, seq_lens)
        return plan

    def _plan_decode_chunks(self, plan: TorchAttentionMetadata, batch: ForwardBatch,
                            seq_lens: list[int]) -> None:
        table = self.req_to_token_pool.req_to_token
        start = 0
        while start < len(seq_lens):
            end, longest = start + 1, seq_lens[start]
            while end < len(seq_lens):
                longer = max(longest, seq_lens[end])
                if longer * (end + 1 - start) > DECODE_CHUNK_TOKENS:
                    break
                end, longest = end + 1, longer
            rows = batch.req_pool_indices[start:end]
            indices = table.index_select(0, rows)[:, :longest].reshape(-1)
            lens = batch.seq_lens[start:end]
            padded = any(n != longest for n in seq_lens[start:end])
            plan.decode.append(_DecodeChunk(start, end, longest, indices, lens, padded))
            start = end

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        tokens, head_dim = q.shape[0], layer.head_dim
        plan = batch.attn_metadata
        if not isinstance(plan, TorchAttentionMetadata):
            raise RuntimeError("init_forward_metadata(batch) must run before the first layer")
        if plan.native is not None:
            out = self._decode_native(q, k, v, layer, plan.native)
            if out is not None:
                return out
            if not plan.decode and plan.batch is not None:
                self._plan_decode_chunks(plan, plan.batch,
                                         _cpu_list(plan.batch.seq_lens_cpu, plan.batch.seq_lens))
        k = k.view(tokens, layer.num_kv_heads, head_dim)
        v = v.view(tokens, layer.num_kv_heads, -1)
        self.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        q = q.view(tokens, layer.num_heads, head_dim)
        if plan.mode == ForwardMode.DECODE and len(plan.decode) == 1:
            return self._decode_chunk(q, layer, plan.decode[0]).reshape(tokens, -1)
        out = q.new_empty(tokens, layer.num_heads, v.shape[-1])
        if plan.mode == ForwardMode.DECODE:
            for chunk in plan.decode:
                out[chunk.start:chunk.end] = self._decode_chunk(q, layer, chunk)
        else:
            native = self._extend_native(q, k, v, layer, plan.native_extend)
            if native is not None:
                return native
            self._extend(q, k, v, out, layer, plan)
        return out.view(tokens, -1)

    def _extend_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerSpec,
                       native: _NativeExtend | None) -> torch.Tensor | None:
        """All sequences' extend attention in one call of sgl's CPU kernel, from the pool (the
        new K/V are in it already), and the leading one-token sequences in one call of the
        decode kernel; None when this layer's tensors do not fit them."""
        if native is None or not native.kernels.extend_attention_faster(q.dtype):
            return None
        if native.tree_bits is not None and layer.sliding_window:
            return None  # the torch path says that trees and windows do not mix
        k_pool = self.kv_pool.k_buffer[layer.layer_id]
        v_pool = self.kv_pool.v_buffer[layer.layer_id]
        q2 = q.view(q.shape[0], -1)
        if (q2.dtype not in cpu.DTYPES or k_pool.dtype != q2.dtype or v_pool.dtype != q2.dtype
                or q2.stride(1) != 1 or not (k_pool.is_contiguous() and v_pool.is_contiguous())
                or layer.num_heads // layer.num_kv_heads > 64
                or not native.kernels.decode_attention_fits(layer.num_heads, layer.num_kv_heads,
                                                            layer.head_dim, v_pool.shape[-1])):
            return None
        decoded = None
        if native.decodes is not None:
            d = native.decodes.rows.shape[0]
            decoded = self._decode_native(q2[:d], k.reshape(q2.shape[0], -1)[:d],
                                          v.reshape(q2.shape[0], -1)[:d], layer, native.decodes)
            if decoded is None:
                return None
        out = torch.ops.sgl.extend_attention(
            q2, k_pool, v_pool, native.table, native.rows, native.q_starts, native.prefix_lens,
            native.extend_lens, layer.num_heads, layer.num_kv_heads, layer.head_dim,
            layer.scaling, layer.logit_softcap or 0.0, layer.sliding_window or 0,
            native.tree_bits)
        if decoded is not None:
            out[:decoded.shape[0]] = decoded
        return out

    def _decode_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerSpec, native: _NativeDecode) -> torch.Tensor | None:
        """Write the new K/V and attend in one call of sgl's CPU kernel; None when this layer's
        tensors do not fit it (then the torch path runs)."""
        k_pool = self.kv_pool.k_buffer[layer.layer_id]
        v_pool = self.kv_pool.v_buffer[layer.layer_id]
        dtype = q.dtype
        head_dim, v_dim = layer.head_dim, v_pool.shape[-1]
        kv_width = layer.num_kv_heads * head_dim
        if (dtype not in cpu.DTYPES or k.dtype != dtype or v.dtype != dtype
                or k_pool.dtype != dtype or v_pool.dtype != dtype
                or q.dim() != 2 or k.dim() != 2 or v.dim() != 2
                or q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1
                or k.shape[1] != kv_width or v.shape[1] != layer.num_kv_heads * v_dim
                or not (k_pool.is_contiguous() and v_pool.is_contiguous())
                or not native.kernels.decode_attention_fits(layer.num_heads, layer.num_kv_heads,
                                                            head_dim, v_dim)):
            return None
        return torch.ops.sgl.decode_attention(
            q, k, v, k_pool, v_pool, native.table, native.rows, native.lens, native.loc,
            layer.num_heads, layer.num_kv_heads, head_dim, layer.scaling,
            layer.logit_softcap or 0.0, layer.sliding_window or 0)

    def graph_inputs(self, batch: ForwardBatch) -> list[torch.Tensor] | None:
        """A decode batch on sgl's CPU kernel: its rows, lengths and new slots."""
        plan = batch.attn_metadata
        if not isinstance(plan, TorchAttentionMetadata) or plan.native is None:
            return None
        return [plan.native.rows, plan.native.lens, plan.native.loc]

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                layer: AttentionLayerSpec, plan: TorchAttentionMetadata) -> None:
        k_pool = self.kv_pool.k_buffer[layer.layer_id]
        v_pool = self.kv_pool.v_buffer[layer.layer_id]
        window = layer.sliding_window
        for seq in plan.extend:
            if seq.q_end == seq.q_start:
                continue
            if seq.kv_indices is None:
                keys, values = k[seq.q_start:seq.q_end], v[seq.q_start:seq.q_end]
            else:
                keys = k_pool.index_select(0, seq.kv_indices)
                values = v_pool.index_select(0, seq.kv_indices)
            if window not in seq.masks:
                seq.masks[window] = extend_mask(seq.prefix_len, seq.q_end - seq.q_start, window,
                                                q.device, tree=seq.tree)
            mask = seq.masks[window]
            result = attend(
                q[seq.q_start:seq.q_end].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                mask=mask, causal=mask is None, scale=layer.scaling, softcap=layer.logit_softcap,
            )
            out[seq.q_start:seq.q_end] = result[0].transpose(0, 1)

    def _decode_chunk(self, q: torch.Tensor, layer: AttentionLayerSpec,
                      chunk: _DecodeChunk) -> torch.Tensor:
        """Attention of the chunk's rows of ``q [tokens, Hq, D]``: ``[rows, Hq, D]``."""
        k_pool = self.kv_pool.k_buffer[layer.layer_id]
        v_pool = self.kv_pool.v_buffer[layer.layer_id]
        kv_heads = layer.num_kv_heads
        n = chunk.end - chunk.start
        keys = k_pool.index_select(0, chunk.kv_indices).view(n, chunk.max_len, kv_heads, -1)
        values = v_pool.index_select(0, chunk.kv_indices).view(n, chunk.max_len, kv_heads, -1)
        window = layer.sliding_window
        if window not in chunk.masks:
            chunk.masks[window] = decode_mask(chunk.seq_lens, chunk.max_len, window,
                                               padded=chunk.padded)
        # the query heads sharing a KV head act as that head's query rows: no KV repeat
        queries = q[chunk.start:chunk.end].view(n, kv_heads, layer.num_heads // kv_heads, -1)
        result = attend(queries, keys.transpose(1, 2), values.transpose(1, 2),
                        mask=chunk.masks[window], causal=False, scale=layer.scaling,
                        softcap=layer.logit_softcap)
        return result.reshape(n, layer.num_heads, -1)
