"""Tensor parallelism (sgl-parallel-tp): real ranks (spawned scheduler processes talking through
torch.distributed with gloo on loopback) against one process on the same weights.

The tiny random-weight models cover what splitting must get right: heads split over ranks
(key/value heads replicated when there are fewer than ranks), q/k/v biases (Qwen2), experts
(Qwen2-MoE, split by their intermediate size), and vocabularies that do not divide by the
rank count (the padded rows of the vocab-parallel embedding and LM head). Every token's whole
distribution is compared (``token_ids_logprob`` over the vocabulary), plus the greedy tokens.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch

from sgl_testing import ServerProcess, free_port, run_cli

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 7, 250, 1, 30, 12, 4, 4, 19, 88]]
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"vocab_size": 1001, "num_key_value_heads": 2}),
    "llama-one-kv-head": ("LlamaConfig", {"vocab_size": 1000, "num_key_value_heads": 1,
                                          "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"vocab_size": 999, "num_key_value_heads": 2}),
    "qwen2-moe": ("Qwen2MoeConfig", {"vocab_size": 1003, "num_key_value_heads": 2,
                                     "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 96}),
    # fused qkv_proj / gate_up_proj in the checkpoint, split into the ranks' shards
    "phi3": ("Phi3Config", {"vocab_size": 1001, "num_key_value_heads": 2, "pad_token_id": 0}),
    # sliding windows shorter than the prompts
    "mistral": ("MistralConfig", {"vocab_size": 1001, "num_key_value_heads": 2,
                                  "sliding_window": 4}),
    # tied and scaled embedding, soft-capped attention and logits, alternating windows
    "gemma2": ("Gemma2Config", {"vocab_size": 999, "num_key_value_heads": 2, "head_dim": 16,
                                "sliding_window": 8, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
                                "tie_word_embeddings": True, "attn_implementation": "eager"}),
    # per-head q/k norms
    "qwen3": ("Qwen3Config", {"vocab_size": 1001, "num_key_value_heads": 2, "head_dim": 16}),
    # sandwich norms, local and global layers with their own rotary bases
    "gemma3": ("Gemma3TextConfig", {"vocab_size": 1001, "num_key_value_heads": 2,
                                    "head_dim": 16, "sliding_window": 8,
                                    "query_pre_attn_scalar": 24, "sliding_window_pattern": 2,
                                    "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
                                    "attn_implementation": "eager"}),
}


def save_tiny_model(path: Path, config_class: str, overrides: dict[str, Any]) -> Path:
    import transformers

    from sgl.model_loader import load_tokenizer

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256,
        "tie_word_embeddings": False, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # peaked distributions: greedy tokens are not near-ties
        model.get_output_embeddings().weight.mul_(20)
    model.save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)  # the scheduler loads one (for stop strings)
    return path


def run_engine(path: Path | None, tp_size: int, vocab: int) -> list[dict[str, Any]]:
    """Greedy outputs of PROMPTS, with every output position's whole log-distribution."""
    import sgl

    # exact products: the ranks' partial sums of a row-parallel layer add in another order, and
    # int8 activations (the GGUF's default) would turn such last bits into steps of their grid
    engine = sgl.Engine(str(path) if path else None, dtype="float32", tp_size=tp_size,
                        int8_activations="off", max_total_tokens=2048, context_length=256,
                        log_level="warning",
                        max_logprobs=vocab)  # the whole distribution at each position
    try:
        assert engine.alive
        return engine.generate(input_ids=PROMPTS, sampling_params={
            "max_new_tokens": 6, "temperature": 0}, return_logprob=True,
            token_ids_logprob=list(range(vocab)))
    finally:
        engine.shutdown()


def distributions(output: dict[str, Any]) -> torch.Tensor:
    """``[positions, vocab]`` logprobs of each output position of one request."""
    return torch.tensor([[lp for lp, _, _ in position]
                         for position in output["meta_info"]["output_token_ids_logprobs"]])


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_equal_one(name: str, tmp_path: Path) -> None:
    config_class, overrides = MODELS[name]
    path = save_tiny_model(tmp_path / name, config_class, overrides)
    vocab = overrides["vocab_size"]
    one, two = run_engine(path, 1, vocab), run_engine(path, 2, vocab)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    for a, b in zip(one, two):
        p1, p2 = distributions(a), distributions(b)
        assert p1.shape == (6, vocab)
        torch.testing.assert_close(p2, p1, atol=2e-4, rtol=1e-4)
        # not degenerate: the distributions are far from flat and differ per position
        assert ((p1.max(-1).values - p1.min(-1).values) > 5.0).all()
        assert not torch.allclose(p1[0], p1[1])


def test_bundled_model_on_three_ranks() -> None:
    """SmolLM2 has 9 heads and 3 key/value heads: 3 ranks (sharing the 2 cores here)."""
    vocab = 49152
    one = run_engine(None, 1, 512)
    three = run_engine(None, 3, 512)
    assert [o["output_ids"] for o in three] == [o["output_ids"] for o in one]
    # the first 512 tokens' logprobs (normalised over the whole vocabulary, so a wrong shard
    # anywhere moves them)
    for a, b in zip(one, three):
        torch.testing.assert_close(distributions(b), distributions(a), atol=2e-3, rtol=1e-3)
    assert vocab % 3 == 0


def test_two_nodes_on_loopback_equal_two_ranks(tmp_path: Path) -> None:
    """``--nnodes 2``: two `sgl serve` processes of one rank each; node 0 serves HTTP and its
    greedy tokens are those of one process."""
    path = save_tiny_model(tmp_path / "llama", *MODELS["llama"])
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model-path", str(path), "--dtype", "float32", "--tp-size", "2", "--nnodes",
              "2", "--dist-init-addr", addr, "--max-total-tokens", "2048", "--context-length",
              "256", "--dist-timeout", "120"]
    node1_log = open(tmp_path / "node1.log", "w")  # noqa: SIM115
    import subprocess
    import sys

    node1 = subprocess.Popen([sys.executable, "-m", "sgl", "serve", *common, "--node-rank", "1"],
                             stdout=node1_log, stderr=subprocess.STDOUT)
    try:
        with ServerProcess(*common, "--node-rank", "0", log_path=tmp_path / "node0.log") as node0:
            response = httpx.post(f"{node0.base_url}/generate", timeout=120, json={
                "input_ids": PROMPTS[0],
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
            assert response.status_code == 200, response.text
            two_nodes = response.json()["output_ids"]
            info = httpx.get(f"{node0.base_url}/get_server_info", timeout=10).json()
            assert info["parallel"] == {"strategy": "tp", "tp_size": 2, "nnodes": 2}
        # node 0's leader stopped node 1's rank on the way out
        assert node1.wait(timeout=60) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
    log1 = (tmp_path / "node1.log").read_text()
    assert "tensor-parallel rank 1 of 2" in log1
    one = run_engine(path, 1, 8)
    assert two_nodes == one[0]["output_ids"]


def test_a_killed_rank_fails_requests_and_stops_the_server(tmp_path: Path) -> None:
    config_class, overrides = MODELS["llama"]
    path = save_tiny_model(tmp_path / "llama", config_class,
                           {**overrides, "max_position_embeddings": 4096})
    log = tmp_path / "server.log"
    server = ServerProcess("--model-path", str(path), "--dtype", "float32", "--tp-size", "2",
                           "--max-total-tokens", "4096", "--context-length", "4096",
                           log_path=log)
    try:
        match = re.search(r"tensor-parallel rank 1 of 2: pid (\d+)", server.log())
        assert match, server.log()
        # one machine: the ranks met through a file and gloo is on loopback, so no process
        # of the server listens beyond this machine (torch's TCP store would bind every
        # interface)
        tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(
            recursive=True)]
        assert len(tree) >= 3
        listening = {(c.laddr.ip, c.laddr.port) for proc in tree
                     for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        assert listening and all(ipaddress.ip_address(ip).is_loopback for ip, _ in listening), \
            listening
        result: dict[str, httpx.Response] = {}

        def long_request() -> None:
            result["response"] = httpx.post(f"{server.base_url}/generate", timeout=60, json={
                "input_ids": PROMPTS[0], "sampling_params": {
                    "max_new_tokens": 3000, "min_new_tokens": 3000, "temperature": 0}})

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(2.0)  # decoding now
        assert thread.is_alive()
        killed = time.monotonic()
        os.kill(int(match.group(1)), signal.SIGKILL)
        thread.join(timeout=30)
        assert time.monotonic() - killed < 5.0
        response = result["response"]
        assert response.status_code in (500, 503), response.text
        message = json.dumps(response.json())
        assert "rank 1" in message or "rank is gone" in message, message
        assert server.proc.wait(timeout=30) == 1
    finally:
        server.stop()


@pytest.mark.parametrize("args, expected", [
    (["--tp-size", "2"], "--tp-size 2: the model's 9 attention heads (3 key/value heads) "
                         "do not split evenly over 2 ranks; sizes that do: 1, 3, 9"),
    (["--tp-size", "2", "--disable-plugin", "parallel-tp"],
     "no installed plugin provides tensor parallelism"),
    (["--tp-size", "2", "--nnodes", "2"], "--dist-init-addr"),
    (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr",
      "127.0.0.1:1234"], "node_rank"),
    (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1234"],
     "multiple of --nnodes"),
    (["--tp-size", "2", "--dist-init-addr", "localhost"], "HOST:PORT"),
    (["--tp-size", "3", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
      "/nonexistent"], "not supported with --tp-size 3"),
])
def test_bad_settings_are_named(args: list[str], expected: str) -> None:
    result = run_cli(["serve", "--port", str(free_port()), *args], timeout=180)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_init_address_names_it(tmp_path: Path) -> None:
    """Node 1 alone: nobody listens at the address, so it gives up after --dist-timeout."""
    path = save_tiny_model(tmp_path / "llama", *MODELS["llama"])
    addr = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_cli(["serve", "--model-path", str(path), "--tp-size", "2", "--nnodes", "2",
                      "--node-rank", "1", "--dist-init-addr", addr, "--dist-timeout", "5"],
                     timeout=180)
    assert result.returncode == 1
    assert f"could not meet the other ranks at {addr} within 5 s" in result.stderr
    assert time.monotonic() - started < 120


def test_nodes_with_different_settings_are_refused(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "llama", *MODELS["llama"])
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model-path", str(path), "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr, "--dist-timeout", "60", "--max-total-tokens", "2048"]
    import subprocess
    import sys

    node1 = subprocess.Popen([sys.executable, "-m", "sgl", "serve", *common, "--node-rank", "1",
                              "--dtype", "bfloat16"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    node0 = run_cli(["serve", "--port", str(free_port()), *common, "--dtype", "float32"],
                    timeout=180)
    out1, _ = node1.communicate(timeout=60)
    assert node0.returncode == 1 and node1.returncode == 1
    for text in (node0.stderr, out1):
        assert "the ranks were started with different settings: --dtype" in text, text
