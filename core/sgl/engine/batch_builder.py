"""Building a :class:`ForwardBatch` from per-sequence token lists: the scheduler's entry point.

One request owns one row of ``req_to_token`` for its whole life. Each forward pass appends
tokens to some rows: :func:`make_forward_batch` takes KV slots for the new tokens from the pool,
records them in the rows and packs the flat tensors the model runs on. The caller gives slots
back with :func:`release_sequence` (or ``runner.kv_pool.free(...)``) when the request ends.

Typical life of a request::

    row = runner.req_to_token_pool.alloc()
    batch = make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(row, 0, prompt_ids)])
    next_id = int(runner.forward_logits(batch)[0].argmax())
    batch = make_forward_batch(runner, ForwardMode.DECODE,
                               [BatchSeq(row, len(prompt_ids), [next_id])])
    ...
    release_sequence(runner, row, len(prompt_ids) + 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sgl.engine.model_runner import ModelRunner

__all__ = ["BatchSeq", "make_forward_batch", "release_sequence"]


@dataclass(frozen=True)
class BatchSeq:
    """One sequence of a forward pass.

    :param row: the request's row in ``req_to_token`` (from ``req_to_token_pool.alloc()``).
    :param prefix_len: tokens of this request already in the KV pool, whose slots are
        ``req_to_token[row, :prefix_len]``.
    :param token_ids: the new tokens to run (exactly one in decode).
    :param prefix_slots: for a prefix-cache hit, the cached slots of the first ``prefix_len``
        tokens; they are written into the row before the pass. None: the row already holds them.
    :param tree_parents: the new tokens as a tree (EXTEND only): each token's parent index,
        earlier in the list, -1 for a root (the first token is one; more roots make a forest,
        as a draft head's beams). Token i sits at position ``prefix_len + depth(i)`` and
        attends the prefix, its ancestors and itself.
    """

    row: int
    prefix_len: int
    token_ids: Sequence[int]
    prefix_slots: torch.Tensor | None = None
    #: a token tree over the new tokens (see ``ForwardBatch.tree_masks``): ``parents[i]`` is
    #: the index of token i's parent among them, -1 for a root (token 0 is one). None: a chain.
    tree_parents: Sequence[int] | None = None


def _validate(runner: ModelRunner, mode: ForwardMode, seqs: Sequence[BatchSeq]) -> None:
    if not seqs:
        raise ValueError("a forward batch needs at least one sequence")
    if len({s.row for s in seqs}) != len(seqs):
        raise ValueError("two sequences of one batch share a req_to_token row")
    limit = runner.req_to_token_pool.max_context_len
    for s in seqs:
        n = len(s.token_ids)
        if mode == ForwardMode.DECODE and n != 1:
            raise ValueError(f"decode takes exactly one new token per sequence, row {s.row} has {n}")
        if n == 0:
            raise ValueError(f"row {s.row} has no new tokens; extend needs at least one")
        if s.prefix_len < 0 or s.prefix_len + n > limit:
            raise ValueError(
                f"row {s.row}: prefix {s.prefix_len} + {n} new tokens exceeds the context length "
                f"{limit}"
            )
        if s.prefix_slots is not None and s.prefix_slots.numel() != s.prefix_len:
            raise ValueError(
                f"row {s.row}: {s.prefix_slots.numel()} prefix slots for prefix_len {s.prefix_len}"
            )
        if s.tree_parents is not None:
            parents = list(s.tree_parents)
            if mode != ForwardMode.EXTEND or len(parents) != n or parents[0] != -1 or any(
                    not -1 <= p < i for i, p in enumerate(parents)):
                raise ValueError(f"row {s.row}: tree_parents must give each new token an "
                                 f"earlier parent or -1, the first -1 (extend only), got "
                                 f"{parents}")
            if not runner.attn_backend.supports_tree_mask:
                raise ValueError(f"the {runner.attn_backend.name} attention backend cannot "
                                 "attend over token trees")


def make_forward_batch(runner: ModelRunner, mode: ForwardMode,
                       seqs: Sequence[BatchSeq | tuple[int, int, Sequence[int]]], *,
                       slots: torch.Tensor | None = None,
                       decode_seqs: int | None = None) -> ForwardBatch:
    """Take KV slots for the new tokens, record them in ``req_to_token`` and pack the batch.

    :param runner: supplies the pools, the attention backend and the device.
    :param mode: ``EXTEND`` (any number of new tokens per sequence, on top of its prefix) or
        ``DECODE`` (one new token per sequence).
    :param seqs: :class:`BatchSeq` objects or ``(row, prefix_len, token_ids)`` tuples.
    :param slots: the new tokens' KV slots, in token order, when the caller manages them (a
        draft head writing at its target's slots); None takes them from ``runner.kv_pool``.
    :param decode_seqs: in ``EXTEND``, how many leading sequences are decode rows (one
        generated token each; see ``ForwardBatch.decode_seqs``); None: not said.
    :return: the batch; ``batch.out_cache_loc`` holds the slots just taken, in token order.
    :raises sgl.kvcache.OutOfSlotsError: when the pool has too few free slots (nothing is taken).
    :raises ValueError: on inconsistent input (see :class:`BatchSeq`).
    """
    items = [s if isinstance(s, BatchSeq) else BatchSeq(*s) for s in seqs]
    _validate(runner, mode, items)
    device = runner.device
    table = runner.req_to_token_pool.req_to_token
    for s in items:
        if s.prefix_slots is not None and s.prefix_len:
            table[s.row, :s.prefix_len] = s.prefix_slots.to(device=device, dtype=table.dtype)

    new_lens = [len(s.token_ids) for s in items]
    prefix_lens = [s.prefix_len for s in items]
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    if slots is None:
        slots = runner.kv_pool.alloc(sum(new_lens))
    elif slots.numel() != sum(new_lens):
        raise ValueError(f"{slots.numel()} slots given for {sum(new_lens)} new tokens")
    slots = slots.to(device=device, dtype=torch.int64)
    rows = torch.tensor([s.row for s in items], dtype=torch.int64)
    if mode == ForwardMode.DECODE:  # one token per sequence, at its prefix length
        positions = as_tensor(prefix_lens)
        token_rows = rows.to(device)
    else:
        positions = torch.cat([torch.arange(p, t, dtype=torch.int64) for p, t in
                               zip(prefix_lens, seq_lens)]).to(device)
        token_rows = rows.repeat_interleave(torch.tensor(new_lens)).to(device)
    table[token_rows, positions] = slots
    tree_masks = None
    if any(s.tree_parents is not None for s in items):
        tree_masks, depths = [], []
        for s in items:
            mask, depth = _tree(s.tree_parents, len(s.token_ids), device)
            tree_masks.append(mask)
            depths.append(s.prefix_len + depth)
        positions = torch.cat(depths)  # the model's positions; the table keeps token order

    input_ids = [int(t) for s in items for t in s.token_ids]
    return ForwardBatch(
        mode=mode,
        input_ids=as_tensor(input_ids),
        positions=positions,
        req_pool_indices=rows.to(device),
        seq_lens=as_tensor(seq_lens),
        extend_prefix_lens=as_tensor(prefix_lens),
        extend_seq_lens=as_tensor(new_lens),
        out_cache_loc=slots,
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=new_lens,
        req_pool_indices_cpu=[s.row for s in items],
        tree_masks=tree_masks,
        decode_seqs=decode_seqs,
    )


def _tree(parents: Sequence[int] | None, n: int,
          device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The ancestor-or-self mask ``[n, n]`` (None for a chain) and the depth of each token."""
    if parents is None:
        return None, torch.arange(n, dtype=torch.int64, device=device)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i in range(1, n):
        if parents[i] >= 0:  # else a root of a forest
            mask[i] |= mask[parents[i]]
            depth[i] = depth[parents[i]] + 1
    return mask.to(device), torch.tensor(depth, dtype=torch.int64, device=device)


def release_sequence(runner: ModelRunner, row: int, num_tokens: int) -> None:
    """Free the KV slots of ``req_to_token[row, :num_tokens]`` and the row itself.

    For a request whose KV nobody else holds. With a prefix cache, free only the slots the cache
    did not take, then ``runner.req_to_token_pool.free(row)``.
    """
    if num_tokens:
        runner.kv_pool.free(runner.req_to_token_pool.req_to_token[row, :num_tokens].clone())
    runner.req_to_token_pool.free(row)
