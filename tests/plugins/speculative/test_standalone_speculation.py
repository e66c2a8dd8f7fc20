"""Speculative decoding with a draft model (STANDALONE) in a real scheduler: the bundled
SmolLM2 as its own draft accepts every greedy draft token, a tiny random-weight draft (same
tokenizer, almost nothing accepted) still gives the target's tokens, and the draft model's KV
pool is back to empty after every run, also through retraction and abort."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from sgl_testing import run_cli

sys.path.insert(0, str(Path(__file__).parents[2] / "core"))
from test_scheduler import Harness, Result, mixed_prompts  # noqa: E402

from sgl.model_loader import resolve_model_path  # noqa: E402

pytestmark = pytest.mark.slow
TASKS = ["Repeat this: the cat sat on the mat, and the dog lay by the door.",
         "What is the capital of France?", "Write the numbers from 1 to 20."]


def draft_harness(tmp: Path, draft: str, **overrides: object) -> Harness:
    return Harness(tmp, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                   speculative_disable_by_batch_size=64, **overrides)


def run(h: Harness, prompts: list[list[int]], **params: object) -> list[Result]:
    rids = [h.submit(p, **params) for p in prompts]
    results = h.run(rids)
    h.assert_memory_empty()
    engine = h.scheduler.extensions.named("speculative")
    drafter = engine.algorithm if engine is not None else None
    if drafter is not None:  # the draft model's memory is empty too
        assert drafter.seqs == {}
        assert drafter.draft.kv_pool.num_free == drafter.draft.kv_pool.size
        rows = drafter.draft.req_to_token_pool
        assert rows.num_free == rows.max_requests
    return [results[r] for r in rids]


def test_the_target_as_its_own_draft_accepts_every_draft_token(smollm2: Harness,
                                                              tmp_path: Path) -> None:
    spec = draft_harness(tmp_path, str(resolve_model_path(None)))
    try:
        with torch.inference_mode():
            prompts = [smollm2.chat_ids(t) for t in TASKS] + mixed_prompts(smollm2, 6)
            stats = spec.scheduler.extensions.named("speculative").stats
            for params in (dict(temperature=0), dict(temperature=0.8, seed=3),
                           dict(temperature=0.9, top_p=0.9, frequency_penalty=0.4, seed=8)):
                before = (stats.accepted_drafts, stats.proposed_drafts)
                want = run(smollm2, prompts, max_new_tokens=32, **params)
                got = run(spec, prompts, max_new_tokens=32, **params)
                for a, b in zip(want, got):
                    assert b.output_ids == a.output_ids, params
                accepted = stats.accepted_drafts - before[0]
                proposed = stats.proposed_drafts - before[1]
                assert proposed > 50
                if params["temperature"] == 0:  # the same model drafts what it would say
                    assert accepted == proposed
    finally:
        spec.close()


def test_a_random_draft_changes_nothing(smollm2: Harness, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = smollm2.scheduler.runner.vocab_size
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    folder = tmp_path / "draft"
    LlamaForCausalLM(config).save_pretrained(folder)
    spec = draft_harness(tmp_path, str(folder))
    try:
        with torch.inference_mode():
            prompts = mixed_prompts(smollm2, 40) + [smollm2.chat_ids(t) for t in TASKS]
            lengths = [8 + (i % 4) * 4 for i in range(len(prompts))]
            want = [run(smollm2, [p], max_new_tokens=n, temperature=0)[0]
                    for p, n in zip(prompts, lengths)]
            s = spec.scheduler
            s.new_token_ratio = 0.1  # admission under-reserves: the small pool retracts
            rids = [spec.submit(p, max_new_tokens=n, temperature=0)
                    for p, n in zip(prompts, lengths)]
            got = spec.run(rids)
            assert s.num_retractions > 0
            for rid, a in zip(rids, want):
                assert got[rid].output_ids == a.output_ids
            run(spec, [], max_new_tokens=1)  # memory checks only
            stats = s.extensions.named("speculative").stats
            assert stats.proposed_drafts > 100
            assert stats.accepted_drafts < stats.proposed_drafts // 2
            # an abort in the middle frees the draft's memory too
            keep = spec.submit(prompts[0], max_new_tokens=12, temperature=0)
            gone = spec.submit(prompts[1], max_new_tokens=300, temperature=0, ignore_eos=True)
            spec.run([keep, gone], abort={gone: 3})
            run(spec, [], max_new_tokens=1)
    finally:
        spec.close()


@pytest.mark.parametrize(("args", "names"), [
    (["--speculative-algorithm", "STANDALONE"], ["--speculative-draft-model-path"]),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x",
      "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "6"],
     ["--speculative-num-draft-tokens", "--speculative-num-steps"]),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x",
      "--speculative-eagle-topk", "2"], ["--speculative-eagle-topk"]),
])
def test_bad_settings_fail_before_loading(args: list[str], names: list[str]) -> None:
    result = run_cli(["serve", *args], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in result.stderr, result.stderr
