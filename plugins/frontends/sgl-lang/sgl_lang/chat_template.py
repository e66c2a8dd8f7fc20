"""Chat templates of the language: the text that opens and closes each role.

The language builds the prompt as text, role by role, so it needs each role's prefix and suffix
rather than a Jinja template that renders whole conversations. A backend picks one of the
templates below by asking the model itself (see :func:`detect_template`): it renders a probe
conversation with the served model's own chat template and matches its markers, falling back to
the model's name and then to ``default``. ``RuntimeEndpoint(url, chat_template="chatml")``
overrides the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChatTemplate", "TEMPLATES", "detect_template", "get_template"]


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    markers: tuple[str, ...] = ()  # text that identifies it in a rendered conversation
    name_hints: tuple[str, ...] = ()  # substrings of model names that use it

    def prefix(self, role: str) -> str:
        return self.roles[role][0]

    def suffix(self, role: str) -> str:
        return self.roles[role][1]


TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in [
    ChatTemplate("chatml", {r: (f"<|im_start|>{r}\n", "<|im_end|>\n")
                            for r in ("system", "user", "assistant")},
                 markers=("<|im_start|>",), name_hints=("smollm", "qwen", "chatml", "hermes")),
    ChatTemplate("llama-3", {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
                             for r in ("system", "user", "assistant")},
                 markers=("<|start_header_id|>",), name_hints=("llama-3", "llama3")),
    ChatTemplate("default", {"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"),
                             "assistant": ("ASSISTANT: ", "\n")}),
]}


def get_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: "
                         f"{', '.join(TEMPLATES)}") from None


def detect_template(rendered: str | None = None, model_name: str = "") -> ChatTemplate:
    """The template whose markers appear in ``rendered`` (a probe conversation rendered by the
    model's own chat template), else the first whose name hint is in ``model_name``, else
    ``default``."""
    for template in TEMPLATES.values():
        if rendered and any(m in rendered for m in template.markers):
            return template
    lowered = model_name.lower()
    for template in TEMPLATES.values():
        if any(h in lowered for h in template.name_hints):
            return template
    return TEMPLATES["default"]
