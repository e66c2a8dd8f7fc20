"""``--device``: every tensor a request's forward, logits and sampling create follows the
runner's device, and the flags of one device are refused on the other.

The request runs on torch's ``meta`` device: tensors there have shapes and dtypes but no
data, so a host round trip (``.item()``, ``.tolist()``, ``bool(tensor)``) raises at once, and a
torch dispatch mode notes every op that mixes a host tensor into the device's computation (a
hard-coded or forgotten ``device``) or moves a device tensor to the host. The host-side
planning of the batch builder (the pool's free list, positions built on the host and then
uploaded) creates host tensors from host tensors only, which is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl.config import ConfigError, load_settings
from sgl.devices import resolve_device
from sgl.engine import sampler as sampler_module
from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.engine.memory import DEFAULT_CPU_MEM_FRACTION, kv_pool_bytes
from sgl.engine.model_runner import ModelRunner
from sgl.engine.sampler import SamplingInput, apply_token_bitmask, sample_next_tokens
from sgl.forward_batch import ForwardMode
from sgl.plugins import create_plugin_manager
from sgl.sampling import SamplingParams
from sgl_testing import write_tiny_llama

META = torch.device("meta")


class DeviceWatch(TorchDispatchMode):
    """Notes the ops that take a tensor on ``device`` and either another non-scalar tensor on
    the host or return a host tensor."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.strays: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in _tensors((args, kwargs))]
        on_device = [t for t in inputs if t.device.type == self.device.type]
        if on_device:
            host_in = [t for t in inputs if t.device.type == "cpu" and t.dim() > 0]
            host_out = [t for t in _tensors(out) if t.device.type == "cpu"]
            if host_in or host_out:
                self.strays.append(f"{func}: inputs on {[str(t.device) for t in inputs]}, "
                                   f"outputs on {[str(t.device) for t in _tensors(out)]}")
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-device"))


@pytest.fixture(scope="module")
def meta_runner(model_dir: Path) -> ModelRunner:
    pm = create_plugin_manager()
    return ModelRunner(model_path=str(model_dir), dtype="float32", registries=pm.registries,
                       plugin_manager=pm, max_total_tokens=512, max_running_requests=4,
                       show_progress=False, device="meta")


def sampling_input(n: int) -> SamplingInput:
    """Every sampler feature at once: greedy, temperature with top-k/top-p/min-p, penalties,
    logit bias and banned tokens."""
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                                               frequency_penalty=0.5, presence_penalty=0.2,
                                               repetition_penalty=1.3, logit_bias={7: 2.0})]
    params = (params * n)[:n]
    return SamplingInput(params=params, seeds=list(range(n)), steps=[3] * n,
                         output_ids=[[1, 2, 2]] * n, prompt_ids=[[5, 6]] * n,
                         banned=[[0]] * n)


def run_request(runner: ModelRunner, watch: DeviceWatch) -> list[torch.Tensor]:
    """Prefill two prompts, prefill a third on the first one's cached prefix, decode all
    three, and compute logits and sample (with a grammar's bitmask) after each forward: the
    tensors that should be on the device."""
    table = runner.req_to_token_pool.req_to_token
    rows = [runner.req_to_token_pool.alloc() for _ in range(3)]
    results = []
    with torch.inference_mode(), watch:  # as the scheduler runs a step
        first = make_forward_batch(runner, ForwardMode.EXTEND,
                                   [BatchSeq(rows[0], 0, [1, 2, 3, 4]),
                                    BatchSeq(rows[1], 0, [5, 6])])
        hidden = runner.forward(first)
        prefix = table[rows[0], :3]
        cached = make_forward_batch(runner, ForwardMode.EXTEND,
                                    [BatchSeq(rows[2], 3, [9, 10], prefix_slots=prefix)])
        results += [hidden, runner.forward(cached)]
        decode = make_forward_batch(runner, ForwardMode.DECODE,
                                    [BatchSeq(rows[0], 4, [11]), BatchSeq(rows[1], 2, [12]),
                                     BatchSeq(rows[2], 5, [13])])
        hidden = runner.forward(decode)
        logits = runner.logits_at(hidden, torch.tensor([0, 1, 2]))
        bitmask = torch.full((1, (runner.vocab_size + 31) // 32), -1, dtype=torch.int32)
        apply_token_bitmask(logits, bitmask, [1])  # a grammar's mask arrives from the host
        ids = sample_next_tokens(logits, sampling_input(3))
        results += [hidden, logits, ids]
        results += [decode.input_ids, decode.positions, decode.req_pool_indices,
                    decode.seq_lens, decode.out_cache_loc]
    for row in rows:
        runner.req_to_token_pool.free(row)
    return results


def test_a_request_stays_on_the_device(meta_runner: ModelRunner) -> None:
    runner = meta_runner
    assert runner.kv_pool.k_buffer[0].device == META
    assert runner.req_to_token_pool.req_to_token.device == META
    assert all(p.device == META for p in runner.model.parameters())
    watch = DeviceWatch(META)
    results = run_request(runner, watch)
    assert watch.strays == []
    assert [t.device for t in results] == [META] * len(results)
    assert results[-6].shape == (3,) and results[-6].dtype == torch.int64  # the sampled ids


def test_a_tensor_left_on_the_host_is_caught(meta_runner: ModelRunner,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The run above fails when sampling forgets the device: here the noise is drawn on the
    host."""
    def forgetful(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
        return torch.rand(seeds.shape[0], vocab).clamp_min(1e-6)  # no device: the host's

    monkeypatch.setattr(sampler_module, "uniform_noise", forgetful)
    with pytest.raises(RuntimeError, match="not on the expected device meta"):
        run_request(meta_runner, DeviceWatch(META))


def test_the_watch_notes_host_tensors_that_torch_lets_through() -> None:
    """Indexing a device tensor with host indices works on every device (torch copies them),
    so only the watch sees it."""
    watch = DeviceWatch(META)
    with watch:
        torch.zeros(4, 5, device=META).index_select(0, torch.tensor([1, 2]))
    assert len(watch.strays) == 1 and "index_select" in watch.strays[0]


def test_a_host_round_trip_raises_on_the_device() -> None:
    """What makes the meta run strict: reading a device tensor's values on the host."""
    with pytest.raises(RuntimeError):
        bool((torch.zeros(3, device=META) > 0).any())


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(torch.device("meta")) == META
    with pytest.raises(ValueError, match="unknown device 'tpu9'"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: torch .* (without CUDA|no GPU)"):
            resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine "
                    "without a GPU; a GPU machine runs benchmarks/gpu_check.sh")
@pytest.mark.parametrize(("cli", "key", "message"), [
    ({"device": "cuda"}, "device", "--device cuda: torch"),
    ({"disable_cuda_graph": True}, "disable_cuda_graph", "CUDA graphs need --device cuda"),
    ({"cuda_graph_max_bs": 16}, "cuda_graph_max_bs", "CUDA graphs need --device cuda"),
    ({"device": "cpu", "cuda_graph_max_bs": 16}, "cuda_graph_max_bs", "--disable-cpu-graph"),
])
def test_gpu_settings_are_refused_without_a_gpu(cli: dict[str, Any], key: str,
                                               message: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'.*{message}"):
        load_settings(cli=cli, env={})


def test_settings_keep_the_cpu_defaults() -> None:
    settings = load_settings(cli={}, env={})
    assert (settings.device, settings.mem_fraction_static) == ("auto", None)
    assert not settings.disable_cuda_graph and settings.cuda_graph_max_bs is None


def test_kv_pool_bytes_on_cpu_is_a_share_of_the_available_memory() -> None:
    from sgl.engine.memory import available_memory_bytes

    cpu = torch.device("cpu")
    available = available_memory_bytes(cpu)
    assert available > 0
    assert abs(kv_pool_bytes(cpu, None) - available * DEFAULT_CPU_MEM_FRACTION) < 0.01 * available
    assert abs(kv_pool_bytes(cpu, 0.5) - available * 0.5) < 0.01 * available
    with pytest.raises(ValueError, match=r"mem_fraction must be in \(0, 1\]"):
        kv_pool_bytes(cpu, 1.5)


def test_kv_pool_bytes_on_a_gpu_follows_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's rule: the weights and the pool take ``mem_fraction`` of the GPU's total memory
    together. There is no GPU here, so ``torch.cuda.mem_get_info`` is replaced by the figures
    of an 80 GiB GPU with 70 GiB free after loading the weights (a stand-in: this machine
    cannot cause them)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    cuda = torch.device("cuda")
    assert kv_pool_bytes(cuda, 0.9) == int(70 * 2**30 - 80 * 2**30 * 0.1)
    assert kv_pool_bytes(cuda, None) == int(70 * 2**30 - 80 * 2**30 * 0.15)  # 0.85
    assert kv_pool_bytes(cuda, 0.1) == 0  # the weights already take more than that


def test_collectives_follow_the_device() -> None:
    from sgl_parallel_tp.strategy import collective_backend

    assert collective_backend(torch.device("cpu")) == "gloo"
    assert collective_backend(torch.device("cuda", 1)) == "nccl"
