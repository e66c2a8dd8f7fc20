"""``sgl-model-qwen`` through the ModelRunner, against transformers.

For Qwen2 (untied, and tied with a sliding-window layer), Qwen3 (QK norm, explicit head_dim)
and Qwen2-MoE (4 experts top-2, shared expert, one dense layer), a tiny random model saved as
safetensors is checked logit by logit over a ragged extend, an extend on cached prefixes and
decode steps, and by greedy generation of a batch of prompts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.forward_batch import ForwardMode
from sgl.engine.model_runner import ModelRunner
from sgl.layers import Attention, FusedMoE
from sgl.plugins import Registries, create_plugin_manager
from sgl_testing import run_cli

# float32 on CPU: sgl and transformers differ only in summation order (observed max 2.4e-7)
ATOL = 1e-4

ARCHS = {
    "Qwen2ForCausalLM": "sgl_model_qwen.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sgl_model_qwen.qwen3:Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "sgl_model_qwen.qwen2_moe:Qwen2MoeForCausalLM",
}
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
# variant -> (transformers config class, overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    # layer 1 attends to the last 8 tokens only (prompts run past the window)
    "qwen2-tied-sliding": ("Qwen2Config", {"tie_word_embeddings": True,
                                           "use_sliding_window": True, "sliding_window": 8,
                                           "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 96,
                                     "mlp_only_layers": [1], "tie_word_embeddings": False}),
}


def test_plugin_is_installed() -> None:
    result = run_cli(["plugins", "--json"])
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["model-qwen"]["available"]
    assert plugins["model-qwen"]["distribution"] == "sgl-model-qwen"
    assert plugins["model-qwen"]["hooks"] == ["sgl_register_gguf_archs",
                                              "sgl_register_model_archs"]


@pytest.fixture(scope="module")
def registries() -> tuple[Registries, Any]:
    pm = create_plugin_manager()
    return pm.registries, pm


def test_architectures_are_registered(registries: tuple[Registries, Any]) -> None:
    models = registries[0].models
    for name, target in ARCHS.items():
        entry = models.entry(name)
        assert (entry.owner, entry.target) == ("model-qwen", target)


def _randomize(reference: Any) -> None:
    """Give the parameters transformers initialises to constants (biases, norms, the MoE
    router) random values, so that a mistake in using them shows."""
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight")):
                param.normal_(mean=1.0, std=0.2)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.normal_(std=0.5)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, model_isa: str,
         tmp_path_factory: pytest.TempPathFactory,
         registries: tuple[Registries, Any]) -> tuple[Any, ModelRunner]:
    import transformers

    config_name, overrides = VARIANTS[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**TINY, **overrides)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize(reference)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    runner = ModelRunner(model_path=str(folder), registries=registries[0],
                         plugin_manager=registries[1], show_progress=False, dtype="float32",
                         max_total_tokens=1024, max_running_requests=4,
                         device=os.environ.get("SGL_TEST_DEVICE", "cpu"),  # gpu_check.sh
                         attention_backend=os.environ.get("SGL_TEST_ATTENTION_BACKEND", "torch"))
    return reference, runner


def test_model_structure(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    config, model = reference.config, runner.model
    assert runner.architecture == config.architectures[0] == type(model).__name__
    assert runner.dtype == torch.float32
    windows = [m.spec.sliding_window for m in model.modules() if isinstance(m, Attention)]
    head_dims = {m.spec.head_dim for m in model.modules() if isinstance(m, Attention)}
    assert head_dims == {getattr(config, "head_dim", None) or 16}
    assert runner.kv_pool.k_buffer[0].shape[-1] == head_dims.pop()
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    if getattr(config, "use_sliding_window", False):
        assert windows == [None, 8]
    else:
        assert windows == [None, None]
    moe = [type(layer.mlp.experts) for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe == ([FusedMoE] if config.model_type == "qwen2_moe" else [])


def test_incomplete_or_foreign_checkpoint_is_rejected(tiny: tuple[Any, ModelRunner]) -> None:
    from sgl.model_loader import ModelLoadError, open_weights

    _, runner = tiny
    moe = runner.hf_config.model_type == "qwen2_moe"
    dropped = ("model.layers.0.mlp.experts.3.up_proj.weight" if moe
               else "model.layers.1.self_attn.k_proj.weight")
    unfilled = ("model.layers.0.mlp.experts.gate_up_proj (shards ['up of expert 3'])" if moe
                else "model.layers.1.self_attn.qkv_proj.weight (shards ['k'])")
    weights = list(open_weights(runner.model_path, torch.float32))
    assert dropped in dict(weights)

    def fresh() -> Any:
        return type(runner.model)(runner.hf_config, dtype=torch.float32,
                                  device=torch.device("cpu"))

    with pytest.raises(ModelLoadError,
                       match=re.escape(f"left 1 parameters unfilled, e.g. {unfilled}")):
        fresh().load_weights(w for w in weights if w[0] != dropped)
    foreign = "model.layers.0.mlp.experts.9.gate_proj.weight"
    problem = "expert_id must be an int in [0, 4), got 9" if moe else "has no matching parameter"
    with pytest.raises(ModelLoadError, match=re.escape(problem)):
        fresh().load_weights([*weights, (foreign, torch.zeros(32, 64))])


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
    torch.testing.assert_close(logits.cpu(), expected, rtol=0, atol=ATOL)

    # 2. a second extend on top of the cached prompts
    more = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 1, 8, 2)]
    seqs = [BatchSeq(row, len(p), m) for row, p, m in zip(rows, prompts, more)]
    hidden = runner.forward(make_forward_batch(runner, ForwardMode.EXTEND, seqs))
    logits = runner.logits_at(hidden, torch.arange(hidden.shape[0]))
    texts = [p + m for p, m in zip(prompts, more)]
    expected = torch.cat([reference_logits(reference, t)[-len(m):] for t, m in zip(texts, more)])
    torch.testing.assert_close(logits.cpu(), expected, rtol=0, atol=ATOL)

    # 3. decode steps, feeding each sequence its greedy token
    logits = logits[torch.tensor([len(m) for m in more]).cumsum(0) - 1]  # last new tokens
    for _ in range(3):
        next_ids = logits.argmax(-1).tolist()
        seqs = [BatchSeq(row, len(t), [n]) for row, t, n in zip(rows, texts, next_ids)]
        logits = runner.forward_logits(make_forward_batch(runner, ForwardMode.DECODE, seqs))
        texts = [t + [n] for t, n in zip(texts, next_ids)]
        expected = torch.stack([reference_logits(reference, t)[-1] for t in texts])
        torch.testing.assert_close(logits.cpu(), expected, rtol=0, atol=ATOL)

    for row, text in zip(rows, texts):
        release_sequence(runner, row, len(text))
    assert runner.kv_pool.num_free == free


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
        seqs = [BatchSeq(r, n, [t]) for r, n, t in zip(rows, lengths, next_ids)]
        batch = make_forward_batch(runner, ForwardMode.DECODE, seqs)
        lengths = [n + 1 for n in lengths]
    for row, n in zip(rows, lengths):
        release_sequence(runner, row, n)
    return outputs


def hf_greedy(model: Any, prompts: Sequence[Sequence[int]], steps: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of the prompts as one left-padded batch. The attention
    mask is explicit: inferred from ``pad_token_id`` it would also hide real tokens equal to the
    pad id."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def test_greedy_matches_transformers(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 2, 20, 11)]
    prompts[0][-1] = 0  # a real token equal to the pad id
    got = greedy(runner, prompts, steps=32)  # all prompts in one ragged batch
    assert got == hf_greedy(reference, prompts, 32)
