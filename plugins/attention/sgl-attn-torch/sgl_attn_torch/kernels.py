"""The attention maths: masks and one scaled-dot-product call, with or without soft-capping."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attend", "decode_mask", "extend_mask"]


def extend_mask(prefix_len: int, num_new: int, window: int | None,
                device: torch.device, tree: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[num_new, prefix_len + num_new]`` bool, True where a new token may attend.

    None when plain causal attention over the new tokens is exact (no prefix, no window).
    ``tree``: the new tokens form a token tree, ``tree[i, j]`` where token i may attend new
    token j (its ancestors and itself); every prefix token is visible (no window then)."""
    if tree is not None:
        if window is not None:
            raise ValueError("token trees with a sliding window are not supported")
        return torch.cat([torch.ones((num_new, prefix_len), dtype=torch.bool, device=device),
                          tree.to(device)], dim=1)
    if prefix_len == 0 and window is None:
        return None
    q_pos = torch.arange(prefix_len, prefix_len + num_new, device=device).unsqueeze(1)
    k_pos = torch.arange(prefix_len + num_new, device=device).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (q_pos - k_pos) < window
    return visible


def decode_mask(seq_lens: torch.Tensor, max_len: int, window: int | None, *,
                padded: bool) -> torch.Tensor | None:
    """``[n, 1, 1, max_len]`` bool over padded keys, True where the single new token may attend.

    ``padded`` says whether any sequence is shorter than ``max_len``. None when no key needs
    masking (no padding, and no window shorter than the keys)."""
    if not padded and (window is None or max_len <= window):
        return None
    k_pos = torch.arange(max_len, device=seq_lens.device).unsqueeze(0)
    lens = seq_lens.unsqueeze(1)
    visible = k_pos < lens
    if window is not None:
        visible &= k_pos >= lens - window
    return visible[:, None, None, :]


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, scale: float, cap: float) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None,
           causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention of ``q [n, Hq, Lq, D]`` over ``k``/``v`` ``[n, Hk, Lk, D]`` (``Hq`` a multiple
    of ``Hk``: grouped-query attention, query head ``h`` uses key head ``h // (Hq / Hk)``).

    ``mask`` (bool, True = attend) broadcasts to ``[n, Hq, Lq, Lk]``; ``causal`` means a square
    lower-triangular mask instead.
    """
    if softcap is not None:
        return _softcapped(q, k, v, mask, causal, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])
