"""The radix tree against a simple reference model, under random requests, locks and evictions.

The reference keeps a dict from every cached prefix that ends on a page boundary (a tuple of
token ids) to the KV slots of its last page; the longest cached prefix of a sequence is then the
longest run of its page prefixes in the dict. Requests are simulated as the scheduler runs them: match and lock at admission, take
fresh slots for the rest from the real :class:`KVPool`, hand everything back with
``cache_finished`` (or ``cache_unfinished`` midway). After every step the books must balance:
each slot is exactly one of free, held by the tree, or held by an open request.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sgl_cache_radix.radix_cache import RadixCache

from sgl.kvcache import KVPool, PrefixMatch

POOL = 96
tokens = st.lists(st.integers(0, 3), min_size=0, max_size=14)


@dataclass
class OpenRequest:
    seq: list[int]
    slots: torch.Tensor  # one per token of seq: the match's, then its own
    match: PrefixMatch


class RadixMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(size=POOL, num_layers=1, num_kv_heads=1, head_dim=1,
                           dtype=torch.float32, device=torch.device("cpu"))
        self.cache = RadixCache(kv_pool=self.pool, page_size=self.page_size)
        self.ref: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.open: list[OpenRequest] = []

    # --- the reference ------------------------------------------------------------------------

    def ref_match(self, seq: list[int]) -> list[int]:
        slots: list[int] = []
        for end in range(self.page_size, len(seq) + 1, self.page_size):
            page = self.ref.get(tuple(seq[:end]))
            if page is None:
                break
            slots += page
        return slots

    def ref_insert(self, req: OpenRequest) -> None:
        for end in range(self.page_size, len(req.seq) + 1, self.page_size):
            page = tuple(req.slots[end - self.page_size:end].tolist())
            self.ref.setdefault(tuple(req.seq[:end]), page)

    def sync_evicted(self) -> None:
        kept = set(self.cache.all_slots().tolist())
        self.ref = {k: v for k, v in self.ref.items() if set(v) <= kept}

    # --- rules --------------------------------------------------------------------------------

    @rule(seq=tokens)
    def begin(self, seq: list[int]) -> None:
        match = self.cache.match_prefix(seq)
        assert match.slots.tolist() == self.ref_match(seq), "not the longest cached prefix"
        self.cache.lock(match)
        need = len(seq) - len(match)
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
            self.sync_evicted()
        if need > self.pool.num_free:
            self.cache.unlock(match)
            return
        own = self.pool.alloc(need)
        self.open.append(OpenRequest(seq, torch.cat([match.slots, own]), match))

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        self.ref_insert(req)
        self.cache.cache_finished(req.seq, req.slots, req.match)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def midway(self, data: st.DataObject) -> None:
        """A prefill chunk ends: the computed prefix goes into the tree, the request goes on."""
        req = self.open[data.draw(st.integers(0, len(self.open) - 1))]
        cut = data.draw(st.integers(len(req.match), len(req.seq)))
        self.ref_insert(OpenRequest(req.seq[:cut], req.slots[:cut], req.match))
        new = self.cache.cache_unfinished(req.seq[:cut], req.slots[:cut], req.match)
        assert new.slots.tolist() == self.ref_match(req.seq[:cut])
        req.slots = torch.cat([new.slots, req.slots[len(new):]])
        req.match = new

    @rule(n=st.integers(0, POOL))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_tokens
        free_before = self.pool.num_free
        freed = self.cache.evict(n)
        assert self.pool.num_free == free_before + freed
        assert freed >= min(n, evictable), "evicted less than asked while it could"
        self.sync_evicted()

    @rule()
    def flush(self) -> None:
        flushed = self.cache.flush()
        assert flushed == (not self.open or all(len(r.match) == 0 for r in self.open))
        if flushed:
            self.ref.clear()

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        tree = self.cache.all_slots().tolist()
        free = self.pool._free[POOL - self.pool.num_free:].tolist()
        owned = [s for r in self.open for s in r.slots[len(r.match):].tolist()]
        everything = tree + free + owned
        assert len(everything) == len(set(everything)), "a slot is held twice"
        assert sorted(everything) == list(range(1, POOL + 1)), "a slot was lost"
        assert self.cache.cached_tokens == len(tree)

    @invariant()
    def locked_prefixes_stay(self) -> None:
        for req in self.open:
            match = self.cache.match_prefix(req.seq[:len(req.match)])
            assert torch.equal(match.slots, req.match.slots), "a locked prefix was evicted"
        locked = self.cache.locked_tokens
        assert self.cache.evictable_tokens + locked == self.cache.cached_tokens
        if not self.open:
            assert locked == 0

    @invariant()
    def reference_agrees(self) -> None:
        ref_slots = [slot for page in self.ref.values() for slot in page]
        assert sorted(ref_slots) == sorted(self.cache.all_slots().tolist())


class RadixMachinePaged(RadixMachine):
    page_size = 4


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestRadixTree = RadixMachine.TestCase
TestRadixTree.settings = _settings
TestRadixTreePaged = RadixMachinePaged.TestCase
TestRadixTreePaged.settings = _settings


def test_split_keeps_locks_and_shares_prefix() -> None:
    pool = KVPool(size=32, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                  device=torch.device("cpu"))
    cache = RadixCache(kv_pool=pool)
    a = pool.alloc(6)
    cache.cache_finished([1, 2, 3, 4, 5, 6], a, PrefixMatch())
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.slots.tolist() == a[:3].tolist()
    cache.lock(match)
    assert cache.locked_tokens == 3 and cache.evictable_tokens == 3
    assert cache.evict(100) == 3  # only the unlocked tail [4, 5, 6] can go
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == a[:3].tolist()
    assert not cache.flush()  # locked
    cache.unlock(match)
    assert cache.flush() and pool.num_free == 32


def test_eviction_is_lru_and_sessions_go_last() -> None:
    pool = KVPool(size=32, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                  device=torch.device("cpu"))
    cache = RadixCache(kv_pool=pool)
    for seq in ([1, 1], [2, 2], [3, 3]):
        cache.cache_finished(seq, pool.alloc(2), PrefixMatch())
    protected = cache.match_prefix([1, 1])
    cache.protect(protected)  # the oldest, but a session holds it
    cache.match_prefix([2, 2])  # touch: now newer than [3, 3]
    assert cache.evict(2) == 2
    assert len(cache.match_prefix([3, 3])) == 0  # least recently used, unprotected: gone
    assert cache.evict(2) == 2
    assert len(cache.match_prefix([2, 2])) == 0
    assert len(cache.match_prefix([1, 1])) == 2  # the session's prefix went last
    cache.unprotect(protected)
    assert cache.evict(2) == 2 and pool.num_free == 32


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_are_whole(page_size: int) -> None:
    pool = KVPool(size=64, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                  device=torch.device("cpu"))
    cache = RadixCache(kv_pool=pool, page_size=page_size)
    seq = list(range(10))
    cache.cache_finished(seq, pool.alloc(10), PrefixMatch())
    kept = 10 - 10 % page_size
    assert cache.cached_tokens == kept and pool.num_free == 64 - kept
    assert len(cache.match_prefix(seq[:7])) == 7 - 7 % page_size
