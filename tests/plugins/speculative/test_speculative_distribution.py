"""Sampled requests keep the target's distribution under speculation: a tiny random-weight
Llama with a vocabulary of 16 in a real scheduler with NGRAM drafting; the empirical joint
distribution of the first two output tokens (the second is decided by a verification) against
the exact one from transformers, by a chi-square test. The same test run with the acceptance
rule broken (every draft token kept: a deliberately wrong engine, the only fake here) must
fail, which shows the test can."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "core"))
from test_scheduler import Harness  # noqa: E402

from sgl.engine import speculative  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB = 16
PROMPT = [3, 7, 1, 9, 4, 12, 7, 1, 5, 14, 3, 9, 6, 1]
SAMPLES = 3000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl.model_loader import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # distributions with a shape, not the near-uniform fresh init
        model.lm_head.weight.mul_(8)
    path = tmp_path_factory.mktemp("tiny-vocab16")
    model.save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)  # the scheduler loads one (for stop strings)
    return path


def exact_joint(path: Path) -> torch.Tensor:
    """p(t1, t2) after PROMPT at temperature 1, from transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
        seconds = torch.stack([torch.softmax(model(torch.tensor([PROMPT + [t]])).logits[0, -1],
                                             -1) for t in range(VOCAB)])
    return first[:, None] * seconds


def chi_square(counts: Counter[tuple[int, int]], p: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells expected at least 5 times (the rest pooled)."""
    stat, cells, rest_obs, rest_exp = 0.0, 0, 0, 0.0
    for t1 in range(VOCAB):
        for t2 in range(VOCAB):
            expected, observed = n * float(p[t1, t2]), counts.get((t1, t2), 0)
            if expected >= 5:
                stat += (observed - expected) ** 2 / expected
                cells += 1
            else:
                rest_obs, rest_exp = rest_obs + observed, rest_exp + expected
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    return stat, cells - 1


def sample_pairs(h: Harness) -> Counter[tuple[int, int]]:
    pairs: Counter[tuple[int, int]] = Counter()
    for first in range(0, SAMPLES, 500):  # in rounds: the sockets queue at most ~2000 messages
        rids = [h.submit(PROMPT, max_new_tokens=3, temperature=1.0, ignore_eos=True,
                         seed=1000 + i) for i in range(first, min(first + 500, SAMPLES))]
        results = h.run(rids, max_steps=5000)
        pairs.update((results[r].output_ids[0], results[r].output_ids[1]) for r in rids)
    h.assert_memory_empty()
    return pairs


def accept_every_draft(original):  # the broken rule: keep the draft whatever the target says
    def accept(self, items, hidden):
        out = original(self, items, hidden)
        for v in out:
            if v.req.draft:
                v.tokens, v.path = v.req.draft + [v.tokens[-1]], list(range(len(v.req.draft)))
        return out
    return accept


def test_sampled_tokens_follow_the_target_distribution(tiny_model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    p = exact_joint(tiny_model)
    h = Harness(tmp_path, model_path=str(tiny_model), speculative_algorithm="NGRAM",
                speculative_disable_by_batch_size=1024, grammar_backend="none",
                max_running_requests=256, max_total_tokens=8192)
    try:
        with torch.inference_mode():
            counts = sample_pairs(h)
            spec = h.scheduler.extensions.named("speculative")
            assert spec is not None and spec.stats.proposed_drafts >= SAMPLES // 2  # drafts ran
            assert 20 < spec.stats.accepted_drafts < spec.stats.proposed_drafts // 2
            stat, df = chi_square(counts, p, SAMPLES)
            # far beyond the 0.9999 quantile of chi-square(df): a correct engine passes
            limit = df + 4 * math.sqrt(2 * df) + 10
            print(f"chi-square {stat:.0f} (df {df}, limit {limit:.0f}), drafts {spec.stats}")
            assert stat < limit, (stat, df)

            monkeypatch.setattr(speculative.SpeculativeDecoding, "accept",
                                accept_every_draft(speculative.SpeculativeDecoding.accept))
            broken, _ = chi_square(sample_pairs(h), p, SAMPLES)
            print(f"broken rule: chi-square {broken:.0f}")
            assert broken > 3 * limit, (broken, limit)
    finally:
        h.close()
