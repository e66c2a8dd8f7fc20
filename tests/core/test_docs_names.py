"""The pages that describe the code name only what exists.

``docs/structure.md``, ``docs/architecture.md`` and ``docs/hooks.md`` name modules, functions,
classes, flags and environment variables in backticks. Each such name is checked against the
code: a path must exist; a dotted name must import (``sgl.``-relative names too, as the pages
write ``engine.scheduler.Scheduler``); a call's function, a class name and a snake_case name
must be defined or used in the code of the core or a plugin; a flag must be an option of an
``sgl`` command; an ``SGL_*`` variable must be read by the code. (The hooks themselves are
checked by ``test_hookspecs.py``.)
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["docs/structure.md", "docs/architecture.md", "docs/hooks.md"]
CODE_DIRS = [ROOT / "core", ROOT / "plugins", ROOT / "docs" / "plugins"]
#: the example plugin of the tutorial, whose options the pages use as examples
EXAMPLE_PLUGIN = ROOT / "docs" / "plugins" / "sgl-hello" / "sgl_hello" / "plugin.py"
#: names the pages mention on purpose although the code has none: what not to write, and
#: FlashInfer's own vocabulary in the sketch of a FlashInfer backend
NOT_OURS = {"sgl_register_attention_backend": "the misspelled hook name hooks.md warns of",
            "kv_indptr": "FlashInfer's argument name"}
#: names from other projects the pages mention, checked against those projects by importing
FOREIGN_MODULES = ("torch", "transformers", "pluggy", "click", "fastapi", "starlette",
                   "pydantic", "zmq", "xgrammar", "outlines", "llguidance", "uvicorn",
                   "flashinfer", "triton", "tokenizers", "prometheus_client", "asyncio")


@cache
def code_text() -> str:
    parts = []
    for folder in CODE_DIRS:
        for path in folder.rglob("*"):
            if path.suffix in (".py", ".c", ".h", ".cpp", ".toml") and "build" not in path.parts:
                parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


@cache
def cli_flags() -> frozenset[str]:
    import click

    from sgl.cli import build_cli
    from sgl.plugins import create_plugin_manager

    flags: set[str] = {"--help", "--version", "--config", "--plugin", "--disable-plugin"}

    def walk(command: click.Command) -> None:
        for param in command.params:
            for opt in [*param.opts, *param.secondary_opts]:
                flags.add(opt)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(build_cli(create_plugin_manager()))
    # the example plugin's settings (plugin id "hello"), as sgl derives their flags
    example = importlib.util.spec_from_file_location("sgl_hello_example", EXAMPLE_PLUGIN)
    module = importlib.util.module_from_spec(example)
    sys.modules[example.name] = module  # dataclasses look their module up there
    example.loader.exec_module(module)
    flags |= {f"--hello-{f.name.replace('_', '-')}"
              for f in dataclasses.fields(module.sgl_add_config())}
    return frozenset(flags)


def spans(page: str) -> list[str]:
    """The backticked spans of a page, outside fenced code blocks."""
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def _module(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def resolves(dotted: str) -> bool | None:
    """Whether ``a.b.c`` imports as a module with attributes (as given, or under ``sgl.`` as
    the pages write ``engine.scheduler``); None when it does not start with a module at all
    (``Scheduler.step``, ``self.pool.alloc``)."""
    parts = dotted.split(".")
    if parts[0] != "sgl" and _module(f"sgl.{parts[0]}") is not None:
        candidate = ["sgl", *parts]
    elif parts[0] == "sgl" or (parts[0] != "plugins" and _module(parts[0]) is not None):
        candidate = parts
    else:
        return None
    for cut in range(len(candidate), 0, -1):
        obj = _module(".".join(candidate[:cut]))
        if obj is None:
            continue
        try:
            for attr in candidate[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@cache
def class_bodies() -> dict[str, str]:
    """Class name -> its source (all classes of that name in the core and plugins)."""
    bodies: dict[str, str] = {}
    for folder in CODE_DIRS:
        for path in folder.rglob("*.py"):
            if "build" in path.parts:
                continue
            for match in re.finditer(r"^class (\w+).*?(?=^\S|\Z)", path.read_text(),
                                     flags=re.S | re.M):
                bodies[match.group(1)] = bodies.get(match.group(1), "") + match.group(0)
    return bodies


def member_of(cls: str, attr: str) -> bool:
    """Whether class ``cls`` defines ``attr``: a method, a field, an enum member or an
    attribute set on ``self``."""
    body = class_bodies().get(cls, "")
    return re.search(rf"def {attr}\b|self\.{attr}\b|^\s+{attr}\s*[:=]", body,
                     flags=re.M) is not None


def defined(name: str) -> bool:
    return (hasattr(builtins, name)
            or re.search(rf"\b{re.escape(name)}\b", code_text()) is not None)


#: on these pages, names that are variables of the examples, not modules: ``server`` is the
#: ServerContext a frontend gets, ``cli`` the click group of sgl_register_commands
VARIABLES = {"docs/hooks.md": ("server", "cli")}


def problem(span: str, variables: tuple[str, ...] = ()) -> str | None:
    """Why ``span`` names nothing that exists, or None."""
    head = span.split()[0] if span.split() else span
    if span in NOT_OURS or head.endswith("_") or len(head) < 4:
        return None
    if head.startswith("--"):
        flag = head.split("=")[0]
        if "/" in flag or "<" in flag or not re.fullmatch(r"--[a-z][\w-]*", flag):
            return None  # a pattern such as --x/--no-x
        return None if flag in cli_flags() else "no sgl command has this option"
    if re.fullmatch(r"SGL_[A-Z0-9_]+", head.split("=")[0]):
        var = head.split("=")[0]
        derived = "--" + var[4:].lower().replace("_", "-")  # a setting's variable
        return None if defined(var) or derived in cli_flags() else \
            "the code reads no such variable"
    if re.fullmatch(r"[\w.-]+(/[\w.-]*)+|[\w-]+\.(py|c|h|cpp|toml|md|yaml)", head):
        if head.startswith(("text/", "application/")) or "*" in head:
            return None  # a media type or a pattern
        name = head.rstrip("/")
        bases = [ROOT, ROOT / "core", ROOT / "core" / "sgl", ROOT / "docs"]
        if any((b / name).exists() for b in bases):
            return None
        if "/" not in name and any(folder.rglob(name) for folder in CODE_DIRS[:2]):
            return None  # a file named beside its package
        return "no such path"
    call = re.fullmatch(r"([A-Za-z_][\w.]*)\(.*\)", span)
    name = call.group(1) if call else span
    if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name):
        first, *_, last = name.split(".")
        if first in FOREIGN_MODULES:
            return None
        found = None if first in variables else resolves(name)
        if found:
            return None
        if found is None and first[0].isupper() and first in class_bodies():
            return None if member_of(first, name.split(".")[1]) else f"{first} has no such member"
        if found is None:  # an expression on a variable of an example
            return None if defined(last) else "not defined or used in the code"
        return "does not import"
    if re.fullmatch(r"[A-Za-z_]\w*", name) and (call or "_" in name or
                                                re.fullmatch(r"[A-Z]\w*[a-z]\w*", name)):
        return None if defined(name) else "not defined or used in the code"
    return None


@pytest.mark.parametrize("page", PAGES)
def test_every_name_on_the_page_exists(page: str) -> None:
    variables = VARIABLES.get(page, ())
    missing = sorted({f"`{s}`: {why}" for s in spans(page) if (why := problem(s, variables))})
    assert not missing, f"{page} names what the code does not have:\n" + "\n".join(missing)


def test_the_check_catches_a_name_that_is_gone() -> None:
    assert problem("admit_waiting") == "not defined or used in the code"
    assert problem("engine.forward_batch.ForwardBatch") == "does not import"
    assert problem("server/sse.py") == "no such path"
    assert problem("--enable-frobnication") == "no sgl command has this option"
    assert problem("--speculative-algorithm") is None
    assert problem("forward_batch.ForwardBatch") is None
    assert problem("Scheduler.run_step") == "Scheduler has no such member"
    assert problem("Scheduler.recv_requests") is None
    assert problem("make_forward_batch(runner, mode, seqs)") is None
