"""The frontend language (plugin sgl-lang) against the real session server: programs, select
scores checked against /generate's own logprobs, fork, run_batch hitting the prefix cache,
streaming, the compiler, the OpenAI backend and the errors."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import uuid
from typing import Any

import httpx
import pytest

import sgl
from sgl_testing import ServerProcess, run_cli

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def backend(server: ServerProcess) -> Any:
    endpoint = sgl.RuntimeEndpoint(server.base_url)
    sgl.set_default_backend(endpoint)
    yield endpoint
    sgl.set_default_backend(None)


def generate(server: ServerProcess, **body: Any) -> Any:
    response = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_plugin_is_installed() -> None:
    plugins = {p["name"]: p for p in json.loads(run_cli(["plugins", "--json"]).stdout)}
    assert plugins["lang"]["available"]
    assert plugins["lang"]["hooks"] == ["sgl_register_api_names", "sgl_register_commands"]


def test_core_exposes_the_language() -> None:
    import sgl_lang

    assert sgl.function is sgl_lang.function and sgl.gen is sgl_lang.gen
    assert sgl.RuntimeEndpoint is sgl_lang.RuntimeEndpoint
    assert sgl.Engine.__name__ == "Engine" and sgl.hookimpl is not None
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        sgl.nonsense  # noqa: B018


def test_missing_plugin_names_it() -> None:
    code = "import sys; sys.modules['sgl_lang'] = None; import sgl; sgl.gen"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "module 'sgl' has no attribute 'gen'" in out.stderr
    assert "plugin 'lang' is unavailable" in out.stderr


@sgl.function
def few_shot_qa(s, question):
    s += "Answer with one word.\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=16, stop="\n", temperature=0)


def test_few_shot_qa_with_stop(server: ServerProcess, backend: Any) -> None:
    state = few_shot_qa.run(question="What is the capital of France?")
    answer = state["answer"]
    assert "Paris" in answer and "\n" not in answer
    prompt = state.text()[:-len(answer)]
    direct = generate(server, text=prompt, sampling_params={
        "max_new_tokens": 16, "stop": "\n", "temperature": 0})
    assert direct["text"] == answer
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop"
    assert state.text().endswith("A:" + answer)


def test_multi_turn_chat(server: ServerProcess, backend: Any) -> None:
    @sgl.function
    def chat(s, first, second):
        s += sgl.system("You are a terse assistant.")
        s += sgl.user(first)
        s += sgl.assistant(sgl.gen("a1", max_tokens=12, temperature=0))
        with s.user():
            s += second
        with s.assistant():
            s += sgl.gen("a2", max_tokens=12, temperature=0)

    state = chat.run(first="What is 2+2?", second="And 3+3?")
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == "What is 2+2?" and messages[3]["content"] == "And 3+3?"
    assert messages[2]["content"] == state["a1"] and messages[4]["content"] == state["a2"]
    assert state["a1"] and state["a2"]
    # the text before the last answer is the model's own chat template for those messages
    templated = httpx.post(f"{server.base_url}/v1/tokenize", json={"messages": messages[:4]},
                           timeout=30).json()["tokens"]
    assert state.text().endswith(state["a2"] + "<|im_end|>\n")
    prompt = state.text()[:-len(state["a2"] + "<|im_end|>\n")]
    ours = httpx.post(f"{server.base_url}/v1/tokenize", json={"prompt": prompt},
                      timeout=30).json()["tokens"]
    assert ours == templated


def direct_scores(server: ServerProcess, prefix: str, choices: list[str]) -> list[float]:
    """Each choice's score as SGLang's frontend computes it, from plain /generate calls: the
    mean logprob of the tokens from two before the prefix's end (a choice may merge with the
    prefix's last token), the first of them left out where the prefix still ends with it."""
    n = generate(server, text=prefix, sampling_params={"max_new_tokens": 0})[
        "meta_info"]["prompt_tokens"]
    scores = []
    for choice in choices:
        meta = generate(server, text=prefix + choice, sampling_params={"max_new_tokens": 0},
                        return_logprob=True, logprob_start_len=0,
                        return_text_in_logprobs=True)["meta_info"]
        entries = meta["input_token_logprobs"][max(n - 2, 0):]
        if prefix.endswith(entries[0][2]):
            entries = entries[1:]
        lps = [e[0] for e in entries if e[0] is not None]
        scores.append(sum(lps) / len(lps))
    return scores


SELECT_PREFIX = "Q: Which animal says meow?\nA: The animal that says meow is the"
SELECT_CHOICES = [" dog", " cat", " cow", " elephant in the room"]


def test_select_picks_the_best_scored_choice(server: ServerProcess, backend: Any) -> None:
    @sgl.function
    def pick(s):
        s += SELECT_PREFIX
        s += sgl.select("animal", SELECT_CHOICES)

    state = pick.run()
    expected = direct_scores(server, SELECT_PREFIX, SELECT_CHOICES)
    scores = state.get_meta_info("animal")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(expected, abs=1e-3)
    assert state["animal"] == SELECT_CHOICES[max(range(4), key=lambda i: expected[i])]
    assert state.text() == SELECT_PREFIX + state["animal"]
    # gen(choices=...) is select
    assert pick.run()["animal"] == state["animal"]


def test_select_after_a_prefix_that_merges_with_the_choices(server: ServerProcess,
                                                            backend: Any) -> None:
    """"Answer: " + "no" ends in the token " no": the prompt with a choice has no more tokens
    than the prefix. sgl used to ask for logprobs from the prefix's end, which the server
    refused (400: logprob_start_len must be less than the prompt length)."""
    prefix, choices = "Is the sky blue? Answer: ", ["yes", "no"]

    @sgl.function
    def answer(s):
        s += prefix + sgl.select("a", choices)

    state = answer.run()
    scores = state.get_meta_info("a")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(direct_scores(server, prefix, choices), abs=1e-3)
    assert all(math.isfinite(x) for x in scores) and state["a"] in choices


def test_select_methods(server: ServerProcess, backend: Any) -> None:
    @sgl.function
    def pick(s, method):
        s += SELECT_PREFIX
        s += sgl.gen("animal", choices=SELECT_CHOICES, choices_method=method)

    greedy = pick.run(method=sgl.greedy_token_selection)
    # the best logprob at the first position where the choices differ (the scored entries
    # start with the prefix's last token, the same for all four: equal up to the order of the
    # sums, which the quantized matmuls of the GGUF choose by the number of rows in a forward)
    scored = greedy.get_meta_info("animal")["input_token_logprobs"]
    firsts = [lps[0] for lps in scored]
    assert max(firsts) - min(firsts) <= 1e-4
    assert greedy["animal"] == SELECT_CHOICES[max(range(4), key=lambda i: scored[i])]

    uncond = pick.run(method=sgl.unconditional_likelihood_normalized)
    meta = uncond.get_meta_info("animal")
    best = max(range(4), key=lambda i: meta["unconditional_scores"][i])
    assert uncond["animal"] == SELECT_CHOICES[best]
    # the unconditional logprobs are those of each choice alone
    alone = generate(server, text=SELECT_CHOICES[3], sampling_params={"max_new_tokens": 0},
                     return_logprob=True, logprob_start_len=0)["meta_info"]
    assert meta["unconditional_token_logprobs"][3] == pytest.approx(
        [e[0] for e in alone["input_token_logprobs"][1:]], abs=1e-3)


def skip_without_grammar(exc: sgl.BackendError) -> None:
    """Skip when the server refused regex/json_schema as unknown: no grammar backend there."""
    if exc.status == 400 and "unknown sampling parameter" in str(exc):
        pytest.skip(f"the server has no grammar backend (plugin sgl-grammar-xgrammar is not "
                    f"installed): {exc}")


def test_regex(backend: Any) -> None:
    @sgl.function
    def code(s):
        s += "Here is a three digit number:"
        s += sgl.gen("number", max_tokens=8, regex=r" [0-9]{3}", temperature=0)

    try:
        state = code.run()
    except sgl.BackendError as exc:
        skip_without_grammar(exc)
        raise
    import re

    assert re.fullmatch(r" [0-9]{3}", state["number"]), state["number"]


def test_json_schema(backend: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
              "required": ["name"], "additionalProperties": False}

    @sgl.function
    def person(s):
        s += "A person as JSON:"
        s += sgl.gen("json", max_tokens=32, json_schema=schema, temperature=0)

    try:
        state = person.run()
    except sgl.BackendError as exc:
        skip_without_grammar(exc)
        raise
    assert set(json.loads(state["json"])) == {"name"}


def test_gen_int(backend: Any) -> None:
    @sgl.function
    def arithmetic(s):
        s += "Q: What is 2 + 3?\nA: The answer is "
        s += sgl.gen("n", dtype=int, max_tokens=4, temperature=0)

    state = arithmetic.run()
    assert state["n"] == 5 and isinstance(state["n"], int)
    # without a grammar backend, dtype=int parses the free text instead
    plain = sgl.RuntimeEndpoint(backend.base_url)
    plain.supports_regex = False
    state = arithmetic.run(backend=plain)
    assert state["n"] == 5 and isinstance(state["n"], int)


def test_fork_and_join(server: ServerProcess, backend: Any) -> None:
    marker = uuid.uuid4().hex
    intro = f"[{marker}] Here are three short tips for staying healthy, one per line.\n"

    @sgl.function
    def tips(s):
        s += intro
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}: Always"
            f += sgl.gen("tip", max_tokens=6, temperature=0)
        forks.join()
        s += "".join(f"Tip {i + 1}: Always{t}\n" for i, t in enumerate(s["tip"]))

    state = tips.run()
    assert isinstance(state["tip"], list) and len(state["tip"]) == 3
    assert all(state["tip"])
    assert state.text().startswith(intro)
    # before forking, the text was committed: every branch found it in the cache
    intro_tokens = generate(server, text=intro, sampling_params={"max_new_tokens": 0})[
        "meta_info"]["prompt_tokens"]
    for meta in state.get_meta_info("tip"):
        assert meta["cached_tokens"] >= intro_tokens - 1, meta
    # a branch is the parent's text plus its own, the same as a straight program
    straight = generate(server, text=intro + "Tip 2: Always",
                        sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert state["tip"][1] == straight["text"]


def test_fork_branches_run_in_parallel(backend: Any) -> None:
    @sgl.function
    def branches(s):
        s += "Count slowly:"
        forks = s.fork(2)
        forks += sgl.gen("x", max_tokens=4, temperature=0)
        s["threads"] = [f.executor._thread.name for f in forks]
        s["xs"] = [f["x"] for f in forks]
        forks.join("concate_and_append")

    state = branches.run()
    first, second = state["threads"]
    assert first != second  # one worker thread per branch
    assert all(state["xs"]) and state["xs"][0] == state["xs"][1]  # greedy, same text
    assert state.text() == "Count slowly:" + "".join(state["xs"])


def test_run_batch_computes_the_shared_prefix_once(server: ServerProcess,
                                                   backend: Any) -> None:
    marker = uuid.uuid4().hex
    shots = "".join(f"Q: What is {i} + {i}?\nA: {2 * i}\n" for i in range(1, 9))

    @sgl.function
    def add(s, a, b):
        s += f"[{marker}] Additions.\n" + shots
        s += f"Q: What is {a} + {b}?\nA:"
        s += sgl.gen("sum", max_tokens=3, stop="\n", temperature=0)

    prefix = add.prefix()
    assert prefix == f"[{marker}] Additions.\n" + shots + "Q: What is "
    states = add.run_batch([{"a": i, "b": i + 1} for i in range(32)])
    assert len(states) == 32
    prefix_tokens = generate(server, text=prefix, sampling_params={"max_new_tokens": 0})[
        "meta_info"]["prompt_tokens"]
    for state in states:
        meta = state.get_meta_info("sum")
        assert meta["cached_tokens"] >= prefix_tokens - 1, meta
    assert [s.text().split("Q: What is ")[-1].split("?")[0] for s in states] == \
        [f"{i} + {i + 1}" for i in range(32)]

    # without the warm-up, the instances admitted first all compute the prefix themselves
    marker = uuid.uuid4().hex
    cold = add.run_batch([{"a": i, "b": i + 1} for i in range(8)], warmup=False)
    assert min(s.get_meta_info("sum")["cached_tokens"] for s in cold) < prefix_tokens - 1


def test_run_batch_generator_and_progress_bar(backend: Any, capsys: Any) -> None:
    results = few_shot_qa.run_batch(
        [{"question": q} for q in ["What is the capital of Spain?", "What is 1 + 1?"]],
        generator_style=True, progress_bar=True, num_threads=2)
    assert not isinstance(results, list)
    states = list(results)
    assert [s.text().split("Q: ")[-1].split("\n")[0] for s in states] == \
        ["What is the capital of Spain?", "What is 1 + 1?"]
    assert "2/2" in capsys.readouterr().err


def test_streaming(backend: Any) -> None:
    @sgl.function
    def story(s, topic):
        s += "One sentence about " + topic + ":"
        s += sgl.gen("sentence", max_tokens=10, temperature=0)

    state = story.run(topic="the sea", stream=True)
    chunks = list(state.text_iter("sentence"))
    assert len(chunks) > 1
    assert "".join(chunks) == state["sentence"]
    assert state.text() == "One sentence about the sea:" + state["sentence"]

    state = story.run(topic="the sea", stream=True)
    everything = list(state.text_iter())
    assert "".join(everything) == state.text()

    async def collect() -> list[str]:
        state = story.run(topic="the sea", stream=True)
        return [c async for c in state.text_async_iter("sentence")]

    assert "".join(asyncio.run(collect())) == "".join(chunks)


def test_reading_a_variable_blocks_until_it_exists(backend: Any) -> None:
    @sgl.function
    def two(s):
        s += "Say hi:"
        s += sgl.gen("first", max_tokens=3, temperature=0)
        s += "\nSay bye:"
        s += sgl.gen("second", max_tokens=3, temperature=0)

    state = two.run(stream=True)  # returns before anything is generated
    assert not state.executor.variable_event["second"].is_set()
    assert isinstance(state["second"], str)  # waits
    assert state.executor.variable_event["second"].is_set()


def test_compiled_program_runs_the_graph_in_order(backend: Any) -> None:
    @sgl.function
    def tips(s, topic):
        s += "Two tips about " + topic + ".\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:"
            f += sgl.gen("tip", max_tokens=5, temperature=0)
        forks.join()
        s += "Summary: " + forks[0]["tip"] + " and " + forks[1]["tip"]

    compiled = tips.compile()
    order = [compiled.nodes[i] for i in compiled.order]
    # every branch node comes after the fork, the join after both branches' gens
    kinds = [type(item).__name__ for _, item in order]
    assert kinds.index("ForkOp") < kinds.index("Gen") < kinds.index("JoinOp")
    assert kinds.count("Gen") == 2 and kinds.index("JoinOp") > max(
        i for i, k in enumerate(kinds) if k == "Gen")
    interpreted = tips.run(topic="sleep")
    assert compiled.run(topic="sleep").text() == interpreted.text()
    assert [s.text() for s in compiled.run_batch([{"topic": "sleep"}])] == [interpreted.text()]


def test_openai_backend(server: ServerProcess, backend: Any) -> None:
    openai_backend = sgl.OpenAI("default", base_url=f"{server.base_url}/v1")

    @sgl.function
    def chat(s):
        s += sgl.system("You are a terse assistant.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    via_openai = chat.run(backend=openai_backend)["answer"]
    assert via_openai == chat.run()["answer"]  # the same prompt through the chat template

    @sgl.function
    def pick(s):
        s += SELECT_PREFIX
        s += sgl.select("animal", SELECT_CHOICES)

    state = pick.run(backend=openai_backend)
    assert state.get_meta_info("animal")["normalized_prompt_logprobs"] == pytest.approx(
        pick.run().get_meta_info("animal")["normalized_prompt_logprobs"], abs=1e-3)


def test_errors(server: ServerProcess, backend: Any) -> None:
    @sgl.function
    def one(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2)

    with pytest.raises(KeyError, match="unknown variable 'y'.*variables: x"):
        one.run()["y"]

    with pytest.raises(sgl.BackendError, match="cannot reach the server at http://127.0.0.1:9"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9")

    @sgl.function
    def bad(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2, temperature=-1)

    with pytest.raises(sgl.BackendError, match="400.*temperature must be a number >= 0"):
        bad.run()

    @sgl.function
    def nested(s):
        with s.user():
            s += sgl.assistant("no")

    with pytest.raises(sgl.LangError, match=r"assistant\(\) begins inside user\(\)"):
        nested.run()

    @sgl.function
    def picture(s):
        s += sgl.image("cat.png")

    with pytest.raises(sgl.LangError, match="not supported: the served models are text-only"):
        picture.run()

    sgl.set_default_backend(None)
    try:
        with pytest.raises(sgl.LangError, match="no backend: call sgl.set_default_backend"):
            one.run()
    finally:
        sgl.set_default_backend(backend)


def test_backend_down_during_a_program(server: ServerProcess) -> None:
    """The server goes away after the backend was made: the program fails with a clear error
    (a closed port stands in for the stopped server)."""
    endpoint = sgl.RuntimeEndpoint(server.base_url)
    endpoint.base_url = "http://127.0.0.1:9"
    endpoint.client.base_url = endpoint.base_url

    @sgl.function
    def one(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2)

    with pytest.raises(sgl.BackendError, match="cannot reach the server at http://127.0.0.1:9"):
        one.run(backend=endpoint)


def test_cli_runs_a_script(server: ServerProcess, tmp_path: Any) -> None:
    script = tmp_path / "prog.py"
    script.write_text(
        "import sys\nimport sgl\n\n"
        "@sgl.function\ndef f(s):\n    s += 'The capital of France is'\n"
        "    s += sgl.gen('x', max_tokens=3, temperature=0)\n\n"
        "print('ARGS', sys.argv[1:], repr(f.run()['x']))\n")
    out = run_cli(["lang", "run", str(script), "--url", server.base_url, "one"])
    assert out.returncode == 0, out.stderr
    assert "ARGS ['one'] ' Paris" in out.stdout
