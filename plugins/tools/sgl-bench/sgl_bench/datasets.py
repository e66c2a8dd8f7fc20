"""The prompts a benchmark sends: ``random``, ``sharegpt`` and ``generated-shared-prefix``.

Every generator is seeded and returns a list of :class:`BenchRequest`. Prompts are either token
ids (``as_text=False``: for sgl's native ``/generate`` and for ``sgl.Engine``, so that input
lengths are exact) or text (``as_text=True``: for the OpenAI routes, which take text; random
ids are decoded to text and the text is re-tokenized, so its length is within a few tokens of
the requested one and ``prompt_len`` is the re-tokenized count).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["DATASETS", "BenchError", "BenchRequest", "Tokenizer", "generated_shared_prefix",
           "load_sharegpt", "random_requests"]

DATASETS = ("random", "sharegpt", "generated-shared-prefix")


class BenchError(Exception):
    """A problem the user can fix (a bad file, an unreachable server); printed without a
    traceback."""


class Tokenizer(Protocol):
    """What the generators need of a Hugging Face tokenizer."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark.

    :param prompt: token ids, or text.
    :param prompt_len: prompt tokens as counted here (``system`` included); a server's own count
        (chat template included) replaces it in the results when the server reports one.
    :param output_len: tokens to generate (``max_new_tokens`` / ``max_tokens``).
    :param system: text datasets only: a shared system prompt that comes before ``prompt``
        (a separate system message for the chat backend, prepended to ``prompt`` otherwise).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    system: str | None = None

    @property
    def text(self) -> str:
        """The whole prompt as one string (text prompts only)."""
        if not isinstance(self.prompt, str):
            raise TypeError("this request's prompt is token ids, not text")
        return (self.system or "") + self.prompt


def _lengths(rng: random.Random, length: int, ratio: float, count: int) -> list[int]:
    """``count`` lengths uniform in ``[max(1, round(length * ratio)), length]``."""
    if length < 1:
        raise BenchError(f"lengths must be at least 1, got {length}")
    if not 0.0 <= ratio <= 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1], got {ratio}")
    low = max(1, round(length * ratio))
    return [rng.randint(low, length) for _ in range(count)]


class _Vocab:
    """Random ordinary (non-special) token ids, and text of a given token length."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.ids = [i for i in range(len(tokenizer)) if i not in special]

    def random_ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]

    def text(self, n: int) -> tuple[str, int]:
        """Text that re-tokenizes to about ``n`` tokens (decoded random ids, trimmed or topped
        up a few times); returns it and its token count."""
        ids = self.random_ids(n)
        text = self.tokenizer.decode(ids)
        for _ in range(4):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n:
                break
            ids = ids[:n] if len(ids) > n else ids + self.random_ids(n - len(ids))
            text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))


def random_requests(tokenizer: Tokenizer, *, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 1.0, seed: int = 0,
                    as_text: bool = False) -> list[BenchRequest]:
    """SGLang's ``random`` shape: prompts of random token ids, input lengths uniform in
    ``[input_len * range_ratio, input_len]``, output lengths likewise (ratio 1: fixed)."""
    if num_prompts < 1:
        raise BenchError(f"--num-prompts must be at least 1, got {num_prompts}")
    rng = random.Random(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    vocab = _Vocab(tokenizer, rng)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        if as_text:
            text, n = vocab.text(n_in)
            out.append(BenchRequest(text, n, n_out))
        else:
            out.append(BenchRequest(vocab.random_ids(n_in), n_in, n_out))
    return out


def generated_shared_prefix(tokenizer: Tokenizer, *, num_groups: int, prompts_per_group: int,
                            system_prompt_len: int, question_len: int, output_len: int,
                            seed: int = 0, as_text: bool = False) -> list[BenchRequest]:
    """SGLang's ``generated-shared-prefix`` shape: ``num_groups`` random system prompts of
    ``system_prompt_len`` tokens, each followed by ``prompts_per_group`` random questions of
    ``question_len`` tokens; ``output_len`` tokens each. The requests are shuffled (seeded), so
    the groups arrive interleaved, as users of one prompt template would."""
    for name, value in (("--gsp-num-groups", num_groups),
                        ("--gsp-prompts-per-group", prompts_per_group),
                        ("--gsp-system-prompt-len", system_prompt_len),
                        ("--gsp-question-len", question_len), ("--gsp-output-len", output_len)):
        if value < 1:
            raise BenchError(f"{name} must be at least 1, got {value}")
    rng = random.Random(seed)
    vocab = _Vocab(tokenizer, rng)
    out = []
    for _ in range(num_groups):
        if as_text:
            system, _ = vocab.text(system_prompt_len)
            for _ in range(prompts_per_group):
                question, _ = vocab.text(question_len)
                n = len(tokenizer.encode(system + question, add_special_tokens=False))
                out.append(BenchRequest(question, n, output_len, system=system))
        else:
            system_ids = vocab.random_ids(system_prompt_len)
            for _ in range(prompts_per_group):
                ids = system_ids + vocab.random_ids(question_len)
                out.append(BenchRequest(ids, len(ids), output_len))
    rng.shuffle(out)
    return out


def _turns(entry: Any) -> list[tuple[str, str]] | None:
    """(role, text) pairs of one ShareGPT entry, or None when it has no conversation list.
    Accepts ``{"conversations"|"conversation": [{"from", "value"}]}`` and the
    ``{"role", "content"}`` spelling of the turns (also under ``"messages"``)."""
    if not isinstance(entry, dict):
        return None
    turns = next((entry[k] for k in ("conversations", "conversation", "messages")
                  if isinstance(entry.get(k), list)), None)
    if turns is None:
        return None
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            return None
        out.append((role, text))
    return out


def load_sharegpt(path: str | Path, tokenizer: Tokenizer, *, num_prompts: int, seed: int = 0,
                  output_len: int | None = None, context_len: int = 2048,
                  as_text: bool = True) -> list[BenchRequest]:
    """Prompts from a ShareGPT-format JSON file: a list of entries whose ``conversations`` hold
    turns ``{"from": "human"|"gpt", "value": text}``. The first turn is the prompt; the output
    length is the token count of the second turn (or ``output_len``). Entries with fewer than
    two turns, a prompt or answer under 2 tokens, a prompt over 1024 tokens or prompt + output
    over ``context_len`` are skipped (SGLang's filter). Entries are shuffled with ``seed`` and
    the first ``num_prompts`` usable ones are taken.

    :raises BenchError: for a missing or unreadable file, text that is not JSON, JSON that is not
        a list of conversations, or too few usable entries.
    """
    if num_prompts < 1:
        raise BenchError(f"--num-prompts must be at least 1, got {num_prompts}")
    file = Path(path)
    try:
        raw = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchError(f"ShareGPT file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read ShareGPT file {str(path)!r}: {exc}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BenchError(f"ShareGPT file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise BenchError(f"ShareGPT file {str(path)!r} must hold a JSON list of conversations "
                         f"([{{\"conversations\": [{{\"from\": \"human\", \"value\": ...}}, "
                         f"...]}}, ...]), got a JSON {type(data).__name__}")
    conversations = [_turns(entry) for entry in data]
    if data and not any(c is not None for c in conversations):
        raise BenchError(f"ShareGPT file {str(path)!r}: no entry has a 'conversations' list of "
                         "{\"from\": ..., \"value\": ...} turns")
    pairs = [(c[0][1], c[1][1]) for c in conversations if c is not None and len(c) >= 2]
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, answer in pairs:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        n_out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if len(ids) < 2 or n_out < 2 or len(ids) > 1024 or len(ids) + n_out > context_len:
            continue
        out.append(BenchRequest(prompt if as_text else ids, len(ids), n_out))
        if len(out) == num_prompts:
            return out
    raise BenchError(f"ShareGPT file {str(path)!r} has {len(out)} usable conversation(s) of "
                     f"{len(data)} entries; {num_prompts} requested (a usable one has a prompt "
                     f"and an answer of 2+ tokens, a prompt of at most 1024 tokens and prompt + "
                     f"answer within --sharegpt-context-len {context_len})")
