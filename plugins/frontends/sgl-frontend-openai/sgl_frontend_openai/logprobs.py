"""SGLang logprob entries ``(logprob, token_id, text)`` in OpenAI's two shapes."""

from __future__ import annotations

from typing import Any

__all__ = ["chat_logprobs", "completion_logprobs"]


def _text(entry: Any) -> str:
    return entry[2] if entry[2] is not None else ""


def chat_logprobs(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` of a chat completion (or of one stream chunk)."""
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(tokens)
    out = []
    for entry, top in zip(tokens, tops):
        text = _text(entry)
        out.append({
            "token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": _text(t), "logprob": t[0],
                              "bytes": list(_text(t).encode("utf-8"))} for t in top or []],
        })
    return out


def completion_logprobs(meta: dict[str, Any], *, echo: bool = False,
                        offset: int = 0) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` and ``text_offset`` (from ``offset`` on); with ``echo`` the prompt's
    tokens come first (the first has no logprob)."""
    entries: list[Any] = []
    tops: list[Any] = []
    if echo:
        prompt = meta.get("input_token_logprobs") or []
        entries += prompt
        tops += meta.get("input_top_logprobs") or [None] * len(prompt)
    output = meta.get("output_token_logprobs") or []
    entries += output
    tops += meta.get("output_top_logprobs") or [None] * len(output)
    tokens, values, top_maps, offsets = [], [], [], []
    pos = offset
    for entry, top in zip(entries, tops):
        text = _text(entry)
        tokens.append(text)
        values.append(entry[0])
        top_maps.append({_text(t): t[0] for t in top} if top else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_maps,
            "text_offset": offsets}
