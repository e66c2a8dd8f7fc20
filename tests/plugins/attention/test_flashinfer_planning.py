"""The ``flashinfer`` attention backend on CPU, where flashinfer itself cannot run.

- The plan arguments of real ForwardBatches (ragged extend with and without a cached prefix,
  decode, token trees) against what the test recorded independently: the slots each token got
  and each tree's parents.
- Attention computed from those arguments exactly as flashinfer documents them (``reference``:
  pages from ``indptr``/``indices``/``last_page_len``, the flat ``custom_mask``, ``causal``,
  ``window_left``, ``logits_soft_cap``, ``sm_scale``) equals the torch backend's; an off-by-one
  in the arguments makes it differ.
- The backend's own ``forward`` through a stand-in ``flashinfer`` module whose wrappers take the
  arguments of flashinfer 0.6.18's ``plan``/``run`` (a misspelt keyword is a TypeError) and
  compute ``reference``.
- The plugin is listed unavailable here, with what to do.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import sgl_attn_flashinfer.backend as fi_backend
from sgl.attention import AttentionLayerSpec
from sgl.config import ConfigError, load_settings
from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.forward_batch import ForwardBatch, ForwardMode
from sgl.kvcache import KVPool, ReqToTokenPool
from sgl.plugins import create_plugin_manager
from sgl_attn_flashinfer import planning
from sgl_attn_flashinfer.backend import FlashInferAttentionBackend
from sgl_attn_flashinfer.plugin import unavailable
from sgl_attn_torch.backend import TorchAttentionBackend
from sgl_testing import run_cli

HEAD_DIM = 8
CPU = torch.device("cpu")


# --- flashinfer's semantics, written from its docs (and include/.../variants.cuh) ---------------

def reference(q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *,
              qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              kv_last_page_len: torch.Tensor, page_size: int,
              custom_mask: torch.Tensor | None, causal: bool, window_left: int,
              logits_soft_cap: float, sm_scale: float) -> torch.Tensor:
    """Paged attention of ``q [nnz_qo, Hq, D]`` over an NHD cache ``[pages, page_size, Hk, D]``,
    in float64. Sequence b owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, the last
    holding ``kv_last_page_len[b]`` entries; its query row i (of qo_len) keeps key j where its
    ``[qo_len, kv_len]`` block of the flat ``custom_mask`` says so, else (causal) where
    ``j <= kv_len - qo_len + i``; with ``window_left >= 0`` also only where
    ``j + qo_len + window_left >= kv_len + i``. Logits are ``x * sm_scale``, soft-capped as
    ``cap * tanh(x / cap)`` when ``cap > 0``."""
    k_cache, v_cache = paged_kv_cache
    heads = q.shape[1]
    out = torch.empty(q.shape[0], heads, v_cache.shape[-1], dtype=torch.float64)
    mask_offset = 0
    for b in range(len(kv_last_page_len)):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        kv_len = (len(pages) - 1) * page_size + int(kv_last_page_len[b])
        keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].double()
        values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].double()
        qo_len = q1 - q0
        i = torch.arange(qo_len).unsqueeze(1)
        j = torch.arange(kv_len).unsqueeze(0)
        if custom_mask is not None:
            keep = custom_mask[mask_offset:mask_offset + qo_len * kv_len].view(qo_len, kv_len)
            keep = keep.to(CPU, torch.bool)
            mask_offset += qo_len * kv_len
        elif causal:
            keep = j <= kv_len - qo_len + i
        else:
            keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if window_left >= 0:
            keep = keep & (j + qo_len + window_left >= kv_len + i)
        group = heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), keys) * sm_scale
        if logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~keep, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


class _FakeWrapper:
    """What both stand-in wrappers share: argument checks flashinfer makes, then ``reference``."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.plans: list[dict[str, Any]] = []

    def _plan(self, plan: dict[str, Any]) -> None:
        for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr"):
            assert plan[name].dtype == torch.int32, name
        assert len(plan["kv_indices"]) >= int(plan["kv_indptr"][-1])  # == outside graphs
        assert len(plan["kv_indptr"]) == len(plan["qo_indptr"]) == len(plan["kv_last_page_len"]) + 1
        assert all(1 <= n <= plan["page_size"] for n in plan["kv_last_page_len"].tolist())
        assert plan["num_qo_heads"] % plan["num_kv_heads"] == 0
        self.plans.append(plan)

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *args: Any,
            k_scale: float | None = None, v_scale: float | None = None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None,
            window_left: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = self.plans[-1]  # run() before plan() fails here, as in flashinfer
        k_cache, v_cache = paged_kv_cache
        assert k_cache.dim() == 4 and k_cache.shape[1] == plan["page_size"]
        assert k_cache.shape[2:] == (plan["num_kv_heads"], plan["head_dim"])
        assert q.shape == (int(plan["qo_indptr"][-1]), plan["num_qo_heads"], plan["head_dim"])
        assert q.dtype == plan["q_data_type"] and k_cache.dtype == plan["kv_data_type"]
        args = {k: plan[k] for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                                     "page_size", "custom_mask", "causal", "window_left",
                                     "logits_soft_cap", "sm_scale")}
        return reference(q, paged_kv_cache, **args).to(q.dtype)


class FakeDecodeWrapper(_FakeWrapper):
    """``BatchDecodeWithPagedKVCacheWrapper`` of flashinfer 0.6.18: same arguments."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto", jit_args: list[Any] | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_tensor_cores = use_tensor_cores
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:  # flashinfer's checks, and its fixed buffers
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                            paged_kv_last_page_len_buffer)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
             pos_encoding_mode: str = "NONE", window_left: int = -1, window_right: int = 0,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, o_data_type: Any = None, data_type: Any = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, non_blocking: bool = True,
             block_tables: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False,
             q_len_per_req: int = 1) -> None:
        assert pos_encoding_mode == "NONE" and q_len_per_req == 1
        if self.use_cuda_graph:  # copied into the fixed buffers, which run() reads, as flashinfer
            fixed_indptr, fixed_indices, fixed_last = self.buffers
            assert len(last_page_len) == len(fixed_last) and len(indices) <= len(fixed_indices)
            fixed_indptr.copy_(indptr)
            fixed_last.copy_(last_page_len)
            fixed_indices[:len(indices)].copy_(indices)
            indptr, indices, last_page_len = fixed_indptr, fixed_indices, fixed_last
        self._plan(dict(
            qo_indptr=torch.arange(len(last_page_len) + 1, dtype=torch.int32), kv_indptr=indptr,
            kv_indices=indices, kv_last_page_len=last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
            custom_mask=None, causal=False, window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0, q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
            sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale))


class FakePrefillWrapper(_FakeWrapper):
    """``BatchPrefillWithPagedKVCacheWrapper`` of flashinfer 0.6.18: same arguments."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto",
                 jit_args: list[Any] | None = None,
                 jit_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1,
             logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, o_data_type: Any = None,
             non_blocking: bool = True, **later_arguments: Any) -> None:
        assert pos_encoding_mode == "NONE" and packed_custom_mask is None
        assert not later_arguments, later_arguments  # sgl passes none of 0.3's additions
        if custom_mask is not None:
            kv_lens = paged_kv_indptr.diff()  # pages of one token
            assert custom_mask.dtype == torch.bool
            assert custom_mask.numel() == int((qo_indptr.diff() * kv_lens).sum())
        self._plan(dict(
            qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, kv_indices=paged_kv_indices,
            kv_last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim_qk, page_size=page_size,
            custom_mask=custom_mask, causal=causal, window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0, q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
            sm_scale=head_dim_qk ** -0.5 if sm_scale is None else sm_scale))


def fake_flashinfer() -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper  # type: ignore[attr-defined]
    return module


def planned_attention(q: torch.Tensor, spec: AttentionLayerSpec, batch: ForwardBatch,
                      plan: planning.PagedKVPlan) -> torch.Tensor:
    """``q``'s attention through the stand-in wrapper planned with the plan's arguments."""
    kind = planning.layer_kind(spec)
    pool = batch.kv_pool
    if plan.mode == ForwardMode.DECODE:
        wrapper: _FakeWrapper = FakeDecodeWrapper(torch.empty(8, dtype=torch.uint8), "NHD")
        args, kwargs = planning.decode_plan_args(plan, kind, q.dtype, pool.dtype)
    else:
        wrapper = FakePrefillWrapper(torch.empty(8, dtype=torch.uint8), "NHD")
        args, kwargs = planning.prefill_plan_args(plan, kind, q.dtype, pool.dtype)
    wrapper.plan(*args, **kwargs)
    cache = planning.paged_kv_cache(pool.k_buffer[spec.layer_id], pool.v_buffer[spec.layer_id])
    return wrapper.run(q.view(q.shape[0], spec.num_heads, spec.head_dim), cache)


# --- batches ------------------------------------------------------------------------------------

class Harness:
    """Pools, the torch backend, and the slots every sequence got, recorded from each batch's
    ``out_cache_loc`` (not read back from ``req_to_token``)."""

    def __init__(self, lengths: int, *, layers: int = 1, kv_heads: int = 2,
                 dtype: torch.dtype = torch.float32, device: torch.device = CPU,
                 head_dim: int = HEAD_DIM) -> None:
        self.device = device
        self.kv_pool = KVPool(size=512, num_layers=layers, num_kv_heads=kv_heads,
                              head_dim=head_dim, dtype=dtype, device=device)
        self.req_pool = ReqToTokenPool(max_requests=8, max_context_len=128, device=device)
        self.torch_backend = TorchAttentionBackend(kv_pool=self.kv_pool,
                                                   req_to_token_pool=self.req_pool, device=device)
        self.runner = SimpleNamespace(device=device, kv_pool=self.kv_pool,
                                      req_to_token_pool=self.req_pool,
                                      attn_backend=self.torch_backend)
        self.rows = [self.req_pool.alloc() for _ in range(lengths)]
        self.slots: list[list[int]] = [[] for _ in range(lengths)]
        # free a few slots out of order so that sequences' slots are not consecutive
        self.kv_pool.free(self.kv_pool.alloc(40)[torch.randperm(40)])

    def batch(self, mode: ForwardMode, new: list[int],
              parents: dict[int, list[int]] | None = None) -> tuple[ForwardBatch, list[int]]:
        index = [i for i, n in enumerate(new) if n]
        seqs = [BatchSeq(self.rows[i], len(self.slots[i]), [1] * new[i],
                         tree_parents=(parents or {}).get(i)) for i in index]
        batch = make_forward_batch(self.runner, mode, seqs)
        start = 0
        for i in index:
            self.slots[i] += batch.out_cache_loc[start:start + new[i]].tolist()
            start += new[i]
        return batch, index


#: a tree of 6 new tokens (0 the root, 1 and 2 its children, ...) and a forest of two roots
TREE = [-1, 0, 0, 1, 1, 2]
FOREST = [-1, 0, -1, 2, 3]

#: (mode, new tokens per sequence, trees by sequence): fresh ragged extend with one sequence not
#: started, extend on cached prefixes beside a fresh one, decode, trees on a prefix beside a
#: chain and a fresh forest
STEPS: list[tuple[ForwardMode, list[int], dict[int, list[int]] | None]] = [
    (ForwardMode.EXTEND, [5, 13, 1, 0], None),
    (ForwardMode.EXTEND, [3, 4, 2, 7], None),
    (ForwardMode.DECODE, [1, 1, 1, 1], None),
    (ForwardMode.DECODE, [1, 1, 1, 1], None),
]
TREE_STEPS = STEPS[:2] + [(ForwardMode.EXTEND, [6, 3, 0, 0], {0: TREE}),
                          (ForwardMode.EXTEND, [0, 0, 5, 0], {2: FOREST})]


def ancestors_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        node = i
        while node != -1:
            mask[i, node] = True
            node = parents[node]
    return mask


def test_index_arrays_are_each_sequences_slots() -> None:
    torch.manual_seed(0)
    harness = Harness(4)
    seen_modes = set()
    for mode, new, parents in TREE_STEPS + STEPS[2:]:
        prefix = [len(s) for s in harness.slots]
        batch, index = harness.batch(mode, new, parents)
        plan = planning.plan_paged_kv(batch, harness.req_pool.req_to_token)
        lens = [len(harness.slots[i]) for i in index]
        expected_indptr = [sum(lens[:b]) for b in range(len(lens) + 1)]
        assert plan.kv_indptr.tolist() == expected_indptr
        assert plan.kv_indices.tolist() == [s for i in index for s in harness.slots[i]]
        assert plan.qo_indptr.tolist() == [sum(new[i] for i in index[:b])
                                           for b in range(len(index) + 1)]
        assert plan.kv_last_page_len.tolist() == [1] * len(index)
        assert {t.dtype for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                  plan.kv_last_page_len)} == {torch.int32}
        assert plan.mode == mode and plan.page_size == 1
        if parents is None:
            assert plan.custom_mask is None and plan.causal
        else:
            blocks = []
            for i in index:
                n, p = new[i], prefix[i]
                seen = (ancestors_mask(parents[i]) if i in parents else
                        torch.ones(n, n, dtype=torch.bool).tril())
                blocks.append(torch.cat([torch.ones(n, p, dtype=torch.bool), seen], 1).flatten())
            assert torch.equal(plan.custom_mask, torch.cat(blocks))
            assert not plan.causal
        seen_modes.add((mode, parents is None))
    assert len(seen_modes) == 3  # extend, decode, trees


def test_layer_arguments() -> None:
    spec = AttentionLayerSpec(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=64,
                              scaling=0.125, sliding_window=4096, logit_softcap=50.0)
    assert planning.layer_kind(spec) == planning.LayerKind(8, 2, 64, 4095, 50.0, 0.125)
    assert planning.window_left(None) == -1 and planning.window_left(1) == 0
    with pytest.raises(ValueError, match="at least 1"):
        planning.window_left(0)
    plain = planning.layer_kind(AttentionLayerSpec(0, 4, 4, 64, 0.125))
    assert (plain.window_left, plain.logits_soft_cap) == (-1, 0.0)
    pool = torch.zeros(10, 2, 64)
    k_cache, v_cache = planning.paged_kv_cache(pool, pool + 1)
    assert k_cache.shape == (10, 1, 2, 64) and k_cache.data_ptr() == pool.data_ptr()
    assert v_cache.shape == (10, 1, 2, 64)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (4, 3.0)],
                         ids=["full", "window", "softcap", "window+softcap"])
def test_plan_arguments_give_the_torch_backends_attention(heads: tuple[int, int],
                                                          window: int | None,
                                                          softcap: float | None) -> None:
    """Every batch of the steps (trees where there is no window: the torch backend refuses a
    window with trees, and so does ``prefill_plan_args``)."""
    torch.manual_seed(1)
    spec = AttentionLayerSpec(layer_id=0, num_heads=heads[0], num_kv_heads=heads[1],
                              head_dim=HEAD_DIM, scaling=0.3, sliding_window=window,
                              logit_softcap=softcap)
    harness = Harness(4, kv_heads=heads[1])
    for mode, new, parents in (STEPS if window else TREE_STEPS + STEPS[2:]):
        batch, _ = harness.batch(mode, new, parents)
        tokens = batch.num_tokens
        q = torch.randn(tokens, heads[0] * HEAD_DIM)
        k, v = torch.randn(2, tokens, heads[1] * HEAD_DIM)
        harness.torch_backend.init_forward_metadata(batch)
        expected = harness.torch_backend.forward(q, k, v, spec, batch)  # writes k/v to the pool
        plan = planning.plan_paged_kv(batch, harness.req_pool.req_to_token)
        got = planned_attention(q, spec, batch, plan).reshape(tokens, -1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _shift_boundaries(plan: planning.PagedKVPlan) -> planning.PagedKVPlan:
    indptr = plan.kv_indptr.clone()
    indptr[1:-1] += 1  # each sequence's first key handed to the one before it
    return planning.PagedKVPlan(plan.mode, plan.qo_indptr, indptr, plan.kv_indices,
                                plan.kv_last_page_len, plan.custom_mask)


def _drop_last_key(plan: planning.PagedKVPlan) -> planning.PagedKVPlan:
    lens = plan.kv_indptr.diff() - 1  # indptr built from seq_len - 1: the new token missing
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    keep = torch.cat([plan.kv_indices[int(a):int(b) - 1] for a, b in
                      zip(plan.kv_indptr[:-1], plan.kv_indptr[1:])])
    return planning.PagedKVPlan(plan.mode, plan.qo_indptr, indptr, keep,
                                plan.kv_last_page_len, plan.custom_mask)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("mistake", ["shifted indptr", "indptr without the new token",
                                     "window_left = sliding_window"])
def test_an_off_by_one_in_the_plan_is_caught(mode: ForwardMode, mistake: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above is sharp enough to see an off-by-one in the arguments."""
    torch.manual_seed(2)
    spec = AttentionLayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
                              scaling=0.3, sliding_window=6)
    harness = Harness(3)
    harness.batch(ForwardMode.EXTEND, [9, 4, 12])
    batch, _ = harness.batch(mode, [3, 2, 5] if mode == ForwardMode.EXTEND else [1, 1, 1])
    tokens = batch.num_tokens
    q, k, v = torch.randn(3, tokens, 4 * HEAD_DIM).split([1, 1, 1])
    q, k, v = q[0], k[0][:, :2 * HEAD_DIM], v[0][:, :2 * HEAD_DIM]
    pool = harness.kv_pool
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    harness.torch_backend.init_forward_metadata(batch)
    expected = harness.torch_backend.forward(q, k, v, spec, batch)
    plan = planning.plan_paged_kv(batch, harness.req_pool.req_to_token)
    right = planned_attention(q, spec, batch, plan).reshape(tokens, -1)
    torch.testing.assert_close(right, expected, rtol=1e-4, atol=1e-5)
    if mistake == "shifted indptr":
        plan = _shift_boundaries(plan)
    elif mistake == "indptr without the new token":
        plan = _drop_last_key(plan)
    else:
        monkeypatch.setattr(planning, "window_left", lambda window: window)
    wrong = planned_attention(q, spec, batch, plan).reshape(tokens, -1)
    assert (wrong - expected).abs().max() > 0.05


def test_trees_with_a_sliding_window_are_refused() -> None:
    harness = Harness(1)
    batch, _ = harness.batch(ForwardMode.EXTEND, [4], {0: [-1, 0, 0, 1]})
    plan = planning.plan_paged_kv(batch, harness.req_pool.req_to_token)
    spec = AttentionLayerSpec(0, 2, 2, HEAD_DIM, 1.0, sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        planning.prefill_plan_args(plan, planning.layer_kind(spec), torch.bfloat16,
                                   torch.bfloat16)


# --- the backend, through the stand-in flashinfer -------------------------------------------------

@pytest.fixture
def stand_in_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer replaced by the stand-in, CPU devices let through, a small workspace."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setattr(FlashInferAttentionBackend, "_require_cuda", staticmethod(lambda d: None))
    monkeypatch.setattr(fi_backend, "WORKSPACE_BYTES", 256)


LAYERS = {
    # Gemma-2-like: local (windowed) and global layers, soft-capped; no trees with windows
    "local+global": [dict(sliding_window=5, logit_softcap=3.0), dict(logit_softcap=3.0),
                     dict(sliding_window=5, logit_softcap=3.0)],
    "plain+softcap, trees": [dict(), dict(logit_softcap=3.0), dict()],
}


def compare_backends(layers: str, device: torch.device, head_dim: int) -> dict[Any, Any]:
    """Every step through the flashinfer backend and the torch backend on one pool (both write
    the same K/V), three layers of two kinds, bfloat16; returns the backend's wrappers."""
    torch.manual_seed(3)
    specs = [AttentionLayerSpec(layer_id=i, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                                scaling=0.3, **extra) for i, extra in enumerate(LAYERS[layers])]
    harness = Harness(4, layers=3, dtype=torch.bfloat16, device=device, head_dim=head_dim)
    backend = FlashInferAttentionBackend(kv_pool=harness.kv_pool,
                                         req_to_token_pool=harness.req_pool, device=device)
    steps = TREE_STEPS + STEPS[2:] if "trees" in layers else STEPS
    for mode, new, parents in steps:
        batch, _ = harness.batch(mode, new, parents)
        tokens = batch.num_tokens
        harness.torch_backend.init_forward_metadata(batch)
        torch_meta = batch.attn_metadata
        backend.init_forward_metadata(batch)
        meta = batch.attn_metadata
        for spec in specs:
            q = torch.randn(tokens, 8 * head_dim, device=device).bfloat16()
            k, v = torch.randn(2, tokens, 2 * head_dim, device=device).bfloat16()
            batch.attn_metadata = torch_meta
            expected = harness.torch_backend.forward(q, k, v, spec, batch)
            batch.attn_metadata = meta
            got = backend.forward(q, k, v, spec, batch)
            assert got.shape == expected.shape and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)
        assert len(meta.planned) == 2  # two kinds, each planned once for the three layers
        wrapper_class = ("BatchDecodeWithPagedKVCacheWrapper" if mode == ForwardMode.DECODE else
                         "BatchPrefillWithPagedKVCacheWrapper")
        assert {type(w) for w in meta.planned.values()} == {getattr(backend.flashinfer,
                                                                    wrapper_class)}
    return backend._wrappers


@pytest.mark.usefixtures("stand_in_flashinfer")
@pytest.mark.parametrize("layers", list(LAYERS))
def test_backend_forward_equals_the_torch_backend(layers: str) -> None:
    """The backend's own forward, its planning per layer kind and its wrappers, with the
    stand-in computing ``reference`` (bfloat16: flashinfer's kernels take no float32)."""
    wrappers = compare_backends(layers, CPU, HEAD_DIM)
    decode = [w for w in wrappers.values() if isinstance(w, FakeDecodeWrapper)]
    assert len(decode) == 2 and all(w.use_tensor_cores for w in decode)  # 4 heads per KV head
    # wrappers are kept across batches and planned again for each
    steps = TREE_STEPS + STEPS[2:] if "trees" in layers else STEPS
    assert sum(len(w.plans) for w in decode) == 2 * sum(m == ForwardMode.DECODE
                                                        for m, _, _ in steps)


@pytest.mark.usefixtures("stand_in_flashinfer")
@pytest.mark.parametrize("replan", [True, False], ids=["graph_inputs", "without graph_inputs"])
def test_decode_replayed_from_a_capture(replan: bool) -> None:
    """sgl's CUDA graph runner, emulated: at capture, ``init_forward_metadata`` then
    ``graph_inputs`` then warm-up forwards, then the captured forwards; before each replay,
    ``init_forward_metadata`` and ``graph_inputs`` of the new batch, its tensors copied into the
    captured batch's, and the captured forwards run again over the captured batch, its metadata
    and fixed tensors (a real replay runs their kernels on the same addresses). Without
    ``graph_inputs`` re-planning, the graph reads the capture's indices: wrong."""
    torch.manual_seed(4)
    specs = [AttentionLayerSpec(layer_id=i, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
                                scaling=0.3, **extra)
             for i, extra in enumerate(LAYERS["local+global"])]
    harness = Harness(3, layers=3, dtype=torch.bfloat16)
    backend = FlashInferAttentionBackend(kv_pool=harness.kv_pool,
                                         req_to_token_pool=harness.req_pool, device=CPU)
    harness.batch(ForwardMode.EXTEND, [7, 2, 11])
    captured, _ = harness.batch(ForwardMode.DECODE, [1, 1, 1])
    backend.init_forward_metadata(captured)
    assert backend.graph_inputs(captured) == []  # no kind known yet
    static = torch.zeros(3, 3, 4 * HEAD_DIM, dtype=torch.bfloat16)  # q, k and v of the graph

    def graph() -> list[torch.Tensor]:
        q, k, v = static[0], static[1, :, :2 * HEAD_DIM], static[2, :, :2 * HEAD_DIM]
        return [backend.forward(q, k, v, spec, captured) for spec in specs]

    graph()  # warm-up: plans each kind into the graph wrappers of 3 rows
    planned = captured.attn_metadata.planned
    assert len(planned) == 2 and all(w.use_cuda_graph for w in planned.values())
    graph()  # the capture
    for _ in range(3):
        batch, _ = harness.batch(ForwardMode.DECODE, [1, 1, 1])
        backend.init_forward_metadata(batch)
        if replan:
            assert backend.graph_inputs(batch) == []
            assert list(batch.attn_metadata.planned.values()) == list(planned.values())
        for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(captured, name).copy_(getattr(batch, name))
        static.normal_()
        harness.torch_backend.init_forward_metadata(batch)
        expected = [harness.torch_backend.forward(static[0], static[1, :, :2 * HEAD_DIM],
                                                  static[2, :, :2 * HEAD_DIM], spec, batch)
                    for spec in specs]
        got = graph()
        for out, want in zip(got, expected):
            if replan:
                torch.testing.assert_close(out.float(), want.float(), rtol=0.02, atol=0.02)
        if not replan:
            assert max((a.float() - b.float()).abs().max() for a, b in zip(got, expected)) > 0.05
    graph_wrappers = [w for key, w in backend._wrappers.items() if key[2] is not None]
    assert len(graph_wrappers) == 2  # one per kind for 3 rows, planned again per replay
    assert all(len(w.plans) == (4 if replan else 1) for w in graph_wrappers)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None
                    or not torch.cuda.is_available(), reason="needs flashinfer and a CUDA device")
@pytest.mark.parametrize("layers", list(LAYERS))
def test_flashinfer_on_cuda_equals_the_torch_backend(layers: str) -> None:
    """The real kernels (head_dim 64, which every flashinfer build has) against the torch
    backend on the GPU."""
    compare_backends(layers, torch.device("cuda"), 64)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None
                    or not torch.cuda.is_available(), reason="needs flashinfer and a CUDA device")
def test_flashinfer_decode_in_cuda_graphs_on_cuda() -> None:
    """sgl's CUDA graph runner over the real kernels: replayed decode steps (3 rows in the
    graph of 4, one padding row) equal the torch backend's eager ones."""
    from sgl.engine.cuda_graph import CudaGraphRunner

    torch.manual_seed(5)
    cuda, dim = torch.device("cuda"), 64
    specs = [AttentionLayerSpec(layer_id=i, num_heads=8, num_kv_heads=2, head_dim=dim,
                                scaling=dim ** -0.5, **extra)
             for i, extra in enumerate(LAYERS["local+global"])]
    harness = Harness(4, layers=3, dtype=torch.bfloat16, device=cuda, head_dim=dim)
    backend = FlashInferAttentionBackend(kv_pool=harness.kv_pool,
                                         req_to_token_pool=harness.req_pool, device=cuda)
    table = torch.randn(64, 12 * dim, device=cuda).bfloat16()

    class Model(torch.nn.Module):
        def forward(self, batch: ForwardBatch) -> torch.Tensor:
            x = table[batch.input_ids % 64]
            q, k, v = x[:, :8 * dim], x[:, 8 * dim:10 * dim], x[:, 10 * dim:]
            return torch.cat([batch.attn_backend.forward(q, k.contiguous(), v.contiguous(),
                                                         spec, batch) for spec in specs], 1)

    runner = CudaGraphRunner(Model(), backend, kv_pool=harness.kv_pool,
                             req_to_token_pool=harness.req_pool, max_bs=4, device=cuda,
                             show_progress=False)
    runner.capture()
    harness.batch(ForwardMode.EXTEND, [9, 30, 2, 0])
    for _ in range(3):
        batch, _ = harness.batch(ForwardMode.DECODE, [1, 1, 1, 0])
        batch.input_ids.copy_(torch.randint(0, 64, (3,), device=cuda))
        got = runner.forward(batch).clone()
        batch.attn_backend = harness.torch_backend
        harness.torch_backend.init_forward_metadata(batch)
        expected = Model()(batch)
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)
    assert runner.replays == 3


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_backend_refuses_float32_and_forward_without_metadata() -> None:
    harness = Harness(1, dtype=torch.float32)
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        FlashInferAttentionBackend(kv_pool=harness.kv_pool, req_to_token_pool=harness.req_pool,
                                   device=CPU)
    harness = Harness(1, dtype=torch.bfloat16)
    backend = FlashInferAttentionBackend(kv_pool=harness.kv_pool,
                                         req_to_token_pool=harness.req_pool, device=CPU)
    assert backend.name == "flashinfer" and backend.supports_tree_mask
    batch, _ = harness.batch(ForwardMode.EXTEND, [2])
    x = torch.zeros(2, 2 * HEAD_DIM, dtype=torch.bfloat16)
    spec = AttentionLayerSpec(0, 2, 2, HEAD_DIM, 1.0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(x, x, x, spec, batch)
    assert backend.graph_inputs(batch) is None  # not planned
    backend.init_forward_metadata(batch)
    assert backend.graph_inputs(batch) is None  # an extend batch: never captured


# --- without flashinfer and without a GPU (this machine) ----------------------------------------

def test_backend_on_cpu_names_the_fix() -> None:
    harness = Harness(1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="NVIDIA GPUs only.*--attention-backend torch"):
        FlashInferAttentionBackend(kv_pool=harness.kv_pool, req_to_token_pool=harness.req_pool,
                                   device=CPU)
    if importlib.util.find_spec("flashinfer") is None:  # this machine
        assert "flashinfer" not in sys.modules  # the backend module imports it lazily
        with pytest.raises(ImportError, match="pip install flashinfer-python"):
            fi_backend.import_flashinfer()
    else:
        assert fi_backend.import_flashinfer().BatchDecodeWithPagedKVCacheWrapper


def test_plugin_is_listed_unavailable_with_the_fix() -> None:
    pm = create_plugin_manager()
    record = pm.records["attn-flashinfer"]
    assert record.distribution == "sgl-attn-flashinfer"
    if unavailable() is None:  # a GPU machine with flashinfer
        assert record.available and record.hooks == ["sgl_register_attention_backends"]
        assert pm.registries.attention.entry("flashinfer").load() is FlashInferAttentionBackend
        return
    assert not record.available and record.hooks == []
    assert "flashinfer is not installed" in record.reason
    assert "pip install flashinfer-python" in record.reason
    assert "NVIDIA GPU" in record.reason and "--attention-backend torch" in record.reason
    assert record.machine_limited  # logged at info level, and no hint for other names
    assert "flashinfer" not in pm.registries.attention
    assert "torch" in pm.registries.attention
    with pytest.raises(ConfigError, match="(?s)no installed plugin provides that attention "
                       "backend.*plugin 'attn-flashinfer' is unavailable: flashinfer is not"):
        pm.check_backends(load_settings(env={}, cli={"attention_backend": "flashinfer"}))
    result = run_cli(["plugins"])
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("attn-flashinfer "))
    assert "(sgl-attn-flashinfer 0.1.0)  UNAVAILABLE: flashinfer is not installed" in line


def test_unavailable_reasons() -> None:
    """Each machine the plugin may be loaded on, with the checks replaced."""
    cpu_torch = unavailable(flashinfer_installed=lambda: False,
                            build=lambda: ("2.13.0+cpu", None))
    assert cpu_torch is not None
    assert "torch 2.13.0+cpu has no CUDA" in cpu_torch
    assert "install a CUDA build of torch" in cpu_torch
    cuda_torch = unavailable(flashinfer_installed=lambda: False,
                             build=lambda: ("2.9.0+cu128", "12.8"))
    assert cuda_torch is not None and "CUDA 12.8" in cuda_torch
    assert "pip install flashinfer-python" in cuda_torch
    no_gpu = unavailable(flashinfer_installed=lambda: True, cuda_available=lambda: False)
    assert no_gpu is not None and "sees no CUDA device" in no_gpu
    assert unavailable(flashinfer_installed=lambda: True, cuda_available=lambda: True) is None
