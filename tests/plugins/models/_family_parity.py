"""Parity checks shared by the model-family tests: sgl's ModelRunner against transformers.

Each family's test builds a tiny random-weight transformers model, saves it, opens it with a
:class:`ModelRunner` and calls these helpers. Not a test module itself (no ``test_`` prefix).

The runners run on the CPU with the ``torch`` attention backend; ``SGL_TEST_DEVICE=cuda`` and
``SGL_TEST_ATTENTION_BACKEND=triton`` (or ``flashinfer``) run the same checks on a GPU
(``benchmarks/gpu_check.sh``), against transformers on the CPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.forward_batch import ForwardMode
from sgl.engine.model_runner import ModelRunner
from sgl.plugins import create_plugin_manager
from sgl_testing import run_cli

__all__ = ["assert_plugin_installed", "check_ragged_extend_prefix_decode", "greedy", "hf_greedy",
           "make_runner", "randomize_norms", "reference_logits"]


def assert_plugin_installed(plugin_id: str, archs: dict[str, str],
                            gguf_archs: tuple[str, ...] = ()) -> None:
    """``plugin_id`` is listed by ``sgl plugins --json`` and registered ``archs``
    (architecture -> ``module:Class``) and the GGUF architectures ``gguf_archs``."""
    result = run_cli(["plugins", "--json"])
    assert result.returncode == 0, result.stderr
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    assert listed[plugin_id]["available"], listed[plugin_id]
    hooks = ["sgl_register_gguf_archs"] if gguf_archs else []
    assert listed[plugin_id]["hooks"] == [*hooks, "sgl_register_model_archs"]
    gguf = create_plugin_manager().registries.gguf_archs
    assert sorted(e.name for e in gguf if e.owner == plugin_id) == sorted(gguf_archs)
    assert listed[plugin_id]["distribution"] == f"sgl-{plugin_id}"
    registry = create_plugin_manager().registries.models
    for arch, target in archs.items():
        entry = registry.entry(arch)
        assert (entry.owner, entry.target) == (plugin_id, target)


def make_runner(path: str, **kwargs: Any) -> ModelRunner:
    pm = create_plugin_manager()
    kwargs.setdefault("max_total_tokens", 2048)
    kwargs.setdefault("max_running_requests", 8)
    kwargs.setdefault("device", os.environ.get("SGL_TEST_DEVICE", "cpu"))
    kwargs.setdefault("attention_backend", os.environ.get("SGL_TEST_ATTENTION_BACKEND", "torch"))
    return ModelRunner(model_path=path, registries=pm.registries, plugin_manager=pm,
                       dtype="float32", show_progress=False, **kwargs)


def randomize_norms(model: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Give every norm weight random values (many families initialise them to a constant,
    which would hide a wrong offset or a missing norm)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * std)


def reference_logits(model: Any, texts: Sequence[Sequence[int]], *,
                     batched: bool = True) -> list[torch.Tensor]:
    """transformers' float32 logits ``[len(text), vocab]`` at every position of each text.

    ``batched``: one call, right-padded without a mask (causal attention keeps the pads out of
    the real positions); else one call per text (for models whose maths depends on the longest
    row, like transformers' LongRoPE)."""
    with torch.no_grad():
        if not batched:
            return [model(torch.tensor([list(t)])).logits[0].float() for t in texts]
        width = max(len(t) for t in texts)
        ids = torch.tensor([list(t) + [0] * (width - len(t)) for t in texts])
        logits = model(ids).logits.float()
    return [row[:len(t)] for row, t in zip(logits, texts)]


def check_ragged_extend_prefix_decode(reference: Any, runner: ModelRunner, *, atol: float,
                                      vocab: int = 256, decode_steps: int = 4,
                                      batched_reference: bool = True) -> None:
    """sgl's logits of (1) a ragged extend of four prompts of lengths 5, 17, 1 and 33 at every
    position, (2) an extend on top of the cached prompts and (3) decode steps all match
    ``reference`` run from scratch on each whole final text (a causal model's logits at
    position ``i`` are those of the text's first ``i + 1`` tokens)."""
    free = runner.kv_pool.num_free
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 17, 1, 33)]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    got: list[tuple[str, list[tuple[int, int]], torch.Tensor]] = []  # (pass, (seq, pos)s, logits)

    batch = make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(r, 0, p)
                                                            for r, p in zip(rows, prompts)])
    hidden = runner.forward(batch)
    where = [(i, pos) for i, p in enumerate(prompts) for pos in range(len(p))]
    got.append(("ragged extend", where, runner.logits_at(hidden, torch.arange(batch.num_tokens))))

    more = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 1, 8, 2)]
    seqs = [BatchSeq(row, len(p), m) for row, p, m in zip(rows, prompts, more)]
    logits = runner.forward_logits(make_forward_batch(runner, ForwardMode.EXTEND, seqs))
    texts = [p + m for p, m in zip(prompts, more)]
    got.append(("extend on prefix", [(i, len(t) - 1) for i, t in enumerate(texts)], logits))

    for step in range(decode_steps):
        next_ids = logits.argmax(-1).tolist()
        seqs = [BatchSeq(row, len(t), [n]) for row, t, n in zip(rows, texts, next_ids)]
        logits = runner.forward_logits(make_forward_batch(runner, ForwardMode.DECODE, seqs))
        texts = [t + [n] for t, n in zip(texts, next_ids)]
        got.append((f"decode {step}", [(i, len(t) - 1) for i, t in enumerate(texts)], logits))

    expected = reference_logits(reference, texts, batched=batched_reference)
    for name, where, logits in got:
        want = torch.stack([expected[i][pos] for i, pos in where])
        torch.testing.assert_close(logits.cpu(), want, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")

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


def hf_greedy(model: Any, prompts: Sequence[Sequence[int]], steps: int, *,
              batched: bool = True) -> list[list[int]]:
    """transformers ``generate(do_sample=False)`` of each prompt; the new tokens.

    ``batched``: one call with the prompts left-padded (masked, so each row gets what it would
    get alone; several times faster than one call per prompt)."""
    if not batched:
        return [hf_greedy(model, [p], steps)[0] for p in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()
