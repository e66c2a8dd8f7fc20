"""``sgl-model-llama`` through the ModelRunner, against transformers.

A tiny random Llama (saved as safetensors) is checked logit by logit over a ragged extend, an
extend on cached prefixes and decode steps, and by greedy generation; the bundled SmolLM2 GGUF
is checked by greedy generation against transformers loading the same file.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.forward_batch import ForwardMode
from sgl.engine.model_runner import ModelRunner
from sgl.plugins import create_plugin_manager

# float32 on CPU: sgl and transformers differ only in summation order
ATOL = 1e-4

TINY_VARIANTS = {
    "untied": {"tie_word_embeddings": False},
    "tied-bias-llama3": {
        "tie_word_embeddings": True,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32},
    },
}


def test_plugin_is_installed() -> None:
    pm = create_plugin_manager()
    assert pm.records["model-llama"].available
    assert pm.records["model-llama"].hooks == ["sgl_register_gguf_archs",
                                               "sgl_register_model_archs"]
    assert pm.registries.gguf_archs.entry("llama").target == "sgl_model_llama.gguf:LLAMA"
    entry = pm.registries.models.entry("LlamaForCausalLM")
    assert entry.owner == "model-llama"
    assert entry.target == "sgl_model_llama.model:LlamaForCausalLM"


def make_runner(path: str | None, **kwargs: Any) -> ModelRunner:
    pm = create_plugin_manager()
    kwargs.setdefault("dtype", "float32")  # transformers' reference dtype
    return ModelRunner(model_path=path, registries=pm.registries, plugin_manager=pm,
                       show_progress=False, **kwargs)


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny(request: pytest.FixtureRequest, model_isa: str,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelRunner]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, **TINY_VARIANTS[request.param])
    reference = LlamaForCausalLM(config).eval()
    if config.attention_bias:  # zero-initialised by default; make them matter
        for layer in reference.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(std=0.5)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    runner = make_runner(str(folder), max_total_tokens=2048, max_running_requests=8)
    return reference, runner


def test_runner_shape(tiny: tuple[Any, ModelRunner]) -> None:
    _, runner = tiny
    assert runner.architecture == "LlamaForCausalLM"
    assert (runner.dtype, runner.vocab_size, runner.context_length) == (torch.float32, 256, 256)
    assert runner.kv_pool.size == 2048 and runner.kv_pool.num_layers == 2
    assert runner.kv_pool_bytes == 2048 * 2 * 2 * (16 + 16) * 4
    # without max_total_tokens the pool is sized from free memory, capped at
    # max_running_requests x context_length
    sized = make_runner(str(runner.model_path), max_running_requests=3, mem_fraction=0.5)
    assert sized.kv_pool.size == 3 * 256
    with pytest.raises(LookupError, match="unknown attention backend 'nope'; available: .*torch"):
        make_runner(str(runner.model_path), attention_backend="nope", max_total_tokens=64)


def reference_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0]


def test_ragged_extend_prefix_extend_and_decode(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    free = runner.kv_pool.num_free
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 1, 33)]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]

    # 1. one extend with all prompts: every position's logits match
    batch = make_forward_batch(runner, ForwardMode.EXTEND, list(zip(rows, [0] * 4, prompts)))
    hidden = runner.forward(batch)
    logits = runner.logits_at(hidden, torch.arange(batch.num_tokens))
    expected = torch.cat([reference_logits(reference, p) for p in prompts])
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)

    # 2. a second extend on top of the cached prompts
    more = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 1, 8, 2)]
    seqs = [BatchSeq(row, len(p), m) for row, p, m in zip(rows, prompts, more)]
    logits = runner.forward_logits(make_forward_batch(runner, ForwardMode.EXTEND, seqs))
    texts = [p + m for p, m in zip(prompts, more)]
    expected = torch.stack([reference_logits(reference, t)[-1] for t in texts])
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)

    # 3. decode steps, feeding each sequence its greedy token
    for _ in range(4):
        next_ids = logits.argmax(-1).tolist()
        seqs = [BatchSeq(row, len(t), [n]) for row, t, n in zip(rows, texts, next_ids)]
        logits = runner.forward_logits(make_forward_batch(runner, ForwardMode.DECODE, seqs))
        texts = [t + [n] for t, n in zip(texts, next_ids)]
        expected = torch.stack([reference_logits(reference, t)[-1] for t in texts])
        torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)

    for row, text in zip(rows, texts):
        release_sequence(runner, row, len(text))
    assert runner.kv_pool.num_free == free
    assert runner.req_to_token_pool.num_free == 8


def greedy(runner: ModelRunner, prompts: Sequence[Sequence[int]], steps: int) -> list[list[int]]:
    """Greedy decoding of several prompts batched together; returns the new tokens."""
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    batch = make_forward_batch(runner, ForwardMode.EXTEND,
                               [BatchSeq(r, 0, p) for r, p in zip(rows, prompts)])
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    for step in range(steps):
        next_ids = runner.forward_logits(batch).argmax(-1).tolist()
        for out, token in zip(outputs, next_ids):
            out.append(token)
        if step == steps - 1:
            break
        batch = make_forward_batch(runner, ForwardMode.DECODE,
                                   [BatchSeq(r, n, [t]) for r, n, t in zip(rows, lengths, next_ids)])
        lengths = [n + 1 for n in lengths]
    for row, n in zip(rows, lengths):
        release_sequence(runner, row, n)
    return outputs


def hf_greedy(model: Any, prompt: Sequence[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 2, 20)]
    got = greedy(runner, prompts, steps=32)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(reference, prompt, 32)


# -- the bundled SmolLM2-135M-Instruct GGUF ----------------------------------------------------

@dataclass
class SmolLM2:
    reference: Any  # transformers model with the GGUF converted by transformers itself
    reference_state: dict[str, torch.Tensor]
    tokenizer: Any
    runner: ModelRunner


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sgl.model_loader import bundled_model_path, load_tokenizer

    runner = make_runner(None, dtype="float32", max_total_tokens=4096, max_running_requests=8)
    path = bundled_model_path()
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(runner.hf_config))
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=reference)
    reference.load_state_dict(state["tensors"], strict=False)
    reference.tie_weights()
    reference.eval()
    return SmolLM2(reference, state["tensors"], load_tokenizer(path), runner)


@pytest.mark.slow
def test_gguf_weights_match_transformers(smollm2: SmolLM2) -> None:
    """iter_weights' GGUF stream (names, shapes, values, q/k un-permuted) equals transformers'."""
    from sgl.model_loader import open_weights

    expected_state = smollm2.reference_state
    wanted = {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    }
    source = open_weights(None, torch.float32)
    assert len(source) == len(expected_state) == 272
    seen = set()
    for name, tensor in source:
        assert name in expected_state, name
        if name in wanted:
            expected = torch.as_tensor(expected_state[name]).float()
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
            seen.add(name)
    assert seen == wanted


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: on a small shared machine, two threads run up to 10x slower while
    another process keeps a core busy (docs/benchmarks.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_smollm2_greedy_matches_transformers(smollm2: SmolLM2) -> None:
    """64 greedy tokens for five chat prompts of different lengths, run as one ragged batch in
    sgl, equal token for token to transformers' float32 ``generate`` run prompt by prompt."""
    reference, tokenizer, runner = smollm2.reference, smollm2.tokenizer, smollm2.runner
    assert runner.dtype == torch.float32 and type(runner.model).__name__ == "LlamaForCausalLM"
    prompts = [chat_ids(tokenizer, text) for text in (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue.",
        "Give me three tips for learning to cook.",
        "What is 17 times 23? Show your working.",
    )]
    got = greedy(runner, prompts, steps=64)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(reference, prompt, 64), tokenizer.decode(tokens)
    assert tokenizer.decode(got[0]).startswith("The capital of France is Paris.")
