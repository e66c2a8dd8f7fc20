"""What a caller asks the TokenizerManager for, in the shape of SGLang's ``/generate`` body.

:class:`GenerateReqInput` takes one prompt or a batch (a list of prompts or a list of token-id
lists), with one ``sampling_params`` for all or one per prompt. :meth:`GenerateReqInput.split`
checks the shape and turns it into one :class:`OneRequest` per generated sequence; a prompt with
``n > 1`` becomes ``n`` requests. Checks that need the tokenizer or the model (vocabulary,
context length) happen in the TokenizerManager.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sgl.engine.messages import Bootstrap, LogprobOptions
from sgl.sampling import SamplingParams, SamplingParamsError

__all__ = ["MAX_SEQUENCES", "BadRequestError", "GenerateError", "GenerateReqInput",
           "OneRequest", "bootstraps", "drop_unsupported", "unpaired_surrogate"]

logger = logging.getLogger(__name__)

#: the most sequences one request may generate (its prompts times their n): each is a request
#: of its own in the scheduler, and the split copies its parameters
MAX_SEQUENCES = 4096


class GenerateError(RuntimeError):
    """A request failed. ``status`` is the HTTP status a frontend should answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class BadRequestError(GenerateError, ValueError):
    """The request itself is invalid (status 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, status=400)
        self.param = param


@dataclass
class OneRequest:
    """One sequence to generate, after batch expansion and ``n`` expansion."""

    index: int  # position in the caller's result list
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    logprobs: LogprobOptions
    return_text_in_logprobs: bool
    field_name: str  # "text" or "input_ids", for error messages (with the batch index)
    session_id: str | None = None
    data_parallel_rank: int | None = None  # the replica asked for (SGLang's router, dp-aware)
    bootstrap: Bootstrap | None = None  # the other server of a disaggregated request


def unpaired_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``; ``""`` for ``value`` itself) of the first string in
    ``value`` that holds an unpaired UTF-16 surrogate, or None. JSON's ``"\\ud800"`` escape
    decodes to one; it is not Unicode text, and no tokenizer takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in items:
        shown = str(key).encode("utf-8", "backslashreplace").decode()  # printable as it is
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{shown}".lstrip(".")
        found = unpaired_surrogate(key, where) if isinstance(key, str) else None
        if found is None:
            found = unpaired_surrogate(item, where)
        if found is not None:
            return found
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: fields of SGLang's GenerateReqInput (as of its io_struct.py of late 2026) that sgl does not
#: implement: accepted when empty (None, false, 0, "", [], {}), which is how SGLang's own clients
#: (its router, bench_serving, frontend language) send them; any other value is a 400 naming the
#: field. docs/api.md has the table.
UNSUPPORTED_SGLANG_FIELDS = frozenset({
    # multimodal input
    "image_data", "video_data", "audio_data", "modalities", "input_embeds", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    # outputs sgl does not compute
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "return_sampling_mask", "return_flat_raw_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "return_entropy", "return_bytes",
    "return_prompt_token_ids", "multi_item_delimiter_indices", "positional_embed_overrides",
    # adapters, custom sampling, reasoning budgets
    "lora_path", "lora_id", "custom_logit_processor", "require_reasoning", "max_thinking_tokens",
    # disaggregation beyond SGLang's three bootstrap fields, data-parallel routing other than
    # data_parallel_rank
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank", "kv_router_hint",
    # scheduling, caching and bookkeeping
    "priority", "extra_key", "cache_salt", "session_id", "background", "routing_key",
    "conversation_id", "label", "http_worker_ipc", "received_time", "external_trace_header",
    "custom_labels", "log_metrics", "no_logs", "model",
})
#: of those, the ones whose value changes nothing here, accepted whatever it is: ``model`` (this
#: server serves one model; SGLang's router sends it), metrics and log controls, trace and
#: routing labels (SGLang's ``session_id`` is one: unlike ``session_params`` it changes no prompt)
IGNORED_SGLANG_FIELDS = frozenset({"model", "log_metrics", "no_logs", "custom_labels",
                                   "session_id", "conversation_id", "label", "routing_key",
                                   "received_time", "external_trace_header", "http_worker_ipc"})


def drop_unsupported(body: dict[str, Any], unsupported: frozenset[str],
                     ignored: frozenset[str] = IGNORED_SGLANG_FIELDS) -> dict[str, Any]:
    """``body`` without the fields of ``unsupported`` (SGLang's fields sgl does not implement),
    each logged at debug level; BadRequestError naming the first one whose value would matter
    (not empty, and not in ``ignored``)."""
    kept = dict(body)
    for name in sorted(unsupported.intersection(body)):
        value = kept.pop(name)
        if value not in (None, False, "", [], {}) and name not in ignored:
            raise BadRequestError(f"{name}: not supported by sgl (accepted only when empty; "
                                  "see docs/api.md)", param=name)
        logger.debug("ignored SGLang field %s=%r", name, value)
    return kept


@dataclass
class GenerateReqInput:
    """A generate call: SGLang's ``GenerateReqInput`` fields that sgl supports."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | SamplingParams | list[Any] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: dict[str, Any] | None = None  # {"id": session id}; see docs/cache.md
    #: the data-parallel replica to run on (SGLang's router sends it with --dp-aware); None:
    #: the server's --load-balance-method picks
    data_parallel_rank: int | None = None
    #: prefill/decode disaggregation (SGLang's router in PD mode sets them): the prefill
    #: server's host and bootstrap port, and the room both servers know the request by; a list
    #: for a batch or n > 1 (one per generated sequence)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None

    @classmethod
    def from_dict(cls, body: Any) -> GenerateReqInput:
        """Build from a JSON body; unknown keys are refused with the list of known ones."""
        if not isinstance(body, dict):
            raise BadRequestError(f"the request body must be a JSON object, got "
                                  f"{type(body).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        body = drop_unsupported(body, UNSUPPORTED_SGLANG_FIELDS)
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise BadRequestError(f"unknown field(s): {', '.join(unknown)}; supported: "
                                  f"{', '.join(known)}", param=unknown[0])
        return cls(**body)

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return isinstance(self.input_ids, list) and bool(self.input_ids) and \
            isinstance(self.input_ids[0], list)

    def split(self) -> tuple[list[OneRequest], bool]:
        """One :class:`OneRequest` per sequence to generate, and whether the caller gets a
        list back (a batch, or ``n > 1``). Raises :class:`BadRequestError`."""
        if self.text is not None and self.input_ids is not None:
            raise BadRequestError("give either text or input_ids, not both", param="text")
        if self.text is None and self.input_ids is None:
            raise BadRequestError("text or input_ids is required", param="text")
        for name in ("return_text_in_logprobs", "stream"):
            if not isinstance(getattr(self, name), bool):
                raise BadRequestError(f"{name} must be true or false, got "
                                      f"{getattr(self, name)!r}", param=name)
        batch = self.is_batch
        if self.text is not None:
            prompts: list[Any] = self.text if batch else [self.text]
            field_name = "text"
            for i, p in enumerate(prompts):
                if not isinstance(p, str):
                    where = f"text[{i}]" if batch else "text"
                    raise BadRequestError(f"{where} must be a string, got {type(p).__name__}",
                                          param="text")
        else:
            prompts = self.input_ids if batch else [self.input_ids]  # type: ignore[list-item]
            field_name = "input_ids"
            for i, p in enumerate(prompts):
                where = f"input_ids[{i}]" if batch else "input_ids"
                if not isinstance(p, list) or not all(_is_int(t) for t in p):
                    raise BadRequestError(f"{where} must be a list of token ids (integers)",
                                          param="input_ids")
        size = len(prompts)
        if batch and size == 0:
            raise BadRequestError(f"{field_name} is an empty batch", param=field_name)

        def per_prompt(name: str, value: Any, list_ok: bool = True) -> list[Any]:
            if batch and isinstance(value, list) and list_ok:
                if len(value) != size:
                    raise BadRequestError(f"{name} has {len(value)} entries for a batch of "
                                          f"{size} prompts", param=name)
                return list(value)
            return [value] * size

        session_id = _session_id(self.session_params)
        if self.data_parallel_rank is not None and (
                not _is_int(self.data_parallel_rank) or self.data_parallel_rank < 0):
            raise BadRequestError(f"data_parallel_rank must be a replica index (an integer from "
                                  f"0), got {self.data_parallel_rank!r}",
                                  param="data_parallel_rank")
        samplings = per_prompt("sampling_params", self.sampling_params)
        rids = per_prompt("rid", self.rid)
        if batch and isinstance(self.rid, str):
            rids = [f"{self.rid}-{i}" for i in range(size)]
        return_logprob = per_prompt("return_logprob", self.return_logprob)
        start_lens = per_prompt("logprob_start_len", self.logprob_start_len)
        top_nums = per_prompt("top_logprobs_num", self.top_logprobs_num)
        tid_lists = self.token_ids_logprob
        if batch and isinstance(tid_lists, list) and tid_lists and isinstance(tid_lists[0], list):
            token_ids = per_prompt("token_ids_logprob", tid_lists)
        else:
            token_ids = [tid_lists] * size

        out: list[OneRequest] = []
        sequences = 0
        for i in range(size):
            where = f"[{i}]" if batch else ""
            params = _sampling(samplings[i], where)
            sequences += params.n
            if sequences > MAX_SEQUENCES:  # before any copy is made
                raise BadRequestError(f"the request asks for more than {MAX_SEQUENCES} "
                                      "sequences (prompts times n); send it in parts",
                                      param="sampling_params")
            logprobs = _logprob_options(return_logprob[i], start_lens[i], top_nums[i],
                                        token_ids[i], where)
            rid = rids[i]
            if rid is not None and not isinstance(rid, str):
                raise BadRequestError(f"rid{where} must be a string, got {type(rid).__name__}",
                                      param="rid")
            rid = rid or uuid.uuid4().hex
            n = params.n
            for j in range(n):
                sub = copy.deepcopy(params) if n > 1 else params
                sub.n = 1
                if n > 1 and params.seed is not None:
                    sub.seed = params.seed + j
                text = prompts[i] if self.text is not None else None
                # shared by the n sequences: the tokenizer manager copies each after its checks
                ids = prompts[i] if self.input_ids is not None else None
                out.append(OneRequest(
                    index=len(out), rid=f"{rid}-{j}" if n > 1 else rid, text=text, input_ids=ids,
                    sampling=sub, logprobs=copy.copy(logprobs),
                    return_text_in_logprobs=self.return_text_in_logprobs,
                    field_name=f"{field_name}{where}", session_id=session_id,
                    data_parallel_rank=self.data_parallel_rank))
        for req, boot in zip(out, bootstraps(self.bootstrap_host, self.bootstrap_port,
                                             self.bootstrap_room, len(out))):
            req.bootstrap = boot
        return out, batch or len(out) > 1


def bootstraps(host: Any, port: Any, room: Any, count: int) -> list[Bootstrap | None]:
    """SGLang's bootstrap fields as one :class:`Bootstrap` per generated sequence (all None
    when the request has none). Each field is a value for all, or a list of ``count``."""
    if host is None and port is None and room is None:
        return [None] * count

    def per_sequence(name: str, value: Any, ok: Any, expected: str) -> list[Any]:
        values = value if isinstance(value, list) else [value] * count
        if len(values) != count:
            raise BadRequestError(f"{name} has {len(values)} entries for {count} generated "
                                  "sequences", param=name)
        for v in values:
            if not ok(v):
                raise BadRequestError(f"{name} must be {expected}, got {v!r}", param=name)
        return values

    if host is None or room is None:
        missing = "bootstrap_host" if host is None else "bootstrap_room"
        raise BadRequestError(f"{missing} is required with the other bootstrap fields "
                              "(prefill/decode disaggregation)", param=missing)
    hosts = per_sequence("bootstrap_host", host, lambda v: isinstance(v, str) and v,
                         "a host name")
    ports = per_sequence("bootstrap_port", port,
                         lambda v: v is None or (_is_int(v) and 0 < v < 65536), "a port")
    rooms = per_sequence("bootstrap_room", room, lambda v: _is_int(v) and 0 <= v < 2**64,
                         "an integer from 0 below 2**64")
    if not isinstance(room, list) and count > 1:
        raise BadRequestError(f"bootstrap_room must be a list of {count} rooms, one per "
                              "generated sequence", param="bootstrap_room")
    return [Bootstrap(h, p, r) for h, p, r in zip(hosts, ports, rooms)]


def _session_id(params: Any) -> str | None:
    """The session id of SGLang's ``session_params``; sgl's sessions keep a conversation cached
    (the prompt carries the whole conversation), so SGLang's branching keys are refused."""
    if params is None or params == {}:
        return None
    if not isinstance(params, dict) or not isinstance(params.get("id"), str):
        raise BadRequestError("session_params must be an object with a string 'id' (from "
                              "/open_session)", param="session_params")
    extra = sorted(k for k, v in params.items() if k != "id" and v not in (None, False, ""))
    if extra:
        raise BadRequestError(f"session_params: {', '.join(extra)} not supported by sgl; send "
                              "the whole conversation as the prompt", param="session_params")
    return params["id"]


def _sampling(value: Any, where: str) -> SamplingParams:
    try:
        if isinstance(value, SamplingParams):
            params = copy.deepcopy(value)
            params.validate()
            return params
        return SamplingParams.from_dict(value)
    except SamplingParamsError as exc:
        raise BadRequestError(f"sampling_params{where}: {exc}", param="sampling_params") from None
    except TypeError as exc:  # a key SamplingParams does not take
        raise BadRequestError(f"sampling_params{where}: {exc}", param="sampling_params") from None


def _logprob_options(return_logprob: Any, start_len: Any, top_num: Any, token_ids: Any,
                     where: str) -> LogprobOptions:
    if not isinstance(return_logprob, bool):
        raise BadRequestError(f"return_logprob{where} must be true or false, got "
                              f"{return_logprob!r}", param="return_logprob")
    start = -1 if start_len is None else start_len
    if not _is_int(start) or start < -1:
        raise BadRequestError(f"logprob_start_len{where} must be -1 (output only) or an integer "
                              f">= 0, got {start_len!r}", param="logprob_start_len")
    top = 0 if top_num is None else top_num
    if not _is_int(top) or top < 0:
        raise BadRequestError(f"top_logprobs_num{where} must be an integer >= 0, got {top_num!r}",
                              param="top_logprobs_num")
    if token_ids is not None and (not isinstance(token_ids, list)
                                  or not all(_is_int(t) and t >= 0 for t in token_ids)):
        raise BadRequestError(f"token_ids_logprob{where} must be a list of token ids, got "
                              f"{token_ids!r}", param="token_ids_logprob")
    return LogprobOptions(return_logprob=return_logprob, logprob_start_len=start,
                          top_logprobs_num=top,
                          token_ids_logprob=list(token_ids) if token_ids is not None else None)
