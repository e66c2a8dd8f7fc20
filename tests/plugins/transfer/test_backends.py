"""The KV transfer backends (``tcp``, ``mooncake``, ``fake``), each found through the plugin
manager as the core finds it: a prefill-side and a decode-side instance in one process over
loopback, with small KV pools of random rows, checked byte for byte.

The mooncake tests fail when the plugin is unavailable (CI installs Debian's libibverbs1 for
it), unless ``SGL_TEST_ALLOW_NO_MOONCAKE=1``: then they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import random
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl.plugins import PluginLoadError, PluginSelection, SglPluginManager, create_plugin_manager
from sgl.transfer import BaseKVTransfer, KVBuffers, KVTransferError, slot_runs

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake's engine logs every start at INFO

#: backend name -> (plugin id, class)
BACKENDS = {
    "tcp": ("transfer-tcp", "sgl_transfer_tcp.backend:TcpKVTransfer"),
    "mooncake": ("transfer-mooncake", "sgl_transfer_mooncake.backend:MooncakeKVTransfer"),
    "fake": ("transfer-fake", "sgl_transfer_fake.backend:FakeKVTransfer"),
}
#: the backends that move bytes
MOVING = ["tcp", "mooncake"]

SLOTS = 64  # row 0 is the padding slot: 65 rows
PAGE = 16
#: per layer (K, V): shape of one row and dtype; row widths differ (6 to 64 bytes), so that
#: a byte landing in the wrong buffer or at the wrong offset shows
LAYERS = [
    (((2, 8), torch.bfloat16), ((2, 4), torch.bfloat16)),
    (((1, 3), torch.bfloat16), ((1, 5), torch.bfloat16)),
    (((2, 8), torch.float32), ((2, 4), torch.float32)),
    (((1, 3), torch.float32), ((2, 4), torch.float32)),
]


@pytest.fixture(scope="module")
def pm() -> SglPluginManager:
    return create_plugin_manager(PluginSelection())


def backend_class(pm: SglPluginManager, name: str) -> type[BaseKVTransfer]:
    """The class registered as ``name``; for an unavailable plugin, a failure naming why (a
    skip for mooncake under SGL_TEST_ALLOW_NO_MOONCAKE=1)."""
    record = pm.records.get(BACKENDS[name][0])
    assert record is not None, f"plugin {BACKENDS[name][0]} is not installed"
    if not record.available:
        if name == "mooncake" and os.environ.get("SGL_TEST_ALLOW_NO_MOONCAKE") == "1":
            pytest.skip(f"mooncake is unavailable: {record.reason}")
        pytest.fail(f"plugin {record.name} is unavailable: {record.reason}")
    return pm.registries.transfer.load(name)


def make_buffers(seed: int) -> KVBuffers:
    gen = torch.Generator().manual_seed(seed)
    return KVBuffers([torch.randn(SLOTS + 1, *shape, generator=gen).to(dtype)
                      for layer in LAYERS for shape, dtype in layer])


@pytest.fixture
def pair(pm: SglPluginManager, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """(prefill, decode) instances of the backend named by the test's parameter."""
    cls = backend_class(pm, request.param)
    prefill = cls(make_buffers(1), role="prefill", host="127.0.0.1")
    decode = cls(make_buffers(2), role="decode", host="127.0.0.1")
    yield prefill, decode
    prefill.close()
    decode.close()


def snapshot(buffers: KVBuffers) -> list[torch.Tensor]:
    return [t.clone() for t in buffers.tensors]


def assert_written(prefill: BaseKVTransfer, decode: BaseKVTransfer, before: list[torch.Tensor],
                   src: list[int], dst: list[int]) -> None:
    """Rows ``dst`` of the decode side hold rows ``src`` of the prefill side bit for bit; no
    other row of the decode side changed."""
    untouched = torch.ones(SLOTS + 1, dtype=torch.bool)
    untouched[dst] = False
    for i, (mine, theirs, old) in enumerate(zip(prefill.buffers.tensors,
                                                decode.buffers.tensors, before)):
        assert torch.equal(theirs[dst].view(torch.uint8), mine[src].view(torch.uint8)), \
            f"buffer {i}: the written rows differ from the source rows"
        assert torch.equal(theirs[untouched].view(torch.uint8),
                           old[untouched].view(torch.uint8)), f"buffer {i}: other rows changed"


def assert_unchanged(decode: BaseKVTransfer, before: list[torch.Tensor]) -> None:
    for i, (now, old) in enumerate(zip(decode.buffers.tensors, before)):
        assert torch.equal(now.view(torch.uint8), old.view(torch.uint8)), f"buffer {i} changed"


def pages_and_scattered(seed: int) -> tuple[list[int], list[int]]:
    """Two whole pages, a part of a third and some scattered slots, each side its own."""
    rng = random.Random(seed)

    def slots() -> list[int]:
        pages = rng.sample(range(SLOTS // PAGE), 3)
        out = [p * PAGE + 1 + i for p in pages[:2] for i in range(PAGE)]
        out += [pages[2] * PAGE + 1 + i for i in range(5)]
        rest = [s for s in range(1, SLOTS + 1) if s not in out]
        return out + rng.sample(rest, 9)

    return slots(), slots()


def dead_endpoint() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# slot_runs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("src,dst,runs", [
    ([], [], []),
    ([5], [9], [(5, 9, 1)]),
    ([1, 2, 3, 4], [17, 18, 19, 20], [(1, 17, 4)]),
    ([1, 2, 3, 7, 8], [10, 11, 12, 13, 14], [(1, 10, 3), (7, 13, 2)]),  # src jumps
    ([1, 2, 3], [10, 12, 13], [(1, 10, 1), (2, 12, 2)]),  # dst jumps
    ([3, 2, 1], [1, 2, 3], [(3, 1, 1), (2, 2, 1), (1, 3, 1)]),  # going down is no run
    ([4, 5, 4, 5], [8, 9, 10, 11], [(4, 8, 2), (4, 10, 2)]),
])
def test_slot_runs(src: list[int], dst: list[int], runs: list[tuple[int, int, int]]) -> None:
    assert slot_runs(src, dst) == runs


def test_slot_runs_cover_every_pair() -> None:
    rng = random.Random(0)
    src = rng.sample(range(1000), 300)
    dst = list(range(40, 340))
    pairs = [(s + k, d + k) for s, d, n in slot_runs(src, dst) for k in range(n)]
    assert pairs == list(zip(src, dst))


# registration ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_is_registered(pm: SglPluginManager, name: str) -> None:
    plugin_id, target = BACKENDS[name]
    cls = backend_class(pm, name)
    assert pm.records[plugin_id].hooks == ["sgl_register_kv_transfer_backends"]
    entry = pm.registries.transfer.entry(name)
    assert entry.owner == plugin_id and entry.target == target
    assert issubclass(cls, BaseKVTransfer) and cls.name == name


def test_a_plugin_that_cannot_run_here_is_listed_unavailable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = "sgl_transfer_toy_unavailable"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent('''
        from sgl import hookimpl

        SGL_UNAVAILABLE = "needs a frobnicator (apt-get install frobnicator)"

        @hookimpl
        def sgl_register_kv_transfer_backends(register):
            register("toy", "sgl_transfer_toy_unavailable:Nothing")
    '''))
    info = tmp_path / "sgl_transfer_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sgl-transfer-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[sgl]\ntransfer-toy = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = create_plugin_manager(PluginSelection())
    record = pm.records["transfer-toy"]
    assert not record.available
    assert record.reason == "needs a frobnicator (apt-get install frobnicator)"
    assert "toy" not in pm.registries.transfer
    with pytest.raises(PluginLoadError, match="needs a frobnicator"):
        create_plugin_manager(PluginSelection(load=("transfer-toy",)))


def test_mooncake_without_libibverbs_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    import sgl_transfer_mooncake.plugin as plugin

    real = ctypes.CDLL

    def cdll(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "libibverbs.so.1":
            raise OSError("libibverbs.so.1: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    reason = plugin._unavailable()
    assert reason is not None and "libibverbs.so.1" in reason
    assert "install Debian's libibverbs1 (apt-get install libibverbs1)" in reason


# moving bytes ----------------------------------------------------------------------------------

def expect(decode: Any, room: int, dst: list[int]) -> dict[str, Any]:
    """Announce ``room`` on the decode side; what the prefill side is told (as the core's
    want does: the backend's info and this transfer's own fields)."""
    return {**decode.local_info(), **(decode.expect(room, dst) or {})}


@pytest.mark.parametrize("pair", MOVING, indirect=True)
def test_write_lands_exactly_in_the_destination_rows(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    row_bytes = sum(prefill.buffers.row_bytes)
    for room, seed in enumerate((1, 2, 3)):
        src, dst = pages_and_scattered(seed)
        before = snapshot(decode.buffers)
        agent = expect(decode, room, dst)
        assert prefill.write(agent, room, src, dst, timeout=10) == len(src) * row_bytes
        decode.forget(room)
        assert_written(prefill, decode, before, src, dst)
    # one whole run, and one single slot
    for room, (src, dst) in enumerate([(list(range(1, 65)), list(range(1, 65))),
                                       ([7], [64])], start=10):
        before = snapshot(decode.buffers)
        agent = expect(decode, room, dst)
        assert prefill.write(agent, room, src, dst, timeout=10) == len(src) * row_bytes
        assert_written(prefill, decode, before, src, dst)


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_tcp_refuses_rooms_it_does_not_expect(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    src, dst = pages_and_scattered(4)
    before = snapshot(decode.buffers)
    with pytest.raises(KVTransferError, match="room 5 is not expected"):
        prefill.write(decode.local_info(), 5, src, dst, timeout=5)
    agent = expect(decode, 6, dst)
    decode.forget(6)
    with pytest.raises(KVTransferError, match="room 6 is not expected"):
        prefill.write(agent, 6, src, dst, timeout=5)
    agent = expect(decode, 7, dst[:-1])
    with pytest.raises(KVTransferError, match="are not room 7's"):
        prefill.write(agent, 7, src, dst, timeout=5)
    # a writer that knows the room and the slots but did not see the want: no token
    agent = expect(decode, 9, dst)
    for wrong in ({}, {"token": "0" * 32}, {"token": expect(decode, 10, dst)["token"]}):
        with pytest.raises(KVTransferError, match="does not carry the room's token"):
            prefill.write({**agent, "token": None, **wrong}, 9, src, dst, timeout=5)
    assert_unchanged(decode, before)
    # the refusals leave nothing behind: the next write goes through
    prefill.write(agent, 9, src, dst, timeout=5)
    assert_written(prefill, decode, before, src, dst)


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_tcp_write_to_a_dead_endpoint_fails_within_its_timeout(pair: tuple[Any, Any]) -> None:
    prefill, _ = pair
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no answer for room 3 within 1 s"):
        prefill.write({"endpoint": f"tcp://127.0.0.1:{dead_endpoint()}"}, 3, [1, 2], [3, 4],
                      timeout=1.0)
    assert time.monotonic() - start < 1.0 + 1.0


@pytest.mark.parametrize("pair", ["mooncake"], indirect=True)
def test_mooncake_refuses_what_it_can_check_and_reports_failures(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    before = snapshot(decode.buffers)
    info = decode.local_info()
    with pytest.raises(KVTransferError, match="bytes a row"):
        prefill.write({**info, "row_bytes": [8] * len(info["addrs"])}, 1, [1], [1], timeout=5)
    with pytest.raises(KVTransferError, match="outside the decode side's 65 rows"):
        prefill.write(info, 1, [1, 2], [64, 65], timeout=5)
    assert_unchanged(decode, before)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="failed"):
        prefill.write({**info, "session": f"127.0.0.1:{dead_endpoint()}"}, 1, [1], [1],
                      timeout=5)
    assert time.monotonic() - start < 5


def test_fake_moves_nothing(pm: SglPluginManager) -> None:
    cls = backend_class(pm, "fake")
    prefill = cls(make_buffers(1), role="prefill", host="127.0.0.1")
    decode = cls(make_buffers(2), role="decode", host="127.0.0.1")
    before = snapshot(decode.buffers)
    assert prefill.write(expect(decode, 1, [3, 4]), 1, [1, 2], [3, 4], timeout=1) == 0
    assert_unchanged(decode, before)
    prefill.close()
    decode.close()


def test_link_codec_authenticates_with_the_secret() -> None:
    """The disaggregation link's messages: with a secret, an HMAC envelope that verifies only
    with the same secret and the same body; without one, plain JSON (an envelope is read but
    never counts as authenticated)."""
    from sgl_disaggregation.link import LinkCodec

    msg = {"type": "done", "room": 7, "token": 42, "seconds": 0.1}
    codec, other, none = LinkCodec("s" * 16), LinkCodec("t" * 16), LinkCodec(None)
    raw = codec.dumps(msg)
    assert codec.loads(raw) == (msg, True)
    assert other.loads(raw) == (msg, False)
    assert none.loads(raw) == (msg, False)
    envelope = json.loads(raw)
    envelope["body"] = envelope["body"].replace("42", "43")
    assert codec.loads(json.dumps(envelope).encode())[1] is False
    assert codec.loads(none.dumps(msg)) == (msg, False)
    assert json.loads(none.dumps(msg)) == msg
    for bad in (b"[1]", b"not json", json.dumps({"mac": "x", "body": "[1]"}).encode()):
        with pytest.raises(ValueError):
            codec.loads(bad)
