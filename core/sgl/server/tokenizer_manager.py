"""The server side of the runtime: check and tokenize requests, send them to the scheduler,
collect and detokenize what comes back.

One :class:`TokenizerManager` per server process (or per :class:`sgl.Engine`). It runs on one
asyncio loop. Callers use:

* :meth:`TokenizerManager.generate` -- run a :class:`~sgl.server.io_struct.GenerateReqInput`
  (one prompt or a batch, SGLang's ``/generate`` body) to completion; returns one SGLang-shaped
  dict, or a list of them for a batch or ``n > 1``;
* :meth:`TokenizerManager.generate_stream` -- the same as an async iterator of chunks, each
  holding only what is new (text, output ids, logprob entries);
* :meth:`TokenizerManager.flush_cache`, :meth:`TokenizerManager.get_server_info`,
  :meth:`TokenizerManager.get_load` -- round trips to the scheduler;
* :meth:`TokenizerManager.abort_request` -- stop requests by id (SGLang's ``/abort_request``).

Every request that ends (finished, failed or cancelled) is logged in one INFO line and counted
in :attr:`TokenizerManager.metrics` (:mod:`sgl.server.metrics`).

A background task receives :class:`~sgl.engine.messages.TokenBatch` messages and updates the
state of each request (:mod:`sgl.server.request_state`). Everything a request can get wrong is
checked before it is sent: a :class:`~sgl.server.io_struct.BadRequestError` (status 400) names
the field and the limit.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
import zmq.asyncio

from sgl.engine.messages import (
    AbortRequest,
    CloseSessionRequest,
    FlushCacheRequest,
    GenerateRequest,
    OpenSessionRequest,
    ServerInfoRequest,
    ShutdownRequest,
    TokenBatch,
)
from sgl.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParamsError
from sgl.server.detokenizer import decode_tokens
from sgl.server.io_struct import (
    BadRequestError,
    GenerateError,
    GenerateReqInput,
    OneRequest,
    unpaired_surrogate,
)
from sgl.server.metrics import ServerMetrics
from sgl.server.replicas import Replicas
from sgl.server.request_state import ReqState

T = TypeVar("T")

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.messages import SchedulerInfo
    from sgl.grammar.select import GrammarChecker
    from sgl.parallel import RequestRouter

__all__ = ["BadRequestError", "GenerateError", "GenerateReqInput", "TokenizerManager",
           "load_chat_template"]

logger = logging.getLogger("sgl.tokenizer_manager")

#: seconds to wait for the scheduler to answer a flush-cache or server-info request
INFO_TIMEOUT = 60.0
#: the longest session id /open_session takes
MAX_SESSION_ID_LENGTH = 256
#: arguments of the tokenizer's ``apply_chat_template`` that the server sets or that change
#: what it returns: a request's ``chat_template_kwargs`` may not set them
TEMPLATE_CALL_ARGUMENTS = ("conversation", "messages", "chat_template", "tokenize", "return_dict",
                           "return_tensors", "padding", "truncation", "max_length",
                           "return_assistant_tokens_mask", "tokenizer_kwargs")


def load_chat_template(value: str | None) -> str | None:
    """The text of a ``--chat-template``: a Jinja file, or the template itself when the value
    is not a file but contains Jinja markup."""
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"chat template file {value} does not exist")


#: how many characters of input one token can stand for, at most, per character of its own
#: text: normalization (NFKC, composing accents) folds a few input characters into one
CHARS_PER_TOKEN_BOUND = 4
#: prompts of more characters are tokenized on the long-prompt thread, so that a short request
#: never waits behind a long one (tokenizing a million characters takes about a second)
LONG_PROMPT_CHARS = 1 << 16


class _LongPrompt(Exception):
    """Raised on the short-prompt thread by a call that meets a long prompt, before it
    tokenizes anything: the call runs again on the long-prompt thread."""


def _longest_token_chars(tokenizer: Any) -> int:
    """The characters of the tokenizer's longest token string (byte-level and SentencePiece
    tokens are at least as long as the text they stand for); 1024 for a tokenizer without a
    vocabulary to list."""
    try:
        return max(map(len, tokenizer.get_vocab()), default=1)
    except Exception:  # no get_vocab
        return 1024


def _text_chars(value: Any) -> int:
    """The characters of every string in a JSON-like value (a chat's messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


class TokenizerManager:
    """Tokenize, send, receive, detokenize. Must be started (:meth:`start`) on the loop that
    will use it."""

    def __init__(self, tokenizer: Any, endpoints: dict[str, Any], info: SchedulerInfo,
                 settings: ServerSettings | None = None,
                 grammar: GrammarChecker | None = None,
                 router: RequestRouter | None = None) -> None:
        self.tokenizer = tokenizer
        #: checks json_schema/regex/ebnf/structural_tag before sending (None: the scheduler does)
        self.grammar = grammar
        self.info = info
        self.settings = settings
        self.endpoints = endpoints
        requests = endpoints.get("requests", "")  # none: never started (tests of encoding)
        #: the scheduler replicas' request sockets (several with --dp-size) and the dispatch
        self.replicas = Replicas([requests] if isinstance(requests, str) else list(requests),
                                 router)
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size or len(tokenizer)
        self.chat_template = load_chat_template(settings.chat_template if settings else None)
        #: seconds a request may take (--request-timeout); None: no limit
        self.request_timeout = settings.request_timeout if settings else None
        #: the most logprobs per position a request may ask for (--max-logprobs)
        self.max_logprobs = settings.max_logprobs if settings else 20
        #: the longest prompt text that could fit the context (see _prompt_chars_fit): longer
        #: ones are refused before the tokenizer sees them
        self.max_prompt_chars = (self.context_length * CHARS_PER_TOKEN_BOUND
                                 * _longest_token_chars(tokenizer))
        #: the threads that tokenize and apply chat templates, off the event loop: one for
        #: short prompts, one for long ones, each with its own copy of the tokenizer (Hugging
        #: Face's fast tokenizers are not safe to call from two threads at once)
        self._lane = threading.local()
        self._tokenizer_threads = {
            lane: ThreadPoolExecutor(1, thread_name_prefix=f"sgl-tokenize-{lane}",
                                     initializer=self._start_lane, initargs=(lane,))
            for lane in ("short", "long")}
        self._states: dict[str, ReqState] = {}
        self._info_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._token_texts: dict[int, str] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.dead_reason: str | None = None
        self.metrics = ServerMetrics()

    async def start(self) -> None:
        # the process's shared context, never terminated here: a context of our own that became
        # garbage with its sockets (a manager dropped without stop(), in a reference cycle)
        # would block in its finalizer for ever, in whatever thread the collector ran
        self._zmq = zmq.asyncio.Context.instance()
        self._zmq.setsockopt(zmq.LINGER, 0)
        self.replicas.bind(self._zmq)
        self._recv = self._zmq.socket(zmq.PULL)
        self._recv.bind(self.endpoints["outputs"])
        self._recv_task = asyncio.create_task(self._recv_loop(), name="sgl-recv")

    async def stop(self) -> None:
        """Tell the scheduler to exit, fail what is still in flight, close the sockets."""
        if self._recv_task is not None:
            self._recv_task.cancel()
            self._recv_task = None
        if self._zmq is not None:
            if self.dead_reason is None:
                self.fail_all("the server is shutting down", status=503)
            for replica in range(len(self.replicas)):
                try:
                    await asyncio.wait_for(self._send_msg(ShutdownRequest(), check=False,
                                                          replica=replica), timeout=1.0)
                except (asyncio.TimeoutError, zmq.ZMQError):
                    pass
            self.replicas.close()
            self._recv.close(linger=0)
            self._zmq = None
        for thread in self._tokenizer_threads.values():
            thread.shutdown(wait=False, cancel_futures=True)

    # --- encoding -----------------------------------------------------------------------------

    async def in_tokenizer_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a tokenizer thread: route handlers tokenize and apply
        chat templates through this, so a long prompt never holds the event loop (and with it
        every stream, ``/health`` and ``/metrics``). :meth:`generate` and
        :meth:`generate_stream` use it already.

        ``fn`` runs on the short-prompt thread; once the prompts it tokenizes come to more than
        :data:`LONG_PROMPT_CHARS` characters (:meth:`encode` and :meth:`apply_chat_template`
        count them before they tokenize), it runs again from the start on the long-prompt
        thread, so ``fn`` must not have done anything it cannot do twice."""
        loop = asyncio.get_running_loop()

        def call() -> T:
            self._lane.chars = 0
            return fn(*args, **kwargs)

        try:
            return await loop.run_in_executor(self._tokenizer_threads["short"], call)
        except _LongPrompt:
            return await loop.run_in_executor(self._tokenizer_threads["long"], call)

    def _start_lane(self, lane: str) -> None:
        self._lane.name = lane
        try:
            self._lane.tokenizer = copy.deepcopy(self.tokenizer)
        except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
            logger.debug("tokenizer not copied for the %s-prompt thread: %s", lane, exc)

    @property
    def _tokenizer(self) -> Any:
        """The tokenizer of the calling thread: its own copy on a tokenizer thread."""
        return getattr(self._lane, "tokenizer", self.tokenizer)

    def _prompt_chars_fit(self, chars: int, param: str) -> None:
        """A :class:`BadRequestError` for a prompt of ``chars`` characters that cannot fit the
        context in any tokenization: refused by size, before tokenizing it."""
        if chars > self.max_prompt_chars:
            raise BadRequestError(
                f"{param}: the prompt is {chars} characters, more than any prompt that fits "
                f"the model's context of {self.context_length} tokens can have", param=param)
        self._check_lane(chars)

    def _check_lane(self, chars: int) -> None:
        """Count ``chars`` more characters to tokenize in this call; on the short-prompt thread,
        past :data:`LONG_PROMPT_CHARS` in all, send the call to the long-prompt thread (see
        :meth:`in_tokenizer_thread`)."""
        self._lane.chars = getattr(self._lane, "chars", 0) + chars
        if self._lane.chars > LONG_PROMPT_CHARS and getattr(self._lane, "name", None) == "short":
            raise _LongPrompt

    def apply_chat_template(self, messages: list[dict[str, Any]], /, *,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of a chat, formatted by the chat template (``--chat-template`` or the
        model's own), ready for the assistant's reply."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise BadRequestError("this model has no chat template, so chat messages cannot be "
                                  "formatted for it; send a plain prompt, or give a template "
                                  "with --chat-template", param="messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("messages must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequestError(f"messages[{i}] must be an object with a 'role' and "
                                      "'content'", param="messages")
        self._prompt_chars_fit(_text_chars(messages), "messages")
        taken = [name for name in TEMPLATE_CALL_ARGUMENTS if name in template_kwargs]
        if taken:
            raise BadRequestError(f"chat_template_kwargs may not set {taken[0]!r}: the server "
                                  "passes that argument of the chat template itself",
                                  param="chat_template_kwargs")
        try:
            ids = self._tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs)
        except Exception as exc:  # jinja errors from the template itself, or text no
            # tokenizer takes (looked for only now, off the path of every request)
            if (where := unpaired_surrogate(messages)) is not None:
                raise BadRequestError(f"messages{where}: the text holds an unpaired surrogate; "
                                      "send valid Unicode", param="messages") from None
            raise BadRequestError(f"cannot apply the chat template: {exc}",
                                  param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def encode(self, text: str, add_special_tokens: bool = False, *, param: str = "prompt"
               ) -> list[int]:
        """Token ids of ``text``; one too long to fit the context in any tokenization is a
        :class:`BadRequestError` naming ``param``, refused before tokenizing."""
        self._prompt_chars_fit(len(text), param)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return decode_tokens(self.tokenizer, ids, skip_special_tokens=skip_special_tokens,
                             spaces_between_special_tokens=spaces_between_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached), for ``return_text_in_logprobs``."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text

    # --- checking -----------------------------------------------------------------------------

    def prepare(self, obj: GenerateReqInput | dict[str, Any]
                ) -> tuple[list[tuple[OneRequest, list[int]]], bool]:
        """Split, tokenize and check a request; nothing is sent yet.

        :returns: each sequence to generate with its prompt ids, and whether the caller gets a
            list of results.
        :raises BadRequestError: naming the field and the limit.
        """
        if isinstance(obj, dict):
            obj = GenerateReqInput.from_dict(obj)
        requests, as_list = obj.split()
        prepared: list[tuple[OneRequest, list[int]]] = []
        rids: set[str] = set()
        tokenized: dict[int, list[int]] = {}  # n > 1 shares one prompt: tokenize it once
        for req in requests:
            if req.text is not None:
                key = id(req.text)
                if key not in tokenized:
                    tokenized[key] = self._encode_prompt(req)
                ids = list(tokenized[key])
            else:
                ids = list(req.input_ids or [])
            self._check(req, ids)
            if req.rid in rids or req.rid in self._states:
                raise BadRequestError(f"request id {req.rid!r} is already in use", param="rid")
            rids.add(req.rid)
            params = req.sampling
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if eos is not None and not params.ignore_eos and eos not in params.stop_token_ids:
                params.stop_token_ids = [*params.stop_token_ids, int(eos)]
            prepared.append((req, ids))
        return prepared, as_list

    def _encode_prompt(self, req: OneRequest) -> list[int]:
        """The prompt's ids; a text no tokenizer takes (an unpaired surrogate, which the HTTP
        toolkit refuses already) is a :class:`BadRequestError` naming the field."""
        self._prompt_chars_fit(len(req.text), req.field_name.split("[")[0])
        try:
            return list(self._tokenizer.encode(req.text))
        except Exception:
            if unpaired_surrogate(req.text) is None:
                raise
            raise BadRequestError(f"{req.field_name}: the text holds an unpaired surrogate; "
                                  "send valid Unicode", param=req.field_name.split("[")[0]) from None

    def _check(self, req: OneRequest, ids: list[int]) -> None:
        where = req.field_name
        param = where.split("[")[0]
        if not ids:
            raise BadRequestError(f"{where}: the prompt is empty", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequestError(f"{where}: token id {bad} is outside the vocabulary "
                                  f"(ids must be in [0, {self.vocab_size}))", param=param)
        if len(ids) >= self.context_length:
            raise BadRequestError(
                f"{where}: the prompt has {len(ids)} tokens, but the model's context length is "
                f"{self.context_length}; the prompt must be shorter than that", param=param)
        try:
            req.sampling.validate(self.vocab_size)
        except SamplingParamsError as exc:
            raise BadRequestError(f"sampling_params: {exc}", param="sampling_params") from None
        room = self.context_length - len(ids)
        if req.sampling.max_new_tokens > room:
            if req.sampling.max_new_tokens != DEFAULT_MAX_NEW_TOKENS:
                raise BadRequestError(
                    f"max_new_tokens is {req.sampling.max_new_tokens}, but the prompt has "
                    f"{len(ids)} tokens and the model's context length is "
                    f"{self.context_length}: at most {room} new tokens fit",
                    param="max_new_tokens")
            # the default, not asked for: cut to what fits
            req.sampling.max_new_tokens = room
            req.sampling.min_new_tokens = min(req.sampling.min_new_tokens, room)
        if self.grammar is not None and req.sampling.constraint is not None:
            try:
                self.grammar.check(req.sampling)
            except ValueError as exc:
                raise BadRequestError(f"sampling_params: {exc}",
                                      param=req.sampling.constraint[0]) from None
        opts = req.logprobs
        if opts.top_logprobs_num > self.vocab_size:
            raise BadRequestError(f"top_logprobs_num is {opts.top_logprobs_num}, more than the "
                                  f"vocabulary's {self.vocab_size} tokens",
                                  param="top_logprobs_num")
        for name, asked in (("top_logprobs_num", opts.top_logprobs_num),
                            ("token_ids_logprob", len(opts.token_ids_logprob or ()))):
            if asked > self.max_logprobs:
                raise BadRequestError(
                    f"{name} asks for {asked} logprobs per position; this server gives at most "
                    f"{self.max_logprobs} (--max-logprobs)", param=name)
        if opts.logprob_start_len >= len(ids):
            raise BadRequestError(
                f"logprob_start_len must be less than the prompt length ({len(ids)} tokens), got "
                f"{opts.logprob_start_len}", param="logprob_start_len")
        bad = next((t for t in opts.token_ids_logprob or () if t >= self.vocab_size), None)
        if bad is not None:
            raise BadRequestError(f"token_ids_logprob has token id {bad}, outside the vocabulary "
                                  f"(size {self.vocab_size})", param="token_ids_logprob")

    # --- generation ---------------------------------------------------------------------------

    async def generate(self, obj: GenerateReqInput | dict[str, Any]
                       ) -> dict[str, Any] | list[dict[str, Any]]:
        """Run a request to completion: one result dict, or a list for a batch or ``n > 1``."""
        received = time.time()
        prepared, as_list = await self.in_tokenizer_thread(self.prepare, obj)
        states, waker = await self._submit(prepared, received)
        try:
            while not all(st.finished for st in states):
                await self._wait(waker, received)
                waker.clear()
                self._raise_errors(states)
            self._raise_errors(states)
            results = [st.result() for st in states]
        finally:
            await self._release(states)
        return results if as_list else results[0]

    async def generate_stream(self, obj: GenerateReqInput | dict[str, Any], *,
                              incremental: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Check the request (raising :class:`BadRequestError` before any chunk), then return an
        async iterator of chunks ``{"text", "output_ids", "meta_info"}`` holding what is new
        (with ``incremental=False``: everything so far, as SGLang's ``/generate`` streams by
        default); the last chunk of each sequence has its ``finish_reason`` and timings. For a
        batch or ``n > 1`` each chunk also has ``"index"``, its position in the result list.
        Closing the iterator early aborts the request."""
        received = time.time()
        prepared, as_list = await self.in_tokenizer_thread(self.prepare, obj)
        return self._stream(prepared, as_list, received, not incremental)

    async def _stream(self, prepared: list[tuple[OneRequest, list[int]]], as_list: bool,
                      received: float, cumulative: bool) -> AsyncIterator[dict[str, Any]]:
        states, waker = await self._submit(prepared, received)
        try:
            done = 0
            while done < len(states):
                await self._wait(waker, received)
                waker.clear()
                self._raise_errors(states)
                for st in states:
                    if not st.dirty:
                        continue
                    chunk = st.chunk(cumulative)
                    if chunk is None:
                        continue
                    if as_list:
                        chunk["index"] = st.req.index
                    if chunk["meta_info"]["finish_reason"] is not None:
                        done += 1
                    yield chunk
        finally:
            await self._release(states)

    async def _submit(self, prepared: list[tuple[OneRequest, list[int]]], received: float
                      ) -> tuple[list[ReqState], asyncio.Event]:
        self._check_running()
        waker = asyncio.Event()
        states = []
        for req, ids in prepared:
            if req.rid in self._states:  # taken since prepare()
                raise BadRequestError(f"request id {req.rid!r} is already in use", param="rid")
        for req, ids in prepared:
            state = ReqState(req, ids, self.tokenizer, waker, self.token_text, received)
            self._states[req.rid] = state
            states.append(state)
        try:
            for state, (req, ids) in zip(states, prepared):
                msg = GenerateRequest(req.rid, ids, req.sampling, req.logprobs,
                                      arrival_time=state.arrival_time, session_id=req.session_id,
                                      data_parallel_rank=req.data_parallel_rank,
                                      bootstrap=req.bootstrap)
                await self._send_msg(msg, replica=self.replicas.assign(msg))
        except BaseException:
            await self._release(states)
            raise
        return states, waker

    async def _wait(self, waker: asyncio.Event, received: float) -> None:
        """Until the scheduler sends something for the request; a :class:`GenerateError`
        (504) when --request-timeout passes first (the caller's release aborts it)."""
        if self.request_timeout is None:
            await waker.wait()
            return
        left = received + self.request_timeout - time.time()
        try:
            await asyncio.wait_for(waker.wait(), timeout=max(left, 0.0))
        except TimeoutError:
            self.metrics.request_timed_out()
            raise GenerateError(f"the request took longer than the server's request timeout "
                                f"of {self.request_timeout:g} s (--request-timeout) and was "
                                "aborted", status=504) from None

    @staticmethod
    def _raise_errors(states: list[ReqState]) -> None:
        for st in states:
            if st.error is not None:
                raise GenerateError(st.error, st.status)

    async def _release(self, states: list[ReqState]) -> None:
        """Forget the requests; abort those the scheduler still runs."""
        for st in states:
            if self._states.get(st.rid) is st:
                del self._states[st.rid]
            self._log_finished(st)
            if not st.finished:
                self._send_abort(st.rid)
            self.replicas.release(st.rid)

    def _log_finished(self, st: ReqState) -> None:
        """One INFO line and the metrics of a request that is over, however it ended."""
        now = time.time()
        self.metrics.request_finished(st, now)
        if st.error is not None:
            outcome = f"failed ({st.error})"
        elif st.finish_reason is None:
            outcome = "cancelled"
        else:
            outcome = str(st.finish_reason.get("type"))
        latency = (st.finished_time or now) - st.arrival_time
        logger.info("request %s %s: %d prompt tokens (%d cached), %d completion tokens, %.3f s",
                    st.rid, outcome, st.prompt_tokens, st.cached_tokens, st.completion_tokens,
                    latency)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> list[str]:
        """Stop the request ``rid`` (or every request with ``abort_all``) wherever it is: its
        caller gets what was generated so far with ``finish_reason`` ``{"type": "abort"}``, and
        the scheduler frees its memory. Returns the ids aborted (none when ``rid`` is unknown or
        already finished)."""
        aborted = []
        for state in list(self._states.values()):
            if state.finished or not (abort_all or state.rid == rid):
                continue
            state.abort("aborted by an abort request")
            aborted.append(state.rid)
            self._send_abort(state.rid)
        return aborted

    def _send_abort(self, rid: str) -> None:
        """Tell a running scheduler to drop ``rid`` (without waiting: best effort)."""
        if self._zmq is None or self.dead_reason is not None:
            return
        for replica in self.replicas.of(rid):
            try:
                self.replicas.sockets[replica].send_pyobj(
                    AbortRequest(rid), flags=zmq.NOBLOCK).add_done_callback(_ignore_result)
            except zmq.ZMQError:
                pass

    # --- control round trips ------------------------------------------------------------------

    async def flush_cache(self) -> dict[str, Any]:
        """Ask the scheduler (every replica) to drop its cached prefixes; returns its answer
        (with several replicas: success if all succeeded, their messages joined)."""
        replies = await self._ask_all(lambda: FlushCacheRequest(rid=uuid.uuid4().hex))
        if len(replies) == 1:
            return replies[0]
        return {"success": all(r.get("success") for r in replies),
                "message": "; ".join(f"replica {i}: {r.get('message')}"
                                     for i, r in enumerate(replies)),
                "kv_free": sum(int(r.get("kv_free", 0)) for r in replies)}

    async def get_server_info(self) -> dict[str, Any]:
        """Settings, the model's facts and the scheduler's live state (SGLang's shape:
        settings and scheduler facts at the top level, ``internal_states`` and ``version``)."""
        internal = [{**load, "dp_rank": i, "num_tracked_requests": (
                        len(self._states) if len(self.replicas) == 1
                        else self.replicas.in_flight[i])}
                    for i, load in enumerate(await self.get_loads())]
        facts = {k: v for k, v in dataclasses.asdict(self.info).items() if k not in ("ok", "error")}
        if len(self.replicas) > 1:
            facts["parallel"] = {**facts.get("parallel", {}), **self.replicas.info()}
        from sgl.config import public_settings
        from sgl.version import __version__

        settings = public_settings(self.settings) if self.settings is not None else {}

        return {**settings, **facts, "internal_states": internal, "version": __version__}

    async def open_session(self, session_id: str | None = None) -> str:
        """Open a session whose conversation stays cached between its requests; returns its id.

        :raises BadRequestError: when a session of that id is already open.
        """
        session_id = session_id or uuid.uuid4().hex
        if len(session_id) > MAX_SESSION_ID_LENGTH:
            raise BadRequestError(f"session_id has {len(session_id)} characters, more than "
                                  f"{MAX_SESSION_ID_LENGTH}", param="session_id")
        reply = await self._ask(OpenSessionRequest(rid=uuid.uuid4().hex, session_id=session_id),
                                replica=self.replicas.session_replica(session_id))
        if not reply.get("success"):
            raise BadRequestError(str(reply.get("message")), param="session_id")
        return session_id

    async def close_session(self, session_id: str) -> None:
        """Close a session.

        :raises BadRequestError: when no session of that id is open.
        """
        reply = await self._ask(CloseSessionRequest(rid=uuid.uuid4().hex, session_id=session_id),
                                replica=self.replicas.session_replica(session_id))
        if not reply.get("success"):
            raise BadRequestError(str(reply.get("message")), param="session_id")

    async def get_load(self) -> dict[str, Any]:
        """The scheduler's live state: running and waiting requests, KV pool use, ... (with
        several replicas: their counts added up)."""
        return self.add_loads(await self.get_loads())

    @staticmethod
    def add_loads(loads: list[dict[str, Any]]) -> dict[str, Any]:
        """Several replicas' load reports as one: counts added up, the rest the first's."""
        if len(loads) == 1:
            return loads[0]
        total = dict(loads[0])
        for key, value in total.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = sum(int(load.get(key, 0)) for load in loads)
        return total

    async def get_loads(self) -> list[dict[str, Any]]:
        """The live state of each scheduler replica."""
        return await self._ask_all(lambda: ServerInfoRequest(rid=uuid.uuid4().hex))

    async def _ask_all(self, make: Callable[[], Any]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._ask(make(), replica=i)
                                           for i in range(len(self.replicas)))))

    async def _ask(self, msg: FlushCacheRequest | ServerInfoRequest | OpenSessionRequest
                   | CloseSessionRequest, replica: int = 0) -> dict[str, Any]:
        self._check_running()
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._info_waiters[msg.rid] = future
        try:
            await self._send_msg(msg, replica=replica)
            return await asyncio.wait_for(future, INFO_TIMEOUT)
        except asyncio.TimeoutError:
            raise GenerateError(f"the scheduler did not answer {type(msg).__name__} within "
                                f"{INFO_TIMEOUT:.0f} s", status=504) from None
        finally:
            self._info_waiters.pop(msg.rid, None)

    def _check_running(self) -> None:
        if self.dead_reason is not None:
            raise GenerateError(self.dead_reason, status=503)
        if self._zmq is None:
            raise GenerateError("the tokenizer manager is not running", status=503)

    async def _send_msg(self, msg: Any, check: bool = True, replica: int = 0) -> None:
        """Send without ever blocking on a scheduler that is gone: a PUSH socket without a
        connected peer (the scheduler not connected yet, or dead) would wait for one for ever,
        so retry until it is connected or known to be dead."""
        while True:
            if check and self.dead_reason is not None:
                raise GenerateError(self.dead_reason, status=503)
            try:
                await self.replicas.sockets[replica].send_pyobj(msg, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                await asyncio.sleep(0.01)

    # --- receiving ----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            try:
                batch: TokenBatch = await self._recv.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except Exception:  # a message that cannot be unpickled must not stop the loop
                logger.exception("cannot read a message from the scheduler")
                continue
            if batch.info_rid is not None:
                future = self._info_waiters.get(batch.info_rid)
                if future is not None and not future.done():
                    future.set_result(dict(batch.info or {}))
            for out in batch.outputs:
                state = self._states.get(out.rid)
                if state is None:
                    continue  # aborted by the client meanwhile
                try:
                    state.apply(out)
                except Exception as exc:  # keep serving the others
                    logger.exception("cannot process the output of request %s", out.rid)
                    state.fail(f"internal error while detokenizing: {exc}", 500)

    def fail_all(self, reason: str, status: int = 503) -> None:
        """Fail every in-flight request (the scheduler died) and refuse new ones."""
        self.dead_reason = reason
        for state in list(self._states.values()):
            state.fail(reason, status)
        for future in self._info_waiters.values():
            if not future.done():
                future.set_exception(GenerateError(reason, status))


def _ignore_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so asyncio does not log it
