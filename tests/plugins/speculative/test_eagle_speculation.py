"""EAGLE and EAGLE-3 in a real scheduler, with tiny random-weight heads written in their
published Hugging Face layout (acceptance means nothing with random heads; exactness does):

- the head's drafts equal a dense reference written here from the published design, fed
  with the target's hidden states from transformers (which states, shifted how, normed or
  not: everything the engine seam and the head must get right);
- greedy and seeded outputs equal those without speculation, on a vocabulary-16 target where
  random heads are sometimes right (so accepted drafts, and the head catching up on them, are
  exercised), with chunked prefill, the radix cache, retraction and abort; the head's state
  is gone after every run;
- the bundled SmolLM2 with an EAGLE-3 head of another width (own embedding, a draft
  vocabulary mapped by d2t) keeps its outputs;
- trees (``--speculative-eagle-topk`` above 1): the beam search's nodes, parents and order
  equal the reference's, and verifying them keeps the outputs;
- wrong heads and flags fail with messages that say what to do.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sgl_testing import run_cli
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parents[2] / "core"))
from test_scheduler import Harness, Result, mixed_prompts  # noqa: E402

from sgl.model_loader import ModelLoadError, load_tokenizer  # noqa: E402
from sgl.speculative import DraftRequest  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB = 16
LAYERS = 8  # EAGLE-3's default layers 2, 4, 5 fit


def test_plugin_is_installed() -> None:
    from sgl.plugins import create_plugin_manager
    from sgl_spec_eagle.drafter import Eagle3Drafter, EagleDrafter

    pm = create_plugin_manager()
    assert pm.records["speculative-eagle"].available
    assert "sgl_register_speculative_algorithms" in pm.records["speculative-eagle"].hooks
    for name, cls in (("EAGLE", EagleDrafter), ("EAGLE3", Eagle3Drafter)):
        entry = pm.registries.speculative.entry(name)
        assert entry.owner == "speculative-eagle" and entry.load() is cls


def tiny_llama_config(**changes: object):
    from transformers import LlamaConfig

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
                eos_token_id=None, pad_token_id=None)
    return LlamaConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    with torch.no_grad():  # peaked next-token distributions, not the near-uniform fresh init
        model.lm_head.weight.mul_(8)
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)  # the scheduler loads one (stop strings)
    return path


def write_head(folder: Path, version: int, config, *, target_hidden: int, seed: int,
               draft_vocab: int | None = None, target_vocab: int = VOCAB,
               own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """A random head in the published layout (names, shapes, config, file format); returns its
    tensors."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = h // heads

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def layer(prefix: str, attn_in: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.self_attn.q_proj.weight": rand(heads * hd, attn_in),
                f"{prefix}.self_attn.k_proj.weight": rand(kv * hd, attn_in),
                f"{prefix}.self_attn.v_proj.weight": rand(kv * hd, attn_in),
                f"{prefix}.self_attn.o_proj.weight": rand(h, heads * hd),
                f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
                f"{prefix}.mlp.up_proj.weight": rand(inter, h),
                f"{prefix}.mlp.down_proj.weight": rand(h, inter),
                f"{prefix}.input_layernorm.weight": 1 + rand(h, scale=0.1),
                f"{prefix}.post_attention_layernorm.weight": 1 + rand(h, scale=0.1)}

    if version == 1:  # EAGLE's checkpoints carry layer 0's unused input norm and an embedding
        tensors = {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h), **layer("layers.0", h),
                   "embed_tokens.weight": rand(target_vocab, h)}
        config.architectures = ["LlamaForCausalLMEagle"]
    else:
        tensors = {"fc.weight": rand(h, 3 * target_hidden), **layer("midlayer", 2 * h),
                   "midlayer.hidden_norm.weight": 1 + rand(h, scale=0.1),
                   "norm.weight": 1 + rand(h, scale=0.1)}
        if own_embedding:
            tensors["embed_tokens.weight"] = rand(target_vocab, h)
        if draft_vocab is not None:
            hot = torch.randperm(target_vocab, generator=gen)[:draft_vocab].sort().values
            tensors["lm_head.weight"] = rand(draft_vocab, h, scale=1.0)
            tensors["d2t"] = hot - torch.arange(draft_vocab)
            tensors["t2d"] = torch.zeros(target_vocab, dtype=torch.bool).index_fill(0, hot, True)
        config.architectures = ["LlamaForCausalLMEagle3"]
        config.draft_vocab_size = draft_vocab
        config.target_hidden_size = target_hidden
    folder.mkdir(parents=True, exist_ok=True)
    if version == 1:  # as EAGLE's authors publish them
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(folder / "model.safetensors"))
    config.save_pretrained(folder)
    return tensors


@pytest.fixture(scope="module")
def heads(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    write_head(root / "eagle", 1, tiny_llama_config(num_hidden_layers=1), target_hidden=32,
               seed=1)
    write_head(root / "eagle3", 3, tiny_llama_config(num_hidden_layers=1), target_hidden=32,
               seed=3, draft_vocab=12)
    return {"EAGLE": root / "eagle", "EAGLE3": root / "eagle3"}


def harness(tmp: Path, model: Path | str, algorithm: str | None = None,
            head: Path | None = None, **overrides: object) -> Harness:
    spec = {} if algorithm is None else dict(
        speculative_algorithm=algorithm, speculative_draft_model_path=str(head),
        speculative_disable_by_batch_size=64)
    return Harness(tmp, model_path=str(model), grammar_backend="none", **{**spec, **overrides})


# -- the dense reference -------------------------------------------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_layer(w: dict[str, torch.Tensor], prefix: str, config, x: torch.Tensor,
                    attn_in: torch.Tensor) -> torch.Tensor:
    """One causal Llama layer over all positions: attention reads ``attn_in``, the residual
    stream is ``x``; returns the stream after the MLP."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    t, heads, kv = x.shape[0], config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // heads
    q = (attn_in @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(t, heads, hd).transpose(0, 1)
    k = (attn_in @ w[f"{prefix}.self_attn.k_proj.weight"].T).view(t, kv, hd).transpose(0, 1)
    v = (attn_in @ w[f"{prefix}.self_attn.v_proj.weight"].T).view(t, kv, hd).transpose(0, 1)
    cos, sin = LlamaRotaryEmbedding(config)(x[None], torch.arange(t)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = (k[0].repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0))
    att = F.scaled_dot_product_attention(q[0], k, v, is_causal=True)
    x = x + att.transpose(0, 1).reshape(t, -1) @ w[f"{prefix}.self_attn.o_proj.weight"].T
    h = rms(x, w[f"{prefix}.post_attention_layernorm.weight"])
    mlp = (F.silu(h @ w[f"{prefix}.mlp.gate_proj.weight"].T) * (h @ w[f"{prefix}.mlp.up_proj.weight"].T))
    return x + mlp @ w[f"{prefix}.mlp.down_proj.weight"].T


class ReferenceHead:
    """The head run densely over whole sequences: position p reads ``tokens[p+1]`` and the
    target's state ``feats[p]``; a drafted path's positions read the head's own previous
    state."""

    def __init__(self, version: int, w: dict[str, torch.Tensor], config, embed: torch.Tensor,
                 lm_head: torch.Tensor, feats: torch.Tensor, tokens: list[int],
                 token_map: torch.Tensor | None = None) -> None:
        self.version, self.w, self.config, self.embed, self.lm_head = (version, w, config,
                                                                      embed, lm_head)
        n = len(tokens) - 1
        self.ids, self.feats = list(tokens[1:]), list(feats[:n])
        # the draft vocabulary: EAGLE-3's (d2t), or EAGLE's hot tokens (--speculative-token-map)
        self.hot = (w["d2t"] + torch.arange(len(w["d2t"]))) if "d2t" in w else token_map
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def state(self, path: tuple[int, ...]) -> torch.Tensor:
        """The head's output state at the last position, after the drafted ``path``."""
        if path not in self.memo:
            inputs = self.feats + [self.state(path[:i]) for i in range(len(path))]
            w, e = self.w, self.embed[torch.tensor(self.ids + list(path))]
            if self.version == 1:
                x = torch.cat([e, torch.stack(inputs)], -1) @ w["fc.weight"].T + w["fc.bias"]
                out = reference_layer(w, "layers.0", self.config, x, x)
            else:
                hs = torch.stack([f @ w["fc.weight"].T if f.shape[-1] != self.config.hidden_size
                                  else f for f in inputs])
                attn_in = torch.cat([rms(e, w["midlayer.input_layernorm.weight"]),
                                     rms(hs, w["midlayer.hidden_norm.weight"])], -1)
                out = reference_layer(w, "midlayer", self.config, hs, attn_in)
            self.memo[path] = out[-1]
        return self.memo[path]

    def top(self, path: tuple[int, ...], k: int) -> list[tuple[float, int]]:
        """The k likeliest next tokens after ``path``: (log-probability, target id)."""
        state = self.state(path)
        if self.version == 1:
            logits = state @ (self.lm_head if self.hot is None else self.lm_head[self.hot]).T
        else:
            head = self.w["lm_head.weight"] if self.hot is not None else self.lm_head
            logits = rms(state, self.w["norm.weight"]) @ head.T
        logp, best = torch.log_softmax(logits, -1).topk(k)
        ids = self.hot[best] if self.hot is not None else best
        return list(zip(logp.tolist(), ids.tolist()))

    def chain(self, steps: int) -> list[int]:
        path: tuple[int, ...] = ()
        for _ in range(steps):
            path += (self.top(path, 1)[0][1],)
        return list(path)

    def tree(self, steps: int, k: int, size: int) -> tuple[list[int], list[int]]:
        """EAGLE's beam search (SGLang's topk): beams are the k likeliest paths of each level,
        each expanded by its k likeliest tokens; the draft is the ``size`` likeliest paths of
        all levels, ordered by level then likelihood: (tokens, parent indices)."""
        scored = {(t,): lp for lp, t in self.top((), k)}
        beams = sorted(scored, key=lambda q: -scored[q])
        for _ in range(steps - 1):
            children = {b + (t,): scored[b] + lp for b in beams for lp, t in self.top(b, k)}
            scored.update(children)
            beams = sorted(children, key=lambda q: -children[q])[:k]
        chosen = sorted(scored, key=lambda q: -scored[q])[:size]
        order = sorted(chosen, key=lambda q: (len(q), -scored[q]))
        return [q[-1] for q in order], [order.index(q[:-1]) if len(q) > 1 else -1 for q in order]


def start_one(h: Harness, prompt: list[int]) -> str:
    """Submit a request and step until its prompt ran and its first token is sampled."""
    rid = h.submit(prompt, max_new_tokens=50, temperature=0, ignore_eos=True)
    s = h.scheduler
    for _ in range(100):
        s.recv_requests(block=not (s.running or s.waiting))  # the socket may take a moment
        if s.running or s.waiting:
            s.step()
            if any(r.rid == rid and r.output_ids for r in s.running):
                return rid
    raise AssertionError("the request did not start")


@pytest.mark.parametrize(("algorithm", "hot"), [("EAGLE", False), ("EAGLE3", False),
                                              ("EAGLE", True)], ids=["EAGLE", "EAGLE3", "hot"])
@pytest.mark.parametrize(("topk", "steps", "tokens"), [(1, 5, 6), (2, 3, 6), (3, 4, 12)])
def test_drafts_equal_the_dense_reference(algorithm: str, hot: bool, topk: int, steps: int,
                                          tokens: int, target: Path, heads: dict[str, Path],
                                          tmp_path: Path) -> None:
    """Chains (topk 1) and trees: the tree's nodes, parents and order as well; ``hot``: with
    --speculative-token-map (EAGLE drafts from those tokens only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl.model_loader import open_weights

    version = 1 if algorithm == "EAGLE" else 3
    w = dict(open_weights(heads[algorithm]))
    config = LlamaConfig.from_pretrained(heads[algorithm])
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    token_map = torch.tensor([14, 2, 9, 5, 11, 7, 0, 12]) if hot else None
    extra = {}
    if token_map is not None:
        torch.save(token_map, tmp_path / "hot.pt")
        extra["speculative_token_map"] = str(tmp_path / "hot.pt")
    h = harness(tmp_path, target, algorithm, heads[algorithm], chunked_prefill_size=7,
                speculative_eagle_topk=topk, speculative_num_steps=steps,
                speculative_num_draft_tokens=tokens, **extra)
    try:
        with torch.inference_mode():
            prompt = [3, 7, 1, 9, 4, 12, 7, 1, 5, 14, 3, 9, 6, 1, 2, 8, 11, 4, 4, 10]
            rid = start_one(h, prompt)  # three prompt chunks, then the first token
            req = next(r for r in h.scheduler.running if r.rid == rid)
            ids = req.input_ids + req.output_ids
            drafter = h.scheduler.extensions.named("speculative").algorithm
            assert drafter.states[rid].length == len(ids) - 1
            kept = drafter.states[rid].last.clone()
            got = drafter.propose([DraftRequest(rid, ids, tokens - 1)])[0]

            out = hf(torch.tensor([ids]), output_hidden_states=True)
            states = out.hidden_states  # [i]: entering layer i; [-1]: after the final norm
            feats = states[-1][0] if version == 1 else torch.cat(
                [states[i][0] for i in (2, LAYERS // 2, LAYERS - 3)], -1)
            ref = ReferenceHead(version, w, config, hf.model.embed_tokens.weight,
                                hf.lm_head.weight, feats, ids, token_map)
            # the head's state after catching up on the prompt (through three chunks and the
            # first token), then its drafts
            torch.testing.assert_close(kept, ref.state(()), rtol=1e-4, atol=1e-4)
            if token_map is not None:
                drafted = got if topk == 1 else got.tokens
                assert set(drafted) <= set(token_map.tolist())
            if topk == 1:
                assert got == ref.chain(tokens - 1), (got, ref.chain(tokens - 1))
            else:
                want = ref.tree(steps, topk, tokens - 1)
                assert (list(got.tokens), list(got.parents)) == want
                assert len(set(got.parents)) > 2  # a tree, not a chain or a fan
    finally:
        h.close()


def run(h: Harness, prompts: list[list[int]], **params: object) -> list[Result]:
    rids = [h.submit(p, **params) for p in prompts]
    results = h.run(rids)
    h.assert_memory_empty()
    if h.scheduler.extensions.named("speculative") is not None:
        assert h.scheduler.extensions.named("speculative").algorithm.states == {}
    return [results[r] for r in rids]


def vocab16_prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, VOCAB, (40,), generator=gen).tolist()
    return [(shared if i % 3 == 0 else []) + torch.randint(1, VOCAB, (5 + 9 * i,),
                                                          generator=gen).tolist()
            for i in range(count)]


@pytest.fixture(scope="module")
def plain16(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = harness(tmp_path_factory.mktemp("plain16"), target, chunked_prefill_size=64)
    with torch.inference_mode():
        yield h
    h.close()


@pytest.mark.parametrize(("algorithm", "topk", "hot"), [
    ("EAGLE", 1, False), ("EAGLE3", 1, False), ("EAGLE", 3, False), ("EAGLE3", 2, False),
    ("EAGLE", 2, True)])
def test_outputs_equal_those_without_speculation(algorithm: str, topk: int, hot: bool,
                                                 target: Path, heads: dict[str, Path],
                                                 plain16: Harness, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    extra = {}
    if hot:
        torch.save(torch.arange(1, VOCAB, 2), tmp_path / "hot.pt")
        extra["speculative_token_map"] = str(tmp_path / "hot.pt")
    spec = harness(tmp_path, target, algorithm, heads[algorithm], chunked_prefill_size=64,
                   speculative_eagle_topk=topk, **extra)
    try:
        with torch.inference_mode():
            prompts = vocab16_prompts(12)
            stats = spec.scheduler.extensions.named("speculative").stats
            for params in (dict(temperature=0), dict(temperature=0.8, seed=3),
                           dict(temperature=1.0, top_k=5, frequency_penalty=0.3, seed=9)):
                want = run(plain16, prompts, max_new_tokens=40, ignore_eos=True, **params)
                got = run(spec, prompts, max_new_tokens=40, ignore_eos=True, **params)
                assert [g.output_ids for g in got] == [w.output_ids for w in want], params
            assert stats.proposed_drafts > 500
            assert stats.accepted_drafts > 20  # the head caught up on accepted drafts too
            assert spec.scheduler.cache.stats.hit_tokens > 0  # shared prefixes were cached

            s = spec.scheduler
            s.new_token_ratio = 0.05  # admission under-reserves: the small pool retracts
            many = vocab16_prompts(40)
            want = run(plain16, many, max_new_tokens=60, temperature=0, ignore_eos=True)
            got = run(spec, many, max_new_tokens=60, temperature=0, ignore_eos=True)
            assert s.num_retractions > 0
            assert [g.output_ids for g in got] == [w.output_ids for w in want]
            keep = spec.submit(prompts[0], max_new_tokens=12, temperature=0)
            gone = spec.submit(prompts[1], max_new_tokens=200, temperature=0, ignore_eos=True)
            spec.run([keep, gone], abort={gone: 3})
            run(spec, [], max_new_tokens=1)  # memory and state checks only
            # up to the end of the context (1024): drafts shrink, trees become chains
            edge = [torch.randint(1, VOCAB, (1000,), generator=torch.Generator().manual_seed(1))
                    .tolist()]
            want = run(plain16, edge, max_new_tokens=40, temperature=0, ignore_eos=True)
            got = run(spec, edge, max_new_tokens=40, temperature=0, ignore_eos=True)
            assert got[0].output_ids == want[0].output_ids and len(got[0].output_ids) == 24
        # a drafting failure would only cost speed; here there must be none
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        spec.close()


def test_a_failing_head_costs_drafts_never_requests(target: Path, heads: dict[str, Path],
                                                   plain16: Harness, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The head failing to catch up (a fault injected into every third of its first 30
    observes, the only fake here: a real head does not fail on demand) drops the requests'
    drafting state; their outputs are those without speculation, and the head drafts again
    afterwards. (A fault every third observe for good could fall into step with the
    draft-verify cycle, as the requests' arrival over the socket sets it, and leave no draft
    accepted at all.)"""
    from sgl_spec_eagle.drafter import EagleDrafter

    calls = {"n": 0}
    original = EagleDrafter.observe

    def flaky(self, states):
        calls["n"] += 1
        if calls["n"] <= 30 and calls["n"] % 3 == 0:
            raise RuntimeError("injected fault")
        return original(self, states)

    monkeypatch.setattr(EagleDrafter, "observe", flaky)
    spec = harness(tmp_path, target, "EAGLE", heads["EAGLE"], chunked_prefill_size=64)
    try:
        with torch.inference_mode():
            prompts = vocab16_prompts(6)
            want = run(plain16, prompts, max_new_tokens=30, temperature=0, ignore_eos=True)
            got = run(spec, prompts, max_new_tokens=30, temperature=0, ignore_eos=True)
            assert [g.output_ids for g in got] == [w.output_ids for w in want]
            assert spec.scheduler.extensions.named("speculative").stats.accepted_drafts > 0
            assert "injected fault" in caplog.text
            assert "their drafting starts afresh" in caplog.text
    finally:
        spec.close()


def test_eagle3_reads_replayed_decode_steps(tmp_path: Path) -> None:
    """Decode steps without drafts (more requests than the batch limit) replay their recorded
    forward; EAGLE-3 still gets the layer states of each, the very ones an eager forward
    computes: the head's states after a run with replays equal those after one without."""
    from transformers import LlamaForCausalLM

    from sgl.kernels import cpu

    torch.manual_seed(3)  # heads 16 wide: shapes sgl's kernels take, so forwards record
    wide = tiny_llama_config(hidden_size=64, intermediate_size=128)
    LlamaForCausalLM(wide).save_pretrained(tmp_path / "target")
    load_tokenizer(None).save_pretrained(tmp_path / "target")
    write_head(tmp_path / "head", 3, tiny_llama_config(hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=1),
               target_hidden=64, seed=5, draft_vocab=12)
    prompts = vocab16_prompts(3)
    kept = {}
    for graphs in (True, False):
        folder = tmp_path / str(graphs)
        folder.mkdir()
        h = harness(folder, tmp_path / "target", "EAGLE3", tmp_path / "head",
                    chunked_prefill_size=64, speculative_disable_by_batch_size=1,
                    disable_cpu_graph=not graphs)
        try:
            with torch.inference_mode():
                s = h.scheduler

                def start(prompt: list[int], n: int) -> str:
                    rid = h.submit(prompt, max_new_tokens=n, temperature=0, ignore_eos=True)
                    while all(r.rid != rid for r in [*s.running, *s.waiting]):
                        s.recv_requests(block=True)
                    return rid

                rids = [start(p, 40) for p in prompts]
                for _ in range(8):  # three decoding: recorded, then replayed
                    s.step()
                # a fourth comes and goes (its prefill and its batches of four run in between);
                # then the batch of three replays again and must bring back its own states
                extra = start(prompts[0][:9], 4)
                for _ in range(12):
                    s.step()
                drafter = s.extensions.named("speculative").algorithm
                kept[graphs] = [(drafter.states[r].length, drafter.states[r].last.clone())
                                for r in rids]
                if graphs and cpu.load() is not None:
                    assert s.runner.decode_graphs.replays > 0
                h.run([*rids, extra])
        finally:
            h.close()
    for prompt, (n_on, last_on), (n_off, last_off) in zip(prompts, kept[True], kept[False]):
        assert n_on == n_off > len(prompt)
        torch.testing.assert_close(last_on, last_off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_smollm2_keeps_its_outputs(algorithm: str, smollm2: Harness, tmp_path: Path) -> None:
    """The real target, with a mix of prompts, batch sizes and the radix cache: an EAGLE head
    as wide as SmolLM2 (576, its LM head shared); an EAGLE-3 head 64 wide with its own
    embedding and a 2000-token draft vocabulary (d2t), reading SmolLM2's 576-wide layer
    states."""
    head = tmp_path / "head"
    if algorithm == "EAGLE":
        config = tiny_llama_config(vocab_size=49152, hidden_size=576, intermediate_size=256,
                                   num_hidden_layers=1, num_attention_heads=9,
                                   num_key_value_heads=3, max_position_embeddings=8192)
        write_head(head, 1, config, target_hidden=576, seed=4, target_vocab=49152)
    else:
        config = tiny_llama_config(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, max_position_embeddings=8192)
        write_head(head, 3, config, target_hidden=576, seed=4, draft_vocab=2000,
                   target_vocab=49152, own_embedding=True)
    spec = Harness(tmp_path, speculative_algorithm=algorithm,
                   speculative_draft_model_path=str(head), speculative_disable_by_batch_size=64)
    try:
        with torch.inference_mode():
            prompts = mixed_prompts(smollm2, 6)
            want = [run(smollm2, prompts[:1], max_new_tokens=24, temperature=0)[0],
                    *run(smollm2, prompts[1:], max_new_tokens=24, temperature=0)]
            got = [run(spec, prompts[:1], max_new_tokens=24, temperature=0)[0]]
            rids = [spec.submit(p, max_new_tokens=24, temperature=0) for p in prompts[1:]]
            results = spec.run(rids)  # no flush: the radix cache keeps them (and the head's KV)
            got += [results[r] for r in rids]
            assert [g.output_ids for g in got] == [w.output_ids for w in want]
            assert spec.scheduler.extensions.named("speculative").stats.proposed_drafts > 100
            # the same prompts again: their prefixes come from the radix cache, with the head's KV
            hits = spec.scheduler.cache.stats.hit_tokens
            again = run(spec, prompts, max_new_tokens=24, temperature=0)
            assert spec.scheduler.cache.stats.hit_tokens > hits
            assert [g.output_ids for g in again] == [w.output_ids for w in want]
    finally:
        spec.close()


def test_a_head_of_the_other_design_is_refused(target: Path, heads: dict[str, Path],
                                               tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="--speculative-algorithm EAGLE3"):
        harness(tmp_path, target, "EAGLE", heads["EAGLE3"])
    with pytest.raises(ModelLoadError, match="--speculative-algorithm EAGLE\\b"):
        harness(tmp_path, target, "EAGLE3", heads["EAGLE"])
    # a config that does not say: the tensors' names do
    plain = tmp_path / "plain-config"
    write_head(plain, 3, tiny_llama_config(num_hidden_layers=1), target_hidden=32, seed=2)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config,
                                                   "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="midlayer.*--speculative-algorithm EAGLE3"):
        harness(tmp_path, target, "EAGLE", plain)
    wide = tmp_path / "wide"
    write_head(wide, 1, tiny_llama_config(hidden_size=48, num_hidden_layers=1),
               target_hidden=48, seed=3)
    with pytest.raises(ModelLoadError, match="48 wide"):
        harness(tmp_path, target, "EAGLE", wide)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([3, 3]), torch.tensor([VOCAB])):
        torch.save(bad, tmp_path / "hot.pt")
        with pytest.raises(ModelLoadError, match="--speculative-token-map .*distinct token ids"):
            harness(tmp_path, target, "EAGLE", heads["EAGLE"],
                    speculative_token_map=str(tmp_path / "hot.pt"))


@pytest.mark.parametrize(("args", "names"), [
    (["--speculative-algorithm", "EAGLE"], ["--speculative-draft-model-path"]),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x",
      "--speculative-token-map", "hot.pt"], ["--speculative-token-map"]),
    (["--speculative-algorithm", "NGRAM", "--speculative-token-map", "hot.pt"],
     ["--speculative-token-map"]),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "x",
      "--speculative-token-map", "/no/such/hot.pt"], ["--speculative-token-map", "no such file"]),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x",
      "--speculative-eagle-topk", "2", "--speculative-num-steps", "2",
      "--speculative-num-draft-tokens", "10"],
     ["--speculative-num-draft-tokens", "--speculative-eagle-topk", "--speculative-num-steps"]),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "x",
      "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "5"],
     ["--speculative-num-draft-tokens", "--speculative-num-steps"]),
])
def test_bad_settings_fail_before_loading(args: list[str], names: list[str]) -> None:
    result = run_cli(["serve", *args], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in result.stderr, result.stderr
