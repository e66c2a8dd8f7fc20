"""The TokenizerManager against a scripted scheduler (a thread on the same ZMQ sockets), with a
toy tokenizer: result and chunk shapes, stop trimming, n > 1 and batches, logprob text,
control round trips, validation, errors and aborts. No model is loaded."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from _toy_tokenizers import byte_level_bpe

from sgl.engine.messages import (
    AbortRequest,
    FlushCacheRequest,
    GenerateRequest,
    SchedulerInfo,
    ServerInfoRequest,
    ShutdownRequest,
    TokenBatch,
    TokenOutput,
)
from sgl.server.io_struct import BadRequestError, GenerateError, GenerateReqInput
from sgl.server.tokenizer_manager import TokenizerManager

TOK = byte_level_bpe()
EOS = TOK.eos_token_id
CONTEXT = 64


class FakeScheduler(threading.Thread):
    """Answers each GenerateRequest with ``script(request)``: a list of TokenOutputs, sent one
    per TokenBatch. Records every message it receives."""

    def __init__(self, endpoints: dict[str, str],
                 script: Callable[[GenerateRequest], list[TokenOutput]]) -> None:
        super().__init__(daemon=True)
        self.endpoints, self.script = endpoints, script
        self.received: list[Any] = []
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # closing never waits for a gone peer
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(endpoints["requests"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(endpoints["outputs"])

    def run(self) -> None:
        while True:
            if not self.pull.poll(5000):
                break
            msg = self.pull.recv_pyobj()
            self.received.append(msg)
            if isinstance(msg, ShutdownRequest):
                break
            if isinstance(msg, FlushCacheRequest):
                self.push.send_pyobj(TokenBatch(info={"success": True}, info_rid=msg.rid))
            elif isinstance(msg, ServerInfoRequest):
                self.push.send_pyobj(TokenBatch(info={"num_running_reqs": 0}, info_rid=msg.rid))
            elif isinstance(msg, GenerateRequest):
                for out in self.script(msg):
                    self.push.send_pyobj(TokenBatch([out]))
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()


def emit(text: str, finish: dict[str, Any] | None = None, extra: list[int] = ()  # type: ignore[assignment]
         ) -> Callable[[GenerateRequest], list[TokenOutput]]:
    """A script that generates ``text`` (plus ``extra`` ids) one token per message."""

    def script(req: GenerateRequest) -> list[TokenOutput]:
        ids = TOK.encode(text, add_special_tokens=False) + list(extra)
        outs = []
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            outs.append(TokenOutput(
                rid=req.rid, new_token_ids=[token], prompt_tokens=len(req.input_ids),
                completion_tokens=i + 1,
                finish_reason=(finish or {"type": "length", "length": len(ids)}) if last else None,
                first_token_time=time.time() if i == 0 else None, queue_time=0.005))
        return outs

    return script


def run_with(script: Callable[[GenerateRequest], list[TokenOutput]],
             body: Callable[[TokenizerManager], Any]) -> tuple[Any, FakeScheduler]:
    ipc = tempfile.mkdtemp(prefix="sgl-test-ipc-")
    endpoints = {"requests": f"ipc://{ipc}/requests", "outputs": f"ipc://{ipc}/outputs"}
    info = SchedulerInfo(ok=True, model_path="toy", context_length=CONTEXT,
                         vocab_size=len(TOK), max_total_tokens=1024)
    tm = TokenizerManager(TOK, endpoints, info)
    fake = FakeScheduler(endpoints, script)

    async def main() -> Any:
        await tm.start()
        fake.start()
        try:
            return await asyncio.wait_for(body(tm), 20)
        finally:
            await tm.stop()

    try:
        result = asyncio.run(main())
    finally:
        fake.join(10)
        shutil.rmtree(ipc, ignore_errors=True)
    return result, fake


async def collect(tm: TokenizerManager, obj: Any) -> list[dict[str, Any]]:
    return [chunk async for chunk in await tm.generate_stream(obj)]


def test_result_has_sglangs_shape() -> None:
    async def body(tm: TokenizerManager) -> Any:
        return await tm.generate({"text": "hello", "sampling_params": {"max_new_tokens": 3}})

    out, fake = run_with(emit(" the quick fox"), body)
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["text"] == " the quick fox"
    assert out["output_ids"] == TOK.encode(" the quick fox", add_special_tokens=False)
    meta = out["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
            "e2e_latency", "queue_time", "time_to_first_token"} <= set(meta)
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["queue_time"] == 0.005 and 0 < meta["time_to_first_token"] <= meta["e2e_latency"]
    assert "input_token_logprobs" not in meta
    sent = [m for m in fake.received if isinstance(m, GenerateRequest)][0]
    assert EOS in sent.sampling.stop_token_ids and sent.arrival_time > 0


def test_stream_chunks_add_up_and_stop_string_is_trimmed() -> None:
    text = " the quick brown fox jumps over the lazy dog"

    async def body(tm: TokenizerManager) -> Any:
        params = {"stop": ["over the"]}
        chunks = await collect(tm, {"text": "a", "sampling_params": params})
        cumulative = [c async for c in await tm.generate_stream(
            {"text": "a", "sampling_params": params}, incremental=False)]
        full = await tm.generate({"text": "a", "sampling_params": params})
        kept = await tm.generate({"text": "a", "sampling_params": {**params, "no_stop_trim": True}})
        return chunks, cumulative, full, kept

    (chunks, cumulative, full, kept), _ = run_with(
        emit(" the quick brown fox jumps over the", {"type": "stop", "matched": "over the"}), body)
    assert full["text"] == " the quick brown fox jumps "
    assert "".join(c["text"] for c in chunks) == full["text"]  # "over" never leaked out
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "over the"}
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]
    assert sum(len(c["output_ids"]) for c in chunks) == len(full["output_ids"])
    assert kept["text"] == " the quick brown fox jumps over the"
    # SGLang's default stream shape: each chunk holds everything so far
    assert cumulative[-1]["text"] == full["text"]
    assert cumulative[-1]["output_ids"] == full["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(cumulative, cumulative[1:]))
    assert text.startswith(kept["text"])


def test_stop_token_is_left_out_of_the_text_but_not_the_ids() -> None:
    async def body(tm: TokenizerManager) -> Any:
        keep = {"skip_special_tokens": False}
        return (await tm.generate({"text": "a", "sampling_params": keep}),
                await tm.generate({"text": "a", "sampling_params": {**keep, "no_stop_trim": True}}))

    (trimmed, kept), _ = run_with(emit(" hello", {"type": "stop", "matched": EOS}, [EOS]), body)
    assert trimmed["text"] == " hello" and trimmed["output_ids"][-1] == EOS
    assert kept["text"] == " hello </s>"  # spaces_between_special_tokens


def test_n_and_batches() -> None:
    async def body(tm: TokenizerManager) -> Any:
        n = await tm.generate({"text": "hello", "rid": "r",
                               "sampling_params": {"n": 3, "seed": 7, "max_new_tokens": 2}})
        batch = await tm.generate({"input_ids": [[5, 6], [7]],
                                   "sampling_params": [{"max_new_tokens": 1},
                                                       {"max_new_tokens": 2}]})
        chunks = await collect(tm, {"text": ["x", "y"], "sampling_params": {"n": 2}})
        return n, batch, chunks

    (n, batch, chunks), fake = run_with(emit(" world"), body)
    assert [r["meta_info"]["id"] for r in n] == ["r-0", "r-1", "r-2"]
    sent = [m for m in fake.received if isinstance(m, GenerateRequest)]
    assert [m.sampling.seed for m in sent[:3]] == [7, 8, 9]
    assert all(m.sampling.n == 1 for m in sent)
    assert isinstance(batch, list) and len(batch) == 2
    assert [m.input_ids for m in sent[3:5]] == [[5, 6], [7]]
    assert [m.sampling.max_new_tokens for m in sent[3:5]] == [1, 2]
    assert sorted({c["index"] for c in chunks}) == [0, 1, 2, 3]
    for i in range(4):
        assert "".join(c["text"] for c in chunks if c["index"] == i) == " world"


def test_logprobs_with_text() -> None:
    def script(req: GenerateRequest) -> list[TokenOutput]:
        token = TOK.encode(" the", add_special_tokens=False)[0]
        return [TokenOutput(
            rid=req.rid, new_token_ids=[token], prompt_tokens=len(req.input_ids),
            completion_tokens=1, finish_reason={"type": "length", "length": 1},
            input_token_logprobs=[(None, req.input_ids[0], None)],
            output_token_logprobs=[(-0.5, token, None)],
            input_top_logprobs=[None], output_top_logprobs=[[(-0.5, token, None)]])]

    async def body(tm: TokenizerManager) -> Any:
        return await tm.generate(GenerateReqInput(
            text="hello", return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
            return_text_in_logprobs=True))

    out, fake = run_with(script, body)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [(None, TOK.encode("hello")[0], "hello")]
    assert meta["output_token_logprobs"] == [(-0.5, out["output_ids"][0], " the")]
    assert meta["input_top_logprobs"] == [None]
    assert meta["output_top_logprobs"] == [[(-0.5, out["output_ids"][0], " the")]]
    assert "input_token_ids_logprobs" not in meta
    sent = [m for m in fake.received if isinstance(m, GenerateRequest)][0]
    assert sent.logprobs.return_logprob and sent.logprobs.top_logprobs_num == 1


def test_sglang_client_fields_left_empty_are_accepted() -> None:
    async def body(tm: TokenizerManager) -> Any:
        return await tm.generate({"text": "a", "lora_path": None, "image_data": None,
                                  "log_metrics": True, "return_hidden_states": False,
                                  "logprob_start_len": -1, "stream": False})

    out, _ = run_with(emit(" world"), body)
    assert out["text"] == " world"


def test_flush_cache_and_server_info() -> None:
    async def body(tm: TokenizerManager) -> Any:
        return await tm.flush_cache(), await tm.get_server_info()

    (flushed, info), _ = run_with(emit(""), body)
    assert flushed == {"success": True}
    assert info["internal_states"] == [{"num_running_reqs": 0, "dp_rank": 0,
                                        "num_tracked_requests": 0}]
    assert info["context_length"] == CONTEXT and "version" in info


@pytest.mark.parametrize("body,needle", [
    ({"text": ""}, "text: the prompt is empty"),
    ({"input_ids": [1, 10**6]}, "outside the vocabulary"),
    ({"input_ids": list(range(5, 5 + CONTEXT))}, "context length is 64"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"tempurature": 1}}, "tempurature"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ({"text": "a", "input_ids": [1]}, "not both"),
    ({}, "text or input_ids is required"),
    ({"prompt": "a"}, "unknown field(s): prompt"),
    ({"text": "a", "lora_path": "adapter"}, "lora_path: not supported by sgl"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "1 entries for a batch of 2"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
])
def test_bad_requests_are_refused_before_sending(body: dict[str, Any], needle: str) -> None:
    async def run(tm: TokenizerManager) -> Any:
        with pytest.raises(BadRequestError) as info:
            await tm.generate(body)
        with pytest.raises(BadRequestError):
            await tm.generate_stream(body)  # raises before any iteration
        return info.value

    error, fake = run_with(emit(""), run)
    assert needle in str(error) and error.status == 400 and isinstance(error, ValueError)
    assert not [m for m in fake.received if isinstance(m, GenerateRequest)]


def test_scheduler_errors_and_dead_scheduler() -> None:
    def script(req: GenerateRequest) -> list[TokenOutput]:
        if req.input_ids == [9]:
            return []  # never answers: the "scheduler" dies below
        return [TokenOutput(rid=req.rid, new_token_ids=[], prompt_tokens=1, completion_tokens=0,
                            finish_reason={"type": "abort", "message": "no room"},
                            error="no room", error_status=400)]

    async def body(tm: TokenizerManager) -> Any:
        with pytest.raises(GenerateError, match="no room"):
            await tm.generate({"input_ids": [5]})
        pending = asyncio.create_task(tm.generate({"input_ids": [9]}))
        await asyncio.sleep(0.2)
        tm.fail_all("the scheduler process died (exit code -9)")
        with pytest.raises(GenerateError, match="scheduler process died") as info:
            await pending
        assert info.value.status == 503
        with pytest.raises(GenerateError, match="scheduler process died"):
            await tm.generate({"input_ids": [5]})
        with pytest.raises(GenerateError, match="scheduler process died"):
            await tm.flush_cache()

    run_with(script, body)


def test_cancelled_request_is_aborted() -> None:
    async def body(tm: TokenizerManager) -> Any:
        task = asyncio.create_task(tm.generate({"input_ids": [5], "rid": "gone"}))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = await tm.generate_stream({"input_ids": [5], "rid": "closed"})
        await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)
        return dict(tm._states)

    def script(req: GenerateRequest) -> list[TokenOutput]:  # one token, then silence
        return [TokenOutput(rid=req.rid, new_token_ids=[5], prompt_tokens=1, completion_tokens=1)]

    states, fake = run_with(script, body)
    assert states == {}
    aborted = [m.rid for m in fake.received if isinstance(m, AbortRequest)]
    assert aborted == ["gone", "closed"]


@pytest.fixture
def template_file(tmp_path: Any) -> Iterator[str]:
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
    yield str(path)


def test_chat_template_override(template_file: str) -> None:
    from sgl.config import ServerSettings

    info = SchedulerInfo(ok=True, context_length=CONTEXT, vocab_size=len(TOK))
    tm = TokenizerManager(TOK, {}, info, ServerSettings(chat_template=template_file))
    ids = tm.apply_chat_template([{"role": "user", "content": "hello"}])
    assert TOK.decode(ids) == "[user] hello\n[assistant]"
    plain = TokenizerManager(TOK, {}, info)
    with pytest.raises(BadRequestError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hello"}])


def test_a_lone_surrogate_is_a_bad_request_without_http(template_file: str) -> None:
    """``sgl.Engine`` callers pass Python strings, which may hold an unpaired surrogate; it is a
    400 naming the field, not the tokenizer's own error."""
    from sgl.config import ServerSettings

    info = SchedulerInfo(ok=True, context_length=CONTEXT, vocab_size=len(TOK))
    tm = TokenizerManager(TOK, {}, info, ServerSettings(chat_template=template_file))
    with pytest.raises(BadRequestError, match="text: the text holds an unpaired surrogate"):
        tm.prepare({"text": "a\ud800b"})
    with pytest.raises(BadRequestError, match=r"messages\[0\]\.content: .*unpaired surrogate"):
        tm.apply_chat_template([{"role": "user", "content": "a\ud800b"}])


def test_long_prompts_are_tokenized_on_their_own_thread() -> None:
    """Calls run on the short-prompt thread until the prompts they tokenize pass
    LONG_PROMPT_CHARS in all (one long text, or many short ones); then from the start on the
    long-prompt thread, each thread with its own copy of the tokenizer."""
    from sgl.server.tokenizer_manager import LONG_PROMPT_CHARS

    def where(tm: TokenizerManager, texts: list[str]) -> tuple[str, list[int]]:
        ids = [len(tm.encode(t)) for t in texts]
        return threading.current_thread().name, ids

    async def body(tm: TokenizerManager) -> Any:
        tm.max_prompt_chars = 10**9  # the toy context fits no long prompt
        short = await tm.in_tokenizer_thread(where, tm, ["a b c"])
        long = await tm.in_tokenizer_thread(where, tm, ["a " * LONG_PROMPT_CHARS])
        many = await tm.in_tokenizer_thread(where, tm, ["a " * 1000] * (LONG_PROMPT_CHARS // 1000))
        copies = [await tm.in_tokenizer_thread(lambda: tm._tokenizer) for _ in range(2)]
        return short, long, many, copies, tm.tokenizer

    (short, long, many, copies, shared), _ = run_with(emit(""), body)
    assert short[0].startswith("sgl-tokenize-short")
    assert long[0].startswith("sgl-tokenize-long") and long[1][0] > 0
    assert many[0].startswith("sgl-tokenize-long") and len(many[1]) == LONG_PROMPT_CHARS // 1000
    assert copies[0] is copies[1] and copies[0] is not shared

