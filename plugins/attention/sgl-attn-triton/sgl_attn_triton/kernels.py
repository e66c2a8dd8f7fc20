"""Triton kernels of the ``triton`` attention backend and the small functions that launch them.

Both kernels read the keys and values straight from the paged pool: the pool slot of token
``j`` of a sequence is ``req_to_token[row, j]``, and ``k_buffer[slot, kv_head, :]`` its key.
Scores are computed in float32 with an online softmax (running maximum ``m``, running sum ``l``
and an unnormalised float32 accumulator), so no ``[queries, keys]`` matrix is ever stored.

* decode, in two launches. :func:`decode_attention` splits every sequence's keys into
  ``splits`` equal ranges; program ``(sequence, kv head, split)`` attends the query heads
  that share that KV head (grouped-query attention: the group's rows form one ``tl.dot``
  operand, each key block is loaded once per group) over its range and writes its partial
  ``acc``, ``m`` and ``l``; program ``(sequence, head)`` of the second launch merges the
  splits. The grids depend only on the batch size, the head counts and ``splits``, and the
  kernels read the lengths from ``seq_lens`` on the device, so a decode forward can be
  captured in a CUDA graph.
* extend: :func:`extend_attention`, program ``(sequence, head, block of BLOCK_M new tokens)``
  walks the keys ``[0, seq_len)`` in blocks of ``BLOCK_N`` (the cached prefix and the new
  tokens alike, all in the pool by then), masking causally, by the sliding window, or by the
  sequence's token tree. The grid's third dimension is the longest extend of the batch,
  planned on the host (extend batches are not captured).

On a CPU the kernels run only under triton's interpreter. ``triton.jit`` decides whether it
compiles a function or hands it to the interpreter when it wraps it, reading
``triton.knobs.runtime.interpret`` (the ``TRITON_INTERPRET`` environment variable), and triton's
own library functions (``tl.sum``, ``tl.max``, ``tl.cdiv``) are wrapped when triton is first
imported: ``TRITON_INTERPRET=1`` must be set before anything imports triton.

(No ``from __future__ import annotations`` in this module: triton reads the ``tl.constexpr``
annotations of the kernels' parameters.)
"""

import torch
import triton
import triton.language as tl

__all__ = ["CAUSAL_SLACK", "DECODE_SPLITS", "INTERPRETED_DECODE_SPLITS", "decode_attention",
           "extend_attention", "interpreting"]

#: key positions up to ``query position + CAUSAL_SLACK`` are visible. 0 is the causal mask;
#: the tests set 1 to prove that their comparisons see a broken mask
CAUSAL_SLACK = tl.constexpr(0)
#: key ranges per sequence in decode (split-K), so that a small batch still has enough
#: programs for the GPU; a fixed count keeps the grid static
DECODE_SPLITS = 8
#: the same under the interpreter, which runs the programs one after another
INTERPRETED_DECODE_SPLITS = 2


@triton.jit
def _key_scores(q, K, Table, row, stride_table, stride_kt, stride_kh, kv_head, pos, pos_ok, d,
                scale, softcap, HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr,
                PRECISION: tl.constexpr):
    """The pool slots of the key positions ``pos`` of request row ``row``, and the scores of
    ``q`` against their keys: scaled, and soft-capped (``softcap * tanh(s / softcap)``, tanh
    written with exp: triton has none)."""
    slot = tl.load(Table + row * stride_table + pos, mask=pos_ok, other=0)
    k = tl.load(K + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                mask=pos_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return slot, s


@triton.jit
def _add_values(acc, l_i, p, alpha, V, slot, stride_vt, stride_vh, kv_head, pos_ok, dv,
                V_DIM: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """One block of the online softmax: the running sum and accumulator rescaled by ``alpha``
    (the old maximum against the new), plus the block's weights ``p`` times its values."""
    v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + dv[None, :],
                mask=pos_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_split(Q, K, V, Table, Rows, SeqLens, MidAcc, MidStats,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_table, stride_mb, stride_mh, stride_sb, stride_sh,
                  scale, softcap, window,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
                  WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                  DOT_F32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    row = tl.load(Rows + seq)
    end = tl.load(SeqLens + seq) + CAUSAL_SLACK  # the query is token seq_len - 1
    start = end * 0
    if WINDOW:
        start = tl.maximum(end - window, 0)
    chunk = tl.cdiv(end - start, SPLITS)
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, end)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        slot, s = _key_scores(q, K, Table, row, stride_table, stride_kt, stride_kh, kv_head,
                              pos, pos_ok, d, scale, softcap, HEAD_DIM, SOFTCAP, PRECISION)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the block has a visible key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc, l_i = _add_values(acc, l_i, p, alpha, V, slot, stride_vt, stride_vh, kv_head,
                               pos_ok, dv, V_DIM, DOT_F32, PRECISION)
        m_i = m_new

    out_heads = seq * stride_mb + heads * stride_mh + split * BLOCK_DV
    tl.store(MidAcc + out_heads[:, None] + dv[None, :], acc, mask=head_ok[:, None])
    stats = seq * stride_sb + heads * stride_sh + split * 2
    tl.store(MidStats + stats, m_i, mask=head_ok)
    tl.store(MidStats + stats + 1, l_i, mask=head_ok)


@triton.jit
def _decode_merge(MidAcc, MidStats, Out, stride_mb, stride_mh, stride_sb, stride_sh,
                  stride_ot, stride_oh,
                  V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    stats = MidStats + seq * stride_sb + head * stride_sh + split * 2
    m = tl.load(stats)
    l_s = tl.load(stats + 1)
    acc = tl.load(MidAcc + seq * stride_mb + head * stride_mh + split[:, None] * BLOCK_DV
                  + dv[None, :])
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key at all (a padding row)
    weight = tl.exp(m - m_max)  # an empty split has m = -inf: weight 0
    total = tl.sum(l_s * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + seq * stride_ot + head * stride_oh + dv,
             out.to(Out.dtype.element_ty), mask=dv < V_DIM)


@triton.jit
def _extend(Q, K, V, Out, Table, Rows, QStarts, PrefixLens, ExtendLens, Tree, TreeStarts,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_ot, stride_oh, stride_table,
            scale, softcap, window,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
            TREE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    m0 = tl.program_id(2) * BLOCK_M
    row = tl.load(Rows + seq)
    q_start = tl.load(QStarts + seq)
    prefix = tl.load(PrefixLens + seq)
    num_new = tl.load(ExtendLens + seq)
    seq_len = prefix + num_new

    new = m0 + tl.arange(0, BLOCK_M)  # this block's new tokens, by index among them
    new_ok = new < num_new
    q_pos = prefix + new
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + (q_start + new[:, None]) * stride_qt + head * stride_qh + d[None, :],
                mask=new_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # the keys any query of the block can see
    lo = seq_len * 0
    hi = tl.minimum(seq_len, prefix + m0 + BLOCK_M + CAUSAL_SLACK)
    tree_start = lo - 1
    if TREE:
        tree_start = tl.load(TreeStarts + seq)
        hi = tl.where(tree_start >= 0, seq_len, hi)
    if WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0)
    hi = tl.where(m0 < num_new, hi, 0)  # a block past this sequence's tokens: no keys

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        slot, s = _key_scores(q, K, Table, row, stride_table, stride_kt, stride_kh, kv_head,
                              pos, pos_ok, d, scale, softcap, HEAD_DIM, SOFTCAP, PRECISION)
        visible = pos[None, :] <= q_pos[:, None] + CAUSAL_SLACK
        if WINDOW:
            visible &= q_pos[:, None] - pos[None, :] < window
        if TREE:  # a token tree: the whole prefix, and the new tokens its mask row names
            j = pos - prefix
            first = tl.where(tree_start >= 0, 0, num_new)  # a chain reads no bits
            bits = tl.load(Tree + tree_start + new[:, None] * num_new + j[None, :],
                           mask=new_ok[:, None] & pos_ok[None, :] & (j[None, :] >= first),
                           other=0)
            in_tree = (j[None, :] < 0) | (bits != 0)
            visible = tl.where(tree_start >= 0, in_tree, visible)
        visible &= pos_ok[None, :] & new_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        acc, l_i = _add_values(acc, l_i, p, alpha, V, slot, stride_vt, stride_vh, kv_head,
                               pos_ok, dv, V_DIM, DOT_F32, PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q_start + new[:, None]) * stride_ot + head * stride_oh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=new_ok[:, None] & (dv[None, :] < V_DIM))


def interpreting() -> bool:
    """Whether these kernels run in triton's interpreter (``TRITON_INTERPRET=1`` when triton
    was imported).

    :raises RuntimeError: when the variable was set after triton was imported but before this
        module: its kernels would be interpreted and triton's library functions not.
    """
    mine = not isinstance(_extend, triton.JITFunction)
    if mine != (not isinstance(tl.sum, triton.JITFunction)):
        raise RuntimeError("TRITON_INTERPRET changed between importing triton and importing "
                           "sgl_attn_triton.kernels; set it before anything imports triton")
    return mine


def _block(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _dots(dtype: torch.dtype) -> dict[str, object]:
    """How the kernels multiply: float32 products stay float32 (the GPU's default would round
    them to tf32); bfloat16 operands become float32 in the interpreter, whose ``tl.dot``
    multiplies bfloat16 as the integers that store it (triton 3.9)."""
    dot_f32 = dtype == torch.bfloat16 and interpreting()
    return {"PRECISION": "ieee" if dtype == torch.float32 or dot_f32 else "tf32",
            "DOT_F32": dot_f32}


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, *, scale: float, softcap: float | None,
                     window: int | None, splits: int = DECODE_SPLITS,
                     block_n: int = 32) -> torch.Tensor:
    """Attention of one query token per sequence over its ``seq_lens[i]`` keys in the pool.

    :param q: ``[batch, heads, head_dim]``, last dimension contiguous
    :param k_pool: ``[slots, kv_heads, head_dim]``; ``v_pool`` ``[slots, kv_heads, v_dim]``
    :param table: ``req_to_token`` ``[rows, context]``; ``rows``, ``seq_lens``: ``[batch]``
    :param splits: key ranges per sequence, a power of two
    :return: ``[batch, heads, v_dim]`` in ``q``'s dtype
    """
    batch, heads, head_dim = q.shape
    kv_heads, v_dim = k_pool.shape[1], v_pool.shape[-1]
    block_dv = _block(v_dim)
    mid = torch.empty((batch, heads, splits, block_dv), dtype=torch.float32, device=q.device)
    stats = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)
    out = q.new_empty((batch, heads, v_dim))
    group = heads // kv_heads
    _decode_split[(batch, kv_heads, splits)](
        q, k_pool, v_pool, table, rows, seq_lens, mid, stats,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), table.stride(0),
        mid.stride(0), mid.stride(1), stats.stride(0), stats.stride(1),
        scale, softcap or 0.0, window or 0,
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_H=_block(group),
        BLOCK_D=_block(head_dim), BLOCK_DV=block_dv, BLOCK_N=block_n, SPLITS=splits,
        SOFTCAP=bool(softcap), WINDOW=bool(window), **_dots(q.dtype))
    _decode_merge[(batch, heads)](
        mid, stats, out, mid.stride(0), mid.stride(1), stats.stride(0), stats.stride(1),
        out.stride(0), out.stride(1), V_DIM=v_dim, BLOCK_DV=block_dv, SPLITS=splits)
    return out


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                     q_starts: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, max_extend: int, *, scale: float,
                     softcap: float | None, window: int | None,
                     tree: torch.Tensor | None = None, tree_starts: torch.Tensor | None = None,
                     block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    """Attention of every sequence's new tokens over its prefix and themselves (causal, or a
    token tree), all keys read from the pool.

    :param q: ``[tokens, heads, head_dim]``, the sequences' new tokens one after another
    :param q_starts, prefix_lens, extend_lens: ``[batch]`` int64: each sequence's first row of
        ``q``, cached tokens and new tokens; ``max_extend`` the largest ``extend_lens``
    :param tree: uint8, the sequences' ``[n, n]`` tree masks flattened one after another;
        ``tree_starts[i]`` where sequence i's starts, -1 for a causal chain
    :return: ``[tokens, heads, v_dim]`` in ``q``'s dtype
    """
    tokens, heads, head_dim = q.shape
    kv_heads, v_dim = k_pool.shape[1], v_pool.shape[-1]
    out = q.new_empty((tokens, heads, v_dim))
    batch = rows.shape[0]
    if tokens == 0 or batch == 0:
        return out
    has_tree = tree is not None
    if not has_tree:
        tree = tree_starts = rows  # never read
    _extend[(batch, heads, triton.cdiv(max_extend, block_m))](
        q, k_pool, v_pool, out, table, rows, q_starts, prefix_lens, extend_lens, tree,
        tree_starts,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1), table.stride(0),
        scale, softcap or 0.0, window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=_block(head_dim), BLOCK_DV=_block(v_dim),
        SOFTCAP=bool(softcap), WINDOW=bool(window), TREE=has_tree, **_dots(q.dtype))
    return out
