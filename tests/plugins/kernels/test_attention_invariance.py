"""Decode and extend attention agree bit for bit: a query row's output from ``sgl::decode_attention``
is the same bits as the same row from ``sgl::extend_attention``, however the sequence is split
into cached prefix and new tokens, whatever other sequences share the call, and on any number of
kernel threads. Greedy decoding rests on this: the KV a request's answer leaves in the prefix
cache (written by decode steps) must equal what a prefill of the same text writes, and a
retracted or speculatively verified request must get the tokens it would have got decoding.

Drawn with hypothesis at every kernel level (emulated ones included): heads and KV heads, head
size, dtype, sliding window, soft-capping, the sequences' lengths (across the kernels' 64-key
blocks) and the prefix/new split of each.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl.kernels import cpu


def _pools(lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """K/V pools with every sequence's slots scattered, one table row a sequence."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    size = sum(lengths) * 2 + 1
    k_pool = torch.randn(size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(size, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(size - 1, generator=gen)[:sum(lengths)] + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    start = 0
    for b, n in enumerate(lengths):
        table[b, :n] = slots[start:start + n]
        start += n
    return k_pool, v_pool, table


def _extend(q_rows, k_pool, v_pool, table, prefixes, lengths, heads, kv_heads, head_dim,
            window, softcap):
    """Each sequence's tokens prefix..n-1 in one extend call: their output rows, per sequence."""
    q = torch.cat([q_rows[b][p:n] for b, (p, n) in enumerate(zip(prefixes, lengths))])
    new = torch.tensor([n - p for p, n in zip(prefixes, lengths)])
    starts = torch.cumsum(new, 0) - new
    out = torch.ops.sgl.extend_attention(
        q.contiguous(), k_pool, v_pool, table, torch.arange(len(lengths)), starts,
        torch.tensor(prefixes), new, heads, kv_heads, head_dim, head_dim ** -0.5, softcap,
        window, None)
    return [out[s:s + m] for s, m in zip(starts.tolist(), new.tolist())]


def _decode(q_last, k_pool, v_pool, table, lengths, heads, kv_heads, head_dim, window, softcap,
            order):
    """Each sequence's last token in one decode call, the sequences in ``order``."""
    idx = torch.tensor(order)
    lens = torch.tensor(lengths)[idx]
    loc = table[idx, lens - 1]
    # the new token's K/V are already in the pool: the kernel writes them again, unchanged
    k_new = k_pool[loc].reshape(len(order), -1)
    v_new = v_pool[loc].reshape(len(order), -1)
    out = torch.ops.sgl.decode_attention(
        q_last[idx].contiguous(), k_new, v_new, k_pool, v_pool, table, idx, lens, loc, heads,
        kv_heads, head_dim, head_dim ** -0.5, softcap, window)
    return {b: out[i] for i, b in enumerate(order)}


@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads")
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 7, 8]),
       head_dim=st.sampled_from([16, 48, 64, 128]), bf16=st.booleans(),
       lengths=st.lists(st.integers(1, 200), min_size=1, max_size=5),
       window=st.sampled_from([0, 0, 5, 64, 100]), softcap=st.sampled_from([0.0, 0.0, 3.0]),
       data=st.data())
def test_decode_rows_equal_extend_rows(kv_heads: int, group: int, head_dim: int, bf16: bool,
                                       lengths: list[int], window: int, softcap: float,
                                       data: st.DataObject) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    heads = kv_heads * group
    k_pool, v_pool, table = _pools(lengths, kv_heads, head_dim, dtype, seed=sum(lengths))
    gen = torch.Generator().manual_seed(len(lengths) + head_dim)
    q_rows = [torch.randn(n, heads * head_dim, generator=gen).to(dtype) for n in lengths]
    args = (heads, kv_heads, head_dim, window, softcap)
    cpu.set_threads(2)
    cold = _extend(q_rows, k_pool, v_pool, table, [0] * len(lengths), lengths, *args)
    # the same tokens' last rows after a prefix of each drawn length, in one call
    prefixes = [data.draw(st.integers(0, n - 1), label=f"prefix of {n}") for n in lengths]
    warm = _extend(q_rows, k_pool, v_pool, table, prefixes, lengths, *args)
    order = data.draw(st.permutations(range(len(lengths))), label="decode order")
    threads = data.draw(st.sampled_from([1, 2, 3]), label="threads")
    cpu.set_threads(threads)
    decoded = _decode(torch.stack([q[-1] for q in q_rows]), k_pool, v_pool, table, lengths,
                      *args, order=order)
    for b, n in enumerate(lengths):
        assert torch.equal(warm[b][-1], cold[b][-1]), (
            f"sequence {b} ({n} tokens): its last row after a {prefixes[b]}-token prefix differs "
            f"from the cold prefill's by "
            f"{(warm[b][-1].float() - cold[b][-1].float()).abs().max().item():.3g}")
        assert torch.equal(decoded[b], cold[b][-1]), (
            f"sequence {b} ({n} tokens, {threads} thread(s)): the decode kernel's row differs "
            f"from the extend kernel's by "
            f"{(decoded[b].float() - cold[b][-1].float()).abs().max().item():.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernel_isa")
def test_decode_rows_stay_close_to_the_reference(dtype: torch.dtype) -> None:
    """The agreement is not that of a wrong result: the decode kernel against a float64 softmax
    over the same keys (SmolLM2's heads, 200 and 1000 keys, a window of 300)."""
    heads, kv_heads, head_dim = 9, 3, 64
    for lengths, window in (([200, 1000, 1], 0), ([1000, 450], 300)):
        k_pool, v_pool, table = _pools(lengths, kv_heads, head_dim, dtype, seed=7)
        q = torch.randn(len(lengths), heads * head_dim, generator=torch.Generator().manual_seed(1))
        q = q.to(dtype)
        got = _decode(q, k_pool, v_pool, table, lengths, heads, kv_heads, head_dim, window, 0.0,
                      order=list(range(len(lengths))))
        for b, n in enumerate(lengths):
            first = max(0, n - window) if window else 0
            keys = table[b, first:n]
            k = k_pool[keys].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
            v = v_pool[keys].double().repeat_interleave(heads // kv_heads, dim=1)
            qh = q[b].double().view(heads, head_dim)
            p = torch.softmax(torch.einsum("hd,nhd->hn", qh, k) * head_dim ** -0.5, dim=-1)
            want = torch.einsum("hn,nhd->hd", p, v).reshape(-1)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got[b].double(), want, rtol=tol, atol=tol)
