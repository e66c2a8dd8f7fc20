"""``sgl.Engine`` with the bundled SmolLM2: one engine for the whole module (starting one loads
the model in a scheduler process); the last test shuts it down."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import sgl
from sgl.config import ConfigError
from sgl.entrypoints.engine import EngineClosedError
from sgl.server.io_struct import BadRequestError
from sgl_testing import CAPITAL_QUESTION

GREEDY = {"temperature": 0, "max_new_tokens": 8}
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
             "e2e_latency", "queue_time", "time_to_first_token"}


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    # float32 as the shared server runs (auto is bfloat16 on a CPU with AMX)
    eng = sgl.Engine(max_total_tokens=4096, context_length=512, log_level="warning",
                     dtype="float32")
    yield eng
    eng.shutdown()


def test_generate_one_prompt(engine: sgl.Engine) -> None:
    out = engine.generate("The capital of France is", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and out["text"]
    meta = out["meta_info"]
    assert META_KEYS <= set(meta)
    assert meta["finish_reason"] in ({"type": "length", "length": 8},) or \
        meta["finish_reason"]["type"] == "stop"
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 8
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The capital of France is"))
    assert 0 <= meta["time_to_first_token"] <= meta["e2e_latency"]
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True) \
        or meta["finish_reason"]["type"] == "stop"


def test_generate_list_and_input_ids(engine: sgl.Engine) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    outs = engine.generate(prompts, GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    singles = [engine.generate(p, GREEDY) for p in prompts]
    assert [o["text"] for o in outs] == [s["text"] for s in singles]
    ids = engine.tokenizer.encode(prompts[1])
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert by_ids["text"] == singles[1]["text"]
    per_prompt = engine.generate(prompts, [{"max_new_tokens": 2, "temperature": 0},
                                           {"max_new_tokens": 3, "temperature": 0}])
    assert [o["meta_info"]["completion_tokens"] for o in per_prompt] == [2, 3]


def test_stream_concatenates_to_the_full_text(engine: sgl.Engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 16}
    full = engine.generate("Write a haiku about the sea.", params)
    chunks = list(engine.generate("Write a haiku about the sea.", params, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


def test_stream_stopped_early_aborts(engine: sgl.Engine) -> None:
    stream = engine.generate("Count to one hundred:", {"max_new_tokens": 200}, stream=True)
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    stream.close()  # type: ignore[attr-defined]
    assert engine.get_server_info()["internal_states"][0]["num_running_reqs"] == 0


def test_async_generate(engine: sgl.Engine) -> None:
    expected = engine.generate("The capital of France is", GREEDY)

    async def main() -> tuple[Any, str, list[Any]]:
        one = await engine.async_generate("The capital of France is", GREEDY)
        stream = await engine.async_generate("The capital of France is", GREEDY, stream=True)
        text = "".join([c["text"] async for c in stream])
        both = await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in ("a", "b")))
        return one, text, list(both)

    one, streamed, both = asyncio.run(main())
    assert one["text"] == streamed == expected["text"]
    assert len(both) == 2 and all(META_KEYS <= set(o["meta_info"]) for o in both)


def test_chat(engine: sgl.Engine) -> None:
    messages = [{"role": "user", "content": CAPITAL_QUESTION}]
    out = engine.chat(messages, {"temperature": 0, "max_new_tokens": 16})
    assert "Paris" in out["text"]
    ids = engine.apply_chat_template(messages)
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    outs = engine.chat([messages, messages], {"temperature": 0, "max_new_tokens": 4})
    assert len(outs) == 2 and outs[0]["text"] == outs[1]["text"]


def test_n_samples(engine: sgl.Engine) -> None:
    outs = engine.generate("Hello", {"n": 3, "max_new_tokens": 4, "temperature": 1.0},
                           rid="many")
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["many-0", "many-1", "many-2"]
    assert all(o["meta_info"]["completion_tokens"] >= 1 for o in outs)


def test_stop_string_is_trimmed_in_results_and_streams(engine: sgl.Engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 24, "stop": [" 5"]}
    out = engine.generate("Count: 1, 2, 3,", params)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5"}
    assert " 5" not in out["text"] and out["text"].strip().startswith("4")
    chunks = list(engine.generate("Count: 1, 2, 3,", params, stream=True))
    assert "".join(c["text"] for c in chunks) == out["text"]
    kept = engine.generate("Count: 1, 2, 3,", {**params, "no_stop_trim": True})
    assert kept["text"] == out["text"] + " 5"


def test_logprobs_shape(engine: sgl.Engine) -> None:
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 3},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                          token_ids_logprob=[7042], return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    for (logprob, token_id, text), out_id in zip(meta["output_token_logprobs"],
                                                 out["output_ids"]):
        assert logprob <= 0 and token_id == out_id and isinstance(text, str)
    assert len(meta["output_top_logprobs"]) == meta["completion_tokens"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0][1] == out["output_ids"][0]  # greedy: the top one
    assert [e[1] for e in meta["output_token_ids_logprobs"][0]] == [7042]


def test_seed_makes_sampling_repeatable(engine: sgl.Engine) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 6, "seed": 1234}
    first = engine.generate("Once upon a time", params)
    assert engine.generate("Once upon a time", params)["output_ids"] == first["output_ids"]


def test_flush_cache_and_server_info(engine: sgl.Engine) -> None:
    assert engine.flush_cache()["success"] is True
    info = engine.get_server_info()
    assert info["context_length"] == 512 and info["max_total_tokens"] == 4096
    assert info["dtype"] == "float32" and "version" in info
    state = info["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["kv_total_tokens"] == 4096


@pytest.mark.parametrize("kwargs,field", [
    ({"sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"sampling_params": {"top_p": 0}}, "top_p"),
    ({"sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"sampling_params": {"max_new_token": 5}}, "max_new_token"),
    ({"sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"sampling_params": "greedy"}, "sampling_params"),
    ({"prompt": "word " * 600}, "context length is 512"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": None, "input_ids": [1, 10**7]}, "outside the vocabulary"),
    ({"prompt": 42}, "text must be a string"),
    ({"return_logprob": "yes"}, "return_logprob"),
])
def test_bad_input_names_the_field(engine: sgl.Engine, kwargs: dict[str, Any],
                                   field: str) -> None:
    call = {"prompt": "Hello", **kwargs}
    with pytest.raises(BadRequestError, match=field) as info:
        engine.generate(**call)
    assert isinstance(info.value, ValueError) and info.value.status == 400
    with pytest.raises(BadRequestError, match=field):
        engine.generate(**call, stream=True)  # raised at the call, not at the first chunk


def test_unknown_or_bad_engine_settings_fail_before_starting() -> None:
    with pytest.raises(TypeError, match="max_total_token") as info:
        sgl.Engine(max_total_token=4096)
    assert "did you mean 'max_total_tokens'" in str(info.value)
    assert "valid settings:" in str(info.value) and "dtype" in str(info.value)
    with pytest.raises(ConfigError, match=r"Engine\(\.\.\.\): invalid value 'float64' for 'dtype'"):
        sgl.Engine(dtype="float64")
    with pytest.raises(ValueError, match="max_running_requests"):
        sgl.Engine(max_running_requests=0)


def test_plugin_options_through_engine_keywords() -> None:
    """``plugins=`` takes each plugin's options as a config file's ``[plugins.<id>]`` table,
    with the same checks (an unknown plugin or option names what exists)."""
    from sgl.entrypoints.engine import engine_settings
    from sgl.plugins import create_plugin_manager

    classes = create_plugin_manager().config_classes()
    options = {"plugins": {"speculative-ngram": {"max_bfs_breadth": 3}}}
    engine_settings(None, options)  # the first pass, before the plugins load, leaves them
    settings = engine_settings(None, options, classes)
    assert settings.plugin_settings["speculative-ngram"].max_bfs_breadth == 3
    with pytest.raises(ConfigError, match="unknown plugin 'speculative-ngrm'"):
        engine_settings(None, {"plugins": {"speculative-ngrm": {}}}, classes)
    with pytest.raises(ConfigError, match="max_bfs_breadth"):
        engine_settings(None, {"plugins": {"speculative-ngram": {"max_bfs_bredth": 3}}}, classes)
    # a plugin's options by their top-level names, as SGLang's Engine takes them
    flat = engine_settings(None, {"disaggregation_mode": "prefill", "dp_size": 2,
                                  "load_balance_method": "cache_aware"}, classes)
    assert flat.plugin_settings["disaggregation"].mode == "prefill"
    assert flat.plugin_settings["parallel-dp"].load_balance_method == "cache_aware"
    assert flat.source("disaggregation_mode") == "Engine(...)"


def test_settings_record_their_source(engine: sgl.Engine) -> None:
    assert engine.settings.sources["max_total_tokens"] == "Engine(...)"
    assert engine.settings.sources["port"] == "default"


def test_shutdown_via_context_manager_frees_the_process(engine: sgl.Engine) -> None:
    process = engine._handle.process
    with engine as same:
        assert same is engine and engine.alive
    assert not process.is_alive() and process.exitcode == 0
    assert not engine._thread.is_alive() and not engine.alive
    engine.shutdown()  # idempotent
    with pytest.raises(EngineClosedError, match="shut down"):
        engine.generate("Hello", GREEDY)
