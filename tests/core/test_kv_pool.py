"""The KV pool's writes (``KVPool.set_kv``): runs of consecutive slots are copied as slices,
everything else goes through torch's indexed write, and both leave the same pool."""

from __future__ import annotations

import pytest
import torch

from sgl.kvcache import KVPool


def make_pool(dtype: torch.dtype = torch.bfloat16, size: int = 64) -> KVPool:
    return KVPool(size=size, num_layers=2, num_kv_heads=3, head_dim=8, dtype=dtype,
                  device=torch.device("cpu"))


def indexed_write(pool: KVPool, layer: int, loc: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch's indexed write makes of the layer's buffers, on copies."""
    kb, vb = pool.k_buffer[layer].clone(), pool.v_buffer[layer].clone()
    kb[loc], vb[loc] = k.to(pool.dtype), v.to(pool.dtype)
    return kb, vb


LOCS = {
    "one run": list(range(5, 25)),
    "prompt and decodes": list(range(10, 30)) + [40, 41, 42, 7],
    "runs and singles": [3, 4, 5, 9, 11, 12, 60, 61, 62, 63, 64, 1],
    "descending": list(range(30, 10, -1)),  # a run per slot: torch's write
    "scattered": [17, 3, 50, 9, 44, 21, 8, 33, 2, 58, 13, 27, 40, 6, 19, 61, 5, 36],
    "one slot": [64],
}


@pytest.mark.parametrize("name", list(LOCS))
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_set_kv_writes_what_torchs_indexed_write_writes(name: str,
                                                        src_dtype: torch.dtype) -> None:
    """Every layout of slots, from a strided view of a fused q/k/v output as the attention
    backends pass it, in the pool's dtype and in float32 (rounded as ``.to`` rounds)."""
    torch.manual_seed(len(name))
    pool = make_pool()
    loc = torch.tensor(LOCS[name], dtype=torch.int64)
    qkv = torch.randn(len(loc), 5 * 24).to(src_dtype)
    k = qkv[:, 48:72].view(-1, 3, 8)
    v = qkv[:, 72:96].view(-1, 3, 8)
    for layer in (0, 1):  # the second layer reuses the runs found for the first
        want_k, want_v = indexed_write(pool, layer, loc, k * (layer + 1), v * (layer + 1))
        pool.set_kv(layer, loc, k * (layer + 1), v * (layer + 1))
        assert torch.equal(pool.k_buffer[layer], want_k)
        assert torch.equal(pool.v_buffer[layer], want_v)


def test_runs_follow_the_slots_not_the_tensor() -> None:
    """The runs are kept with a copy of the slots they came from: the same tensor changed in
    place (as a recorded forward's input buffer is) or a new tensor with other slots writes
    where it says."""
    pool = make_pool()
    loc = torch.arange(10, 20)
    k, v = torch.randn(10, 3, 8), torch.randn(10, 3, 8)
    pool.set_kv(0, loc, k, v)
    loc.copy_(torch.arange(40, 50))  # in place: same object, other slots
    pool.set_kv(0, loc, -k, -v)
    assert torch.equal(pool.k_buffer[0][40:50], (-k).bfloat16())
    assert torch.equal(pool.k_buffer[0][10:20], k.bfloat16())
    other = torch.tensor([1, 2, 3, 30, 31, 32, 33, 34, 35, 36])
    pool.set_kv(0, other, 2 * k, 2 * v)
    assert torch.equal(pool.v_buffer[0][other], (2 * v).bfloat16())


def test_slots_outside_the_pool_fail_as_torch_fails() -> None:
    """A run past the pool's end is not cut short by slicing: torch's indexed write raises."""
    pool = make_pool(size=16)
    k = torch.randn(4, 3, 8)
    with pytest.raises(IndexError):
        pool.set_kv(0, torch.tensor([15, 16, 17, 18]), k, k)
    with pytest.raises(IndexError):
        pool.set_kv(0, torch.tensor([-30, -29, -28, -27]), k, k)
