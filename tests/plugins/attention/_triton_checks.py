"""The checks of the ``triton`` attention backend that run its kernels, against a float64
reference or the torch backend. On the CPU they run in a child process that imported triton with
``TRITON_INTERPRET=1`` (see test_triton_attention.py); on a GPU (``device="cuda"``) in the test's
own process. Every function raises on a failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton.language as tl

from sgl.attention import AttentionLayerSpec
from sgl.forward_batch import ForwardBatch, ForwardMode
from sgl.kvcache import KVPool, ReqToTokenPool
from sgl_attn_triton import kernels
from sgl_attn_triton.backend import TritonAttentionBackend

TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (2e-2, 2e-2)}  # (rtol, atol) against float64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
              spec: AttentionLayerSpec) -> torch.Tensor:
    """Attention of ``q [n, H*D]`` over ``k``/``v`` ``[L, Hk*D]`` where ``visible [n, L]``, in
    float64."""
    group = spec.num_heads // spec.num_kv_heads
    q = q.view(q.shape[0], spec.num_heads, spec.head_dim).double()
    k = k.view(-1, spec.num_kv_heads, spec.head_dim).double().repeat_interleave(group, dim=1)
    v = v.view(-1, spec.num_kv_heads, spec.head_dim).double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scaling
    if spec.logit_softcap is not None:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def causal(prefix: int, new: int, window: int | None) -> torch.Tensor:
    q_pos = torch.arange(prefix, prefix + new).unsqueeze(1)
    k_pos = torch.arange(prefix + new).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    return visible


class Harness:
    """Pools with hand-placed KV slots, the backend, and each sequence's full q/k/v, fed in
    piece by piece and checked against :func:`reference` (on the CPU) after every forward.
    Everything lives on ``device``: the CPU under the interpreter, or a GPU."""

    def __init__(self, spec: AttentionLayerSpec, lengths: list[int], *, dtype: torch.dtype,
                 page: int, splits: int = kernels.DECODE_SPLITS, seed: int = 0,
                 device: str = "cpu") -> None:
        generator = torch.Generator().manual_seed(seed)
        self.device = device = torch.device(device)
        pages = sum(-(-n // page) for n in lengths)
        self.spec, self.dtype = spec, dtype
        self.kv_pool = KVPool(size=(pages + 2) * page, num_layers=spec.layer_id + 1,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                              dtype=dtype, device=device, page_size=page)
        self.req_pool = ReqToTokenPool(max_requests=len(lengths) + 2, max_context_len=64,
                                       device=device)
        self.backend = TritonAttentionBackend(kv_pool=self.kv_pool,
                                              req_to_token_pool=self.req_pool,
                                              device=device, decode_splits=splits)
        # page p holds slots [p * page, (p + 1) * page); page 0 holds the padding slot 0
        order = (torch.randperm(pages, generator=generator) + 1).tolist()
        self.slots = []
        for n in lengths:
            mine, order = order[:-(-n // page)], order[-(-n // page):]
            self.slots.append(torch.tensor([mine[j // page] * page + j % page
                                            for j in range(n)], device=device))
        self.rows = [self.req_pool.alloc() for _ in lengths]
        self.full = [{name: torch.randn(n, heads * spec.head_dim, generator=generator).to(dtype)
                      for name, heads in (("q", spec.num_heads), ("k", spec.num_kv_heads),
                                          ("v", spec.num_kv_heads))} for n in lengths]
        self.done = [0] * len(lengths)

    def batch(self, mode: ForwardMode, new: list[int],
              trees: dict[int, torch.Tensor] | None = None) -> tuple[ForwardBatch, list[int]]:
        index = [i for i, n in enumerate(new) if n]
        for i in index:
            self.req_pool.req_to_token[self.rows[i], self.done[i]:self.done[i] + new[i]] = \
                self.slots[i][self.done[i]:self.done[i] + new[i]]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        prefix = [self.done[i] for i in index]
        lens = [self.done[i] + new[i] for i in index]
        batch = ForwardBatch(
            mode=mode, input_ids=as_tensor([0] * sum(new)),
            positions=as_tensor([j for p, n in zip(prefix, lens) for j in range(p, n)]),
            req_pool_indices=as_tensor([self.rows[i] for i in index]), seq_lens=as_tensor(lens),
            extend_prefix_lens=as_tensor(prefix),
            extend_seq_lens=as_tensor([new[i] for i in index]),
            out_cache_loc=torch.cat([self.slots[i][self.done[i]:lens[j]]
                                     for j, i in enumerate(index)]),
            req_to_token_pool=self.req_pool, kv_pool=self.kv_pool, attn_backend=self.backend,
            seq_lens_cpu=lens, extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=[new[i] for i in index],
            tree_masks=[trees[i].to(self.device) if i in trees else None for i in index]
            if trees else None)
        return batch, index

    def forward(self, batch: ForwardBatch, index: list[int], new: list[int]) -> torch.Tensor:
        parts = {name: torch.cat([self.full[i][name][self.done[i]:self.done[i] + new[i]]
                                  for i in index]).to(self.device) for name in "qkv"}
        self.backend.init_forward_metadata(batch)
        return self.backend.forward(parts["q"], parts["k"], parts["v"], self.spec, batch)

    def check(self, out: torch.Tensor, index: list[int], new: list[int],
              trees: dict[int, torch.Tensor] | None = None) -> None:
        """Compare with the reference and advance the sequences."""
        start = 0
        for i in index:
            prefix, end = self.done[i], self.done[i] + new[i]
            if trees and trees.get(i) is not None:
                visible = torch.cat([torch.ones(new[i], prefix, dtype=torch.bool), trees[i]], 1)
            else:
                visible = causal(prefix, new[i], self.spec.sliding_window)
            expected = reference(self.full[i]["q"][prefix:end], self.full[i]["k"][:end],
                                 self.full[i]["v"][:end], visible, self.spec)
            rtol, atol = TOLERANCE[self.dtype]
            torch.testing.assert_close(out[start:start + new[i]].double().cpu(), expected,
                                       rtol=rtol, atol=atol)
            start += new[i]
            self.done[i] = end

    def step(self, mode: ForwardMode, new: list[int],
             trees: dict[int, torch.Tensor] | None = None) -> None:
        batch, index = self.batch(mode, new, trees)
        out = self.forward(batch, index, new)
        assert out.dtype == self.dtype and out.shape == (sum(new), self.spec.num_heads *
                                                         self.spec.head_dim)
        self.check(out, index, new, trees)


def spec_of(heads: tuple[int, int], window: int | None = None, softcap: float | None = None,
            head_dim: int = 16) -> AttentionLayerSpec:
    return AttentionLayerSpec(layer_id=1, num_heads=heads[0], num_kv_heads=heads[1],
                              head_dim=head_dim, scaling=head_dim ** -0.5,
                              sliding_window=window, logit_softcap=softcap)


def extend_prefix_then_decode(heads: tuple[int, int], dtype: torch.dtype, page: int,
                              window: int | None, softcap: float | None, head_dim: int,
                              device: str = "cpu") -> None:
    harness = Harness(spec_of(heads, window, softcap, head_dim), lengths=[24, 40, 4, 9],
                      dtype=dtype, page=page, device=device)
    harness.step(ForwardMode.EXTEND, [7, 35, 1, 0])  # ragged; one sequence not yet started
    harness.step(ForwardMode.EXTEND, [15, 2, 1, 9])  # on cached prefixes, plus a fresh one
    for _ in range(2):  # 8 splits of up to 40 keys: some splits are empty
        harness.step(ForwardMode.DECODE, [1, 1, 1, 0])


def tree_mask(parents: list[int]) -> torch.Tensor:
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def token_trees(device: str = "cpu") -> None:
    """A tree on a cached prefix, a forest without one and a plain chain in one batch."""
    harness = Harness(spec_of((4, 2)), lengths=[13, 7, 10], dtype=torch.float32, page=1,
                      device=device)
    harness.step(ForwardMode.EXTEND, [6, 0, 4])
    trees = {0: tree_mask([-1, 0, 0, 1, 3, 3, 2]), 1: tree_mask([-1, 0, -1, 2, -1, 4, 5])}
    harness.step(ForwardMode.EXTEND, [7, 7, 5], trees=trees)
    batch, index = harness.batch(ForwardMode.EXTEND, [0, 0, 1], trees={2: tree_mask([-1])})
    harness.backend.init_forward_metadata(batch)
    x = torch.zeros(1, 4 * 16, device=device)
    with pytest.raises(ValueError, match="token trees with a sliding window"):
        harness.backend.forward(x, x[:, :32], x[:, :32], spec_of((4, 2), window=4), batch)


def a_broken_mask_is_caught() -> None:
    """With the causal bound off by one (every query also sees the next key), the comparisons
    fail, for extend and for decode: they can catch a wrong mask."""
    harness = Harness(spec_of((4, 1)), lengths=[12, 5], dtype=torch.float32, page=1, splits=2)
    harness.step(ForwardMode.EXTEND, [6, 2])  # the causal mask passes
    try:
        kernels.CAUSAL_SLACK = tl.constexpr(1)  # read by the interpreter at each launch
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            harness.step(ForwardMode.EXTEND, [3, 2])
        harness.done = [9, 4]
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            harness.step(ForwardMode.DECODE, [1, 1])
    finally:
        kernels.CAUSAL_SLACK = tl.constexpr(0)


def decode_reads_only_its_graph_inputs() -> None:
    """What a CUDA-graph replay does: a later decode batch of the same size copies its tensors
    into :meth:`graph_inputs` of the recorded one and reruns the same launches. The result must
    be the new batch's attention, so the kernels take nothing from the host copies
    (``seq_lens_cpu``) and nothing is planned per batch beyond those tensors: the batch's rows,
    lengths and new slots."""
    harness = Harness(spec_of((4, 2), window=6), lengths=[20, 11, 30], dtype=torch.float32,
                      page=1, splits=4)
    harness.step(ForwardMode.EXTEND, [9, 3, 17])
    recorded, index = harness.batch(ForwardMode.DECODE, [1, 1, 1])
    harness.backend.init_forward_metadata(recorded)
    inputs = harness.backend.graph_inputs(recorded)
    assert inputs is not None and [t.data_ptr() for t in inputs] == [
        recorded.req_pool_indices.data_ptr(), recorded.seq_lens.data_ptr(),
        recorded.out_cache_loc.data_ptr()]
    harness.forward(recorded, index, [1, 1, 1])  # the recorded step (its own result unused)
    harness.done = [n + 1 for n in harness.done]
    later, index = harness.batch(ForwardMode.DECODE, [1, 1, 1])
    for old, new in zip(inputs, [later.req_pool_indices, later.seq_lens, later.out_cache_loc]):
        old.copy_(new)
    recorded.seq_lens_cpu = [0, 0, 0]  # stale host copies must not matter
    out = harness.backend.forward(*[torch.cat([harness.full[i][name][harness.done[i]:][:1]
                                               for i in index]) for name in "qkv"],
                                  harness.spec, recorded)
    harness.check(out, index, [1, 1, 1])


def tiny_llama_matches_torch(path: str, device: str = "cpu") -> None:
    """A tiny random-weight one-layer Llama (written to ``path``) through the model runner:
    the triton backend's logits of a ragged prefill and two greedy decode steps equal the torch
    backend's. Then sgl's CUDA-graph runner captures decode batches of 1, 2 and 4 (a stand-in
    for the capture runs the forward and keeps it, see tests/core/test_cuda_graph.py) and a
    batch of 3, padded to 4 and replayed, gives the eager forward's hidden states. On a GPU the
    captures are real CUDA graphs."""
    from sgl.engine import cuda_graph
    from sgl.engine.batch_builder import BatchSeq, make_forward_batch
    from sgl.engine.model_runner import ModelRunner
    from sgl.plugins import create_plugin_manager

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    pm = create_plugin_manager()
    prompts = [[5, 9, 2, 77, 31, 8, 140, 6, 11], [250, 3], [7, 7, 7, 7, 42]]
    logits = {}
    for name in ("torch", "triton"):
        runner = ModelRunner(model_path=path, dtype="float32", attention_backend=name,
                             registries=pm.registries, plugin_manager=pm, max_total_tokens=256,
                             max_running_requests=4, show_progress=False, cpu_graphs=False,
                             cuda_graphs=False, device=device)
        rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        batch = make_forward_batch(runner, ForwardMode.EXTEND,
                                   [BatchSeq(r, 0, p) for r, p in zip(rows, prompts)])
        steps = [runner.forward_logits(batch)]
        lens = [len(p) for p in prompts]
        for _ in range(2):
            tokens = steps[-1].argmax(-1).tolist()
            batch = make_forward_batch(runner, ForwardMode.DECODE,
                                       [BatchSeq(r, n, [t]) for r, n, t in zip(rows, lens, tokens)])
            steps.append(runner.forward_logits(batch))
            lens = [n + 1 for n in lens]
        logits[name] = torch.stack(steps)
    assert torch.equal(logits["torch"].argmax(-1), logits["triton"].argmax(-1))
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)

    graphs = cuda_graph.CudaGraphRunner(runner.model, runner.attn_backend, kv_pool=runner.kv_pool,
                                        req_to_token_pool=runner.req_to_token_pool, max_bs=4,
                                        device=runner.device, show_progress=False)
    captured = []

    def capture(fn: Callable[[], Any], pool: Any) -> Callable[[], Any]:  # a CUDA graph's stand-in
        captured.append(int(fn()[0].shape[0]))
        return fn

    real = cuda_graph._capture, cuda_graph.WARMUP_FORWARDS
    if device == "cpu":
        cuda_graph._capture, cuda_graph.WARMUP_FORWARDS = capture, 0  # no warm-up on a CPU
    try:
        graphs.capture()
    finally:
        cuda_graph._capture, cuda_graph.WARMUP_FORWARDS = real
    assert sorted(graphs.graphs) == [1, 2, 4]
    assert captured == ([4, 2, 1] if device == "cpu" else [])
    tokens = steps[-1].argmax(-1).tolist()
    batch = make_forward_batch(runner, ForwardMode.DECODE,
                               [BatchSeq(r, n, [t]) for r, n, t in zip(rows, lens, tokens)])
    pool = [t.clone() for t in (*runner.kv_pool.k_buffer, *runner.kv_pool.v_buffer)]
    eager = runner.forward(batch).clone()
    for tensor, saved in zip((*runner.kv_pool.k_buffer, *runner.kv_pool.v_buffer), pool):
        tensor.copy_(saved)
    replayed = graphs.forward(batch)
    assert graphs.replays == 1
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
