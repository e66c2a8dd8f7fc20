"""RadixAttention's prefix cache: a radix tree over token ids whose edges hold KV slots.

Each node's ``key`` is the run of token ids on the edge into it and ``slots`` the KV slots of
those tokens; the path from the root to a node spells a cached prefix. Requests that share a
prefix (a system prompt, few-shot examples, earlier turns of a chat) find it with
:meth:`RadixCache.match_prefix` and compute only the rest.

Bookkeeping, as in SGLang's paper:

* **lock references**: a running request locks the path of its match (``lock_ref`` on every
  node up to the root); a node with ``lock_ref > 0`` is never evicted;
* **eviction**: leaves first, least recently used first; a parent whose last child went becomes
  a leaf in turn. Nodes a session protects go after all others;
* **pages**: with ``page_size > 1`` keys are compared and split in whole pages only, so every
  match and every node is page-aligned.

Sizes are kept incrementally: ``evictable_tokens`` (unlocked) and ``locked_tokens``, so the
scheduler can ask "how much memory could I get back?" in O(1).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from sgl.kvcache import BaseCachePolicy, KVPool, PrefixMatch

__all__ = ["RadixCache", "TreeNode"]

_clock = itertools.count()


class TreeNode:
    """One edge of the tree and the node it leads to."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "protect_ref", "slots")

    def __init__(self, key: list[int], slots: torch.Tensor, parent: TreeNode | None) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.lock_ref = 0
        self.protect_ref = 0
        self.last_access = next(_clock)

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


class RadixCache(BaseCachePolicy):
    """The radix-tree cache policy (registered as ``radix``)."""

    name = "radix"

    def __init__(self, *, kv_pool: KVPool, page_size: int = 1) -> None:
        super().__init__(kv_pool=kv_pool, page_size=page_size)
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), None)
        self.root.lock_ref = 1  # never evicted
        self._evictable = 0
        self._locked = 0

    # --- sizes --------------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return self._evictable + self._locked

    @property
    def evictable_tokens(self) -> int:
        return self._evictable

    @property
    def locked_tokens(self) -> int:
        return self._locked

    # --- matching -----------------------------------------------------------------------------

    def _child_key(self, key: Sequence[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    def _common_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Length of the common prefix of ``a`` and ``b``, rounded down to whole pages."""
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page_size

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        key = list(token_ids[:self._aligned(len(token_ids))])
        node, parts = self._walk(key)
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(slots=slots, handle=node)

    def _walk(self, key: list[int]) -> tuple[TreeNode, list[torch.Tensor]]:
        """Follow ``key`` down the tree, splitting the last edge where the match ends inside
        it, so that the returned node's path is exactly the matched prefix."""
        node, parts, pos = self.root, [], 0
        now = next(_clock)
        node.last_access = now
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            n = self._common_len(child.key, key[pos:pos + len(child.key)])
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            node, pos = child, pos + n
        return node, parts

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        upper = TreeNode(child.key[:n], child.slots[:n], child.parent)
        upper.lock_ref, upper.protect_ref = child.lock_ref, child.protect_ref
        upper.last_access = child.last_access
        assert child.parent is not None
        child.parent.children[self._child_key(upper.key)] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # --- inserting ----------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Add a sequence (whole pages of it) with its slots; return how many of its leading
        tokens the tree already held (their slots in ``slots`` are duplicates: the caller
        frees them). The new tail becomes a leaf."""
        n = self._aligned(min(len(token_ids), int(slots.numel())))
        key = list(token_ids[:n])
        node, parts = self._walk(key)
        existing = sum(int(p.numel()) for p in parts)
        if existing < n:
            leaf = TreeNode(key[existing:], slots[existing:n].clone(), node)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += len(leaf)
        return existing

    def cache_finished(self, token_ids: Sequence[int], slots: torch.Tensor,
                       match: PrefixMatch) -> None:
        n = self._aligned(min(len(token_ids), int(slots.numel())))
        existing = self.insert(token_ids[:n], slots[:n])
        self.kv_pool.free(slots[len(match):existing])  # computed again: the tree had them
        self.kv_pool.free(slots[n:])  # the part of a page the tree does not keep
        self.unlock(match)

    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor,
                         match: PrefixMatch) -> PrefixMatch:
        n = self._aligned(min(len(token_ids), int(slots.numel())))
        if n <= len(match):
            return match
        existing = self.insert(token_ids[:n], slots[:n])
        self.kv_pool.free(slots[len(match):existing])
        new = self.match_prefix(token_ids[:n])
        self.lock(new)
        self.unlock(match)
        return new

    # --- locks --------------------------------------------------------------------------------

    def lock(self, match: PrefixMatch) -> None:
        node = match.handle
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._locked += len(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, match: PrefixMatch) -> None:
        node = match.handle
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock without a matching lock in the radix cache")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node)
                self._locked -= len(node)
            node = node.parent

    def protect(self, match: PrefixMatch) -> None:
        node = match.handle
        while node is not None and node is not self.root:
            node.protect_ref += 1
            node = node.parent

    def unprotect(self, match: PrefixMatch) -> None:
        node = match.handle
        while node is not None and node is not self.root:
            node.protect_ref = max(0, node.protect_ref - 1)
            node = node.parent

    def ancestors(self, match: PrefixMatch) -> list[Any]:
        path = []
        node = match.handle
        while node is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    # --- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(leaf.protect_ref > 0, leaf.last_access, id(leaf), leaf)
                for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            *_, leaf = heapq.heappop(heap)
            self.kv_pool.free(leaf.slots)
            freed += len(leaf)
            self._evictable -= len(leaf)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.protect_ref > 0, parent.last_access, id(parent),
                                      parent))
        self.stats.evicted_tokens += freed
        return freed

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def flush(self) -> bool:
        if self._locked:
            return False
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.kv_pool.free(node.slots)
            stack.extend(node.children.values())
        self.root.children.clear()
        self._evictable = 0
        return True

    # --- inspection (tests, debugging) --------------------------------------------------------

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (each exactly once if the books are right)."""
        parts, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            parts.append(node.slots)
            stack.extend(node.children.values())
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def pretty(self) -> str:
        """The tree as indented lines of ``key (lock_ref)``, for debugging."""
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{child.key[:8]}{'...' if len(child) > 8 else ''} "
                             f"len={len(child)} lock={child.lock_ref}")
                visit(child, depth + 1)

        visit(self.root, 0)
        return "\n".join(lines)
