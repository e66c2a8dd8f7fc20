"""Each grammar backend in a real scheduler with the real SmolLM2, in-process (xgrammar also
behind the real server in test_grammar_server.py): JSON schemas, regexes and EBNF grammars
constrain the output, a batch mixes constrained and unconstrained requests, grammars compile on
worker threads while the others decode, matchers roll back, jump-forward on and off, bad and
unsupported constraints fail with a message."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "core"))
from _cases import (  # noqa: E402
    EBNF, EBNF_PROMPT, PERSON, PERSON_PROMPT, REGEX, REGEX_PROMPT, check_ebnf, check_json,
    check_regex, without_bounds,
)
from sgl_grammar_xgrammar.backend import XGrammarBackend  # noqa: E402
from test_scheduler import Harness, Result  # noqa: E402

from sgl import hookimpl  # noqa: E402
from sgl.config import load_settings  # noqa: E402
from sgl.engine.messages import TokenBatch  # noqa: E402
from sgl.grammar import GrammarError  # noqa: E402
from sgl.grammar.select import GrammarChecker  # noqa: E402
from sgl.grammar.worker import BackendRecipe, CompileWorkers  # noqa: E402
from sgl.plugins import create_plugin_manager  # noqa: E402
from sgl.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
BACKENDS = ["xgrammar", "llguidance", "outlines"]


#: a file whose absence holds "gated" constraints compiling; named in the environment, which
#: the compile worker processes inherit (they run this module's GatedXGrammar)
GATE = Path(os.environ.setdefault("SGL_TEST_GRAMMAR_GATE",
                                  str(Path(tempfile.mkdtemp(prefix="sgl-gate-")) / "open")))


class GatedXGrammar(XGrammarBackend):
    """xgrammar whose compile of a constraint mentioning "gated" waits (in its compile worker)
    until the file :data:`GATE` exists: a grammar that takes as long to compile as the test
    wants."""

    name = "gated-xgrammar"

    def compile(self, kind: str, spec: str) -> Any:
        deadline = time.monotonic() + 120
        while "gated" in spec and not GATE.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().compile(kind, spec)


class GatedPlugin:
    @hookimpl
    def sgl_register_grammar_backends(self, register: Any) -> None:
        register("gated-xgrammar", GatedXGrammar)


class GrammarHarness(Harness):
    """The scheduler harness with one grammar backend (the gated xgrammar for "xgrammar")."""

    def __init__(self, tmp: Path, backend: str) -> None:
        pm = create_plugin_manager()
        if backend == "xgrammar":
            pm.register(GatedPlugin(), name="gated-grammar")
            backend = "gated-xgrammar"
        super().__init__(tmp, pm, max_running_requests=16, grammar_backend=backend)

    def text(self, r: Result) -> str:
        return self.tokenizer.decode(r.output_ids, skip_special_tokens=True)

    def drive(self, rids: list[str], until: list[str], max_steps: int = 3000) -> dict[str, Result]:
        """Step until the requests ``until`` finished; results of all ``rids``."""
        results = {rid: Result() for rid in rids}
        for _ in range(max_steps):
            self.scheduler.recv_requests(block=False)
            self.scheduler.step()
            while self.pull.poll(0):
                batch: TokenBatch = self.pull.recv_pyobj()
                for out in batch.outputs:
                    r = results[out.rid]
                    r.output_ids += out.new_token_ids
                    r.finish_reason, r.error = out.finish_reason, out.error
            if all(results[rid].finish_reason for rid in until):
                return results
        raise AssertionError("requests did not finish")


@pytest.fixture(scope="module", params=BACKENDS)
def gh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GrammarHarness]:
    h = GrammarHarness(tmp_path_factory.mktemp(request.param), request.param)
    h.backend_name = request.param  # type: ignore[attr-defined]
    with torch.inference_mode():
        yield h
    h.close()


def test_plugins_are_installed() -> None:
    pm = create_plugin_manager()
    for backend, plugin in (("xgrammar", "grammar-xgrammar"), ("outlines", "grammar-outlines"),
                            ("llguidance", "grammar-llguidance")):
        assert pm.records[plugin].available, pm.records[plugin].reason
        assert "sgl_register_grammar_backends" in pm.records[plugin].hooks
        assert pm.registries.grammar.entry(backend).owner == plugin


def test_constrained_and_free_requests_in_one_batch(gh: GrammarHarness) -> None:
    """JSON schema, regex, EBNF (where the backend does it) and a free request run together;
    each constrained output validates and ends with finish_reason stop."""
    name = gh.backend_name  # type: ignore[attr-defined]
    schema = without_bounds(PERSON) if name == "outlines" else PERSON
    free_alone = gh.run([gh.submit(gh.chat_ids("Say hello."), max_new_tokens=8,
                                   temperature=0)])
    rids = {
        "json": gh.submit(gh.chat_ids(PERSON_PROMPT), max_new_tokens=120, temperature=0,
                          json_schema=json.dumps(PERSON)),
        "regex": gh.submit(gh.chat_ids(REGEX_PROMPT), max_new_tokens=40, temperature=0,
                           regex=REGEX),
        "free": gh.submit(gh.chat_ids("Say hello."), max_new_tokens=8, temperature=0),
    }
    if name != "outlines":
        rids["ebnf"] = gh.submit(gh.chat_ids(EBNF_PROMPT), max_new_tokens=40, temperature=0,
                                 ebnf=EBNF)
    res = gh.run(list(rids.values()))
    for kind, rid in rids.items():
        assert res[rid].error is None, (kind, res[rid].error)
        if kind != "free":
            assert res[rid].finish_reason["type"] == "stop", (kind, gh.text(res[rid]))
    check_json(gh.text(res[rids["json"]]), schema)
    check_regex(gh.text(res[rids["regex"]]))
    if "ebnf" in rids:
        check_ebnf(gh.text(res[rids["ebnf"]]))
    assert res[rids["free"]].output_ids == next(iter(free_alone.values())).output_ids
    gh.assert_memory_empty()


def test_unbounded_array_ends_cleanly(gh: GrammarHarness) -> None:
    """An array without maxItems may make the model repeat until max_new_tokens: the request
    then ends with finish_reason length, without an error."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}
    if gh.backend_name == "outlines":  # type: ignore[attr-defined]
        schema["items"] = {"type": "integer"}
    rid = gh.submit(gh.chat_ids("Count from 1 to 100 as a JSON array."), max_new_tokens=24,
                    temperature=0, json_schema=json.dumps(schema))
    r = gh.run([rid])[rid]
    assert r.error is None
    if r.finish_reason["type"] == "length":
        assert len(r.output_ids) == 24
    else:
        check_json(gh.text(r), schema)


def test_matcher_rollback(gh: GrammarHarness) -> None:
    """After rollback the matcher allows exactly what it allowed before those tokens."""
    backend = gh.scheduler.grammar.backend
    matcher = backend.new_matcher(backend.compile("json_schema", json.dumps(PERSON)))
    masks = torch.zeros((3, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(masks, 0)
    tokens = gh.tokenizer.encode('{"name', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in tokens)
    matcher.fill_next_token_bitmask(masks, 1)
    assert not torch.equal(masks[0], masks[1])
    matcher.rollback(len(tokens))
    matcher.fill_next_token_bitmask(masks, 2)
    assert torch.equal(masks[0], masks[2])
    bad = gh.tokenizer.encode("hello", add_special_tokens=False)[0]
    assert not matcher.accept_token(bad)


def test_bad_and_unsupported_constraints(gh: GrammarHarness) -> None:
    """A constraint that does not compile fails with status 400 naming the problem; a kind the
    backend cannot compile is refused naming a backend that can."""
    name = gh.backend_name  # type: ignore[attr-defined]
    ids = gh.chat_ids("Hi")
    bad = gh.submit(ids, max_new_tokens=4, regex="(ab")
    schema = gh.submit(ids, max_new_tokens=4, json_schema='{"type": "foo"}')
    rids = [bad, schema]
    if name == "outlines":
        rids.append(gh.submit(ids, max_new_tokens=4, ebnf=EBNF))
    res = gh.run(rids)
    assert "invalid regex" in res[bad].error
    assert "invalid json_schema" in res[schema].error and "foo" in res[schema].error
    if name == "outlines":
        error = res[rids[2]].error
        assert "outlines grammar backend cannot compile ebnf" in error
        assert "xgrammar" in error and "llguidance" in error
    with pytest.raises(GrammarError, match="invalid regex"):
        gh.scheduler.grammar.backend.compile("regex", "[a-")


@pytest.mark.parametrize("gh", ["xgrammar"], indirect=True)  # the gated backend wraps it
def test_slow_compilation_blocks_nobody_and_jump_forward(gh: GrammarHarness) -> None:
    """(xgrammar) A grammar held compiling waits in the grammar queue while a free request and
    a request whose grammar compiled meanwhile (on the other worker) finish; then it runs.
    Jump-forward appends forced tokens; off, every token is sampled; both outputs validate."""
    GATE.unlink(missing_ok=True)
    s = gh.scheduler
    slow = gh.submit(gh.chat_ids(PERSON_PROMPT), max_new_tokens=120, temperature=0,
                     json_schema=json.dumps({**PERSON, "title": "gated"}))
    regex = gh.submit(gh.chat_ids(REGEX_PROMPT), max_new_tokens=40, temperature=0, regex=REGEX)
    free = gh.submit(gh.chat_ids("Say hello."), max_new_tokens=16, temperature=0)
    try:
        res = gh.drive([slow, regex, free], until=[regex, free])
        assert res[slow].finish_reason is None and not res[slow].output_ids
        assert [r.rid for r, _ in s.grammar.queue] == [slow]
        check_regex(gh.text(res[regex]))
    finally:
        GATE.touch()
    done = gh.drive([slow], until=[slow])[slow]
    check_json(gh.text(done), PERSON)
    jumped = s.grammar.stats.jump_forward_tokens
    assert jumped > 0
    hits = s.grammar.stats.cache_hits
    s.grammar.jump_forward = False
    try:
        rid = gh.submit(gh.chat_ids(PERSON_PROMPT), max_new_tokens=120, temperature=0,
                        json_schema=json.dumps({**PERSON, "title": "gated"}))
        off = gh.run([rid])[rid]
    finally:
        s.grammar.jump_forward = True
    assert s.grammar.stats.cache_hits == hits + 1  # compiled once, reused
    assert s.grammar.stats.jump_forward_tokens == jumped
    check_json(gh.text(off), PERSON)


@pytest.mark.parametrize("gh", ["xgrammar"], indirect=True)  # the gated backend wraps it
def test_compile_past_its_deadline_is_killed(gh: GrammarHarness) -> None:
    """A constraint still compiling at --grammar-compile-timeout: its worker process is
    killed, the request fails naming the flag while a free request decodes, the same
    constraint is refused again at once (cached), and the next constraint compiles in a fresh
    worker."""
    GATE.unlink(missing_ok=True)
    grammar = gh.scheduler.grammar
    workers = grammar.workers
    assert workers is not None
    workers.timeout, lost = 2.0, workers.lost
    hung = json.dumps({**PERSON, "title": "gated past the deadline"})
    try:
        slow = gh.submit(gh.chat_ids(PERSON_PROMPT), max_new_tokens=20, temperature=0,
                         json_schema=hung)
        free = gh.submit(gh.chat_ids("Say hello."), max_new_tokens=8, temperature=0)
        start = time.monotonic()
        res = gh.drive([slow, free], until=[slow, free])
        took = time.monotonic() - start
        again = gh.submit(gh.chat_ids(PERSON_PROMPT), max_new_tokens=20, temperature=0,
                          json_schema=hung)
        refused = gh.drive([again], until=[again])[again]
    finally:
        workers.timeout = 30.0
        GATE.touch()
    assert res[free].error is None and res[free].output_ids
    assert res[slow].error is not None and "--grammar-compile-timeout" in res[slow].error
    assert 1.9 < took < 30
    assert refused.error == res[slow].error
    assert workers.lost == lost + 1
    rid = gh.submit(gh.chat_ids(REGEX_PROMPT), max_new_tokens=40, temperature=0, regex=REGEX)
    after = gh.run([rid])[rid]
    assert after.error is None
    check_regex(gh.text(after))


@pytest.mark.parametrize("gh", ["outlines"], indirect=True)
def test_compile_past_the_memory_cap_fails_alone(gh: GrammarHarness) -> None:
    """(outlines) ``[ab]*a[ab]{30}`` has a 2^30-state automaton, which outlines-core builds in
    full: under a 256 MiB cap its compile worker fails (not the scheduler), the error names
    --grammar-compile-memory-mb, and a fresh worker compiles the next constraint."""
    backend = gh.scheduler.grammar.backend
    workers = CompileWorkers(
        lambda: BackendRecipe(type(backend), gh.tokenizer, backend.vocab_size,
                              backend.stop_token_ids),
        size=1, timeout=120, memory_mb=256, backend_name="outlines")
    try:
        with pytest.raises(GrammarError, match="more than 256 MiB.*--grammar-compile-memory-mb"):
            workers.compile("regex", "[ab]*a[ab]{30}")
        assert workers.lost == 1
        matcher = backend.new_matcher(backend.deserialize(workers.compile("regex", "[0-9]+")))
    finally:
        workers.close()
    digit = gh.tokenizer.convert_tokens_to_ids("7")
    assert matcher.accept_token(digit)
    assert not matcher.accept_token(gh.tokenizer.convert_tokens_to_ids("a"))


def test_checker_in_the_server_process() -> None:
    """The server-side check: syntax errors, an unsupported kind naming a backend that can, and
    the backend switched off."""
    registry = create_plugin_manager().registries.grammar
    xgr = GrammarChecker("xgrammar", registry)
    for params, match in [
        (SamplingParams(regex="(ab"), "invalid regex: .*parenthesis"),
        (SamplingParams(json_schema="{not json"), "invalid json_schema: not valid JSON"),
        (SamplingParams(json_schema='{"type": "foo"}'), "invalid json_schema: .*foo"),
        (SamplingParams(ebnf='root ::= foo'), 'invalid ebnf: .*"foo" is not defined'),
        (SamplingParams(structural_tag='{"structures": 1}'), "invalid structural_tag"),
    ]:
        with pytest.raises(ValueError, match=match):
            xgr.check(params)
    xgr.check(SamplingParams(json_schema=json.dumps(PERSON)))
    with pytest.raises(ValueError, match="invalid regex: .*unterminated"):
        GrammarChecker("outlines", registry).check(SamplingParams(regex="(ab"))
    with pytest.raises(ValueError, match="invalid ebnf"):
        GrammarChecker("llguidance", registry).check(SamplingParams(ebnf="root ::= foo"))
    with pytest.raises(ValueError, match="the outlines grammar backend cannot compile ebnf; the "
                                         "llguidance and xgrammar backends can"):
        GrammarChecker("outlines", registry).check(SamplingParams(ebnf=EBNF))
    with pytest.raises(ValueError, match="structural_tag.*the xgrammar backend can"):
        GrammarChecker("llguidance", registry).check(SamplingParams(structural_tag="{}"))
    with pytest.raises(ValueError, match=r"off \(--grammar-backend none\)"):
        GrammarChecker(None, registry).check(SamplingParams(regex="a"))
    with pytest.raises(ValueError, match="sgl-grammar-xgrammar"):
        GrammarChecker(None, type(registry)("grammar backend")).check(SamplingParams(regex="a"))
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams.from_dict({"regex": "a", "ebnf": EBNF})
    start = time.perf_counter()
    xgr.check(SamplingParams(json_schema=json.dumps(PERSON)))
    assert time.perf_counter() - start < 0.01  # remembered


def test_grammar_settings_round_trip(tmp_path: Path) -> None:
    """--grammar-backend and --disable-jump-forward from flags, environment and config file;
    auto and none are accepted beside the registered names, anything else is refused."""
    from sgl.config import ConfigError
    from sgl.grammar.select import resolve_backend

    pm = create_plugin_manager()
    assert load_settings(env={}).grammar_backend == "auto"
    assert resolve_backend("auto", pm.registries.grammar) == "xgrammar"
    assert resolve_backend("none", pm.registries.grammar) is None
    flag = load_settings(env={}, cli={"grammar_backend": "none", "disable_jump_forward": True})
    assert (flag.grammar_backend, flag.disable_jump_forward) == ("none", True)
    env = load_settings(env={"SGL_GRAMMAR_BACKEND": "llguidance",
                             "SGL_DISABLE_JUMP_FORWARD": "1"})
    assert (env.grammar_backend, env.disable_jump_forward) == ("llguidance", True)
    config = tmp_path / "sgl.toml"
    config.write_text('grammar_backend = "outlines"\n')
    from_file = load_settings(env={}, config_file=config)
    assert from_file.grammar_backend == "outlines"
    assert from_file.sources["grammar_backend"].startswith("file")
    for settings in (flag, env, from_file):
        pm.check_backends(settings)
    with pytest.raises(ConfigError,
                       match="'foo'.*available: auto, none, llguidance, outlines, xgrammar"):
        pm.check_backends(load_settings(env={}, cli={"grammar_backend": "foo"}))
