"""The ``sgl bench`` click group: ``serving``, ``offline`` and ``one-batch``.

Only click and the standard library are imported at module level; aiohttp, httpx,
transformers' tokenizer and torch are imported by the command that needs them.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sgl_bench.datasets import DATASETS, BenchError, BenchRequest

from sgl.cli import GroupedCommand, option_for_field  # engine settings, as sgl serve's

__all__ = ["RESULT_SCHEMA", "bench"]

#: ``"schema"`` of every results file; bumped when a field changes meaning or goes away
RESULT_SCHEMA = "sgl-bench/1"

RESULTS_HELP = """\b
Results file (--output-file, JSON, one object):
  schema     "sgl-bench/1"
  command    "serving", "offline" or "one-batch"
  date       UTC time of the run, ISO 8601
  config     every option of the command, by name
  environment  python, platform, sgl version
  metrics    serving and offline: completed, failed (serving), duration_s,
             total_input_tokens, total_output_tokens, request_throughput (req/s),
             input_throughput, output_throughput, total_throughput (tok/s),
             concurrency (serving), and ttft_ms, tpot_ms, itl_ms (serving),
             e2e_latency_ms, each {mean, median, p99, std, max} in ms (null
             without samples); one-batch: a list, one object per case
  requests   serving with --output-details: per request success, error,
             prompt_len, output_len, ttft_ms, e2e_latency_ms, itl_ms (list)
  serving also has SGLang bench_serving's flat keys (backend, dataset_name,
             request_rate, duration, completed, output_throughput,
             mean_ttft_ms, median_itl_ms, p99_e2e_latency_ms, ...).
A file named *.jsonl gets each run appended as one line, as bench_serving does.
"""


#: ``--backend`` names of SGLang's bench_serving, and sgl's backend that speaks the same routes
BENCH_SERVING_BACKENDS = {
    "sglang": "sgl", "sglang-native": "sgl", "sglang-oai": "openai-completions",
    "sglang-oai-chat": "openai-chat", "vllm": "openai-completions", "vllm-chat": "openai-chat",
    "lmdeploy": "openai-completions", "openai": "openai-completions",
}
BACKENDS = ("sgl", "openai-chat", "openai-completions", *BENCH_SERVING_BACKENDS)


# --- shared options -----------------------------------------------------------------------------

def dataset_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The dataset flags shared by ``serving`` and ``offline``."""
    options = [
        click.option("--dataset", "--dataset-name", "dataset", type=click.Choice(DATASETS),
                     default="random",
                     show_default=True, help="Which prompts to send."),
        click.option("--dataset-path", type=click.Path(dir_okay=False),
                     help="sharegpt: the ShareGPT-format JSON file."),
        click.option("--num-prompts", type=int, default=100, show_default=True,
                     help="Requests to send (generated-shared-prefix: groups x prompts)."),
        click.option("--random-input-len", "--random-input", "random_input_len", type=int,
                     default=1024, show_default=True,
                     help="random: the longest prompt, in tokens."),
        click.option("--random-output-len", "--random-output", "random_output_len", type=int,
                     default=128, show_default=True,
                     help="random: the longest output, in tokens."),
        click.option("--random-range-ratio", type=float, default=1.0, show_default=True,
                     help="random: lengths are uniform in [len * ratio, len]; 1: fixed."),
        click.option("--sharegpt-output-len", type=int,
                     help="sharegpt: output tokens per request; default: the answer's length."),
        click.option("--sharegpt-context-len", type=int, default=2048, show_default=True,
                     help="sharegpt: skip conversations whose prompt + answer is longer."),
        click.option("--gsp-num-groups", type=int, default=8, show_default=True,
                     help="generated-shared-prefix: groups (one system prompt each)."),
        click.option("--gsp-prompts-per-group", type=int, default=16, show_default=True,
                     help="generated-shared-prefix: questions per group."),
        click.option("--gsp-system-prompt-len", type=int, default=512, show_default=True,
                     help="generated-shared-prefix: system prompt tokens."),
        click.option("--gsp-question-len", type=int, default=32, show_default=True,
                     help="generated-shared-prefix: question tokens."),
        click.option("--gsp-output-len", type=int, default=32, show_default=True,
                     help="generated-shared-prefix: output tokens."),
        click.option("--seed", type=int, default=1, show_default=True,
                     help="Seed of the prompts and of the arrival times."),
        click.option("--disable-ignore-eos", is_flag=True,
                     help="Let requests stop at EOS (default: generate the requested length)."),
        click.option("--output-file", type=click.Path(dir_okay=False),
                     help="Write the results as JSON here (schema below)."),
        click.option("--disable-tqdm", is_flag=True, help="No progress bar."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def build_requests(params: dict[str, Any], tokenizer: Any, *, as_text: bool) -> list[BenchRequest]:
    from sgl_bench import datasets

    name = params["dataset"]
    if name == "random":
        return datasets.random_requests(
            tokenizer, num_prompts=params["num_prompts"], input_len=params["random_input_len"],
            output_len=params["random_output_len"], range_ratio=params["random_range_ratio"],
            seed=params["seed"], as_text=as_text)
    if name == "sharegpt":
        if not params["dataset_path"]:
            raise BenchError("--dataset sharegpt needs --dataset-path FILE.json (a ShareGPT-format "
                             "file; nothing is downloaded)")
        return datasets.load_sharegpt(
            params["dataset_path"], tokenizer, num_prompts=params["num_prompts"],
            seed=params["seed"], output_len=params["sharegpt_output_len"],
            context_len=params["sharegpt_context_len"], as_text=as_text)
    return datasets.generated_shared_prefix(
        tokenizer, num_groups=params["gsp_num_groups"],
        prompts_per_group=params["gsp_prompts_per_group"],
        system_prompt_len=params["gsp_system_prompt_len"],
        question_len=params["gsp_question_len"], output_len=params["gsp_output_len"],
        seed=params["seed"], as_text=as_text)


def load_tokenizer(path: str | None) -> Any:
    from sgl.model_loader import load_tokenizer as load

    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - ModelLoadError and transformers' own errors
        raise BenchError(f"cannot load the tokenizer {path or '(bundled model)'}: {exc}") from None


def _environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        sgl_version = version("sgl")
    except PackageNotFoundError:
        sgl_version = None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "sgl": sgl_version}


def _json_safe(value: Any) -> Any:
    """JSON has no inf/nan: they become strings (``--request-rate inf``) or null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def result_document(command: str, config: dict[str, Any], metrics: Any,
                    **extra: Any) -> dict[str, Any]:
    """The results file's object (see ``RESULTS_HELP``)."""
    doc = {"schema": RESULT_SCHEMA, "command": command,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "config": config, "environment": _environment(), "metrics": metrics, **extra}
    return _json_safe(doc)


def write_results(path: str | None, doc: dict[str, Any]) -> None:
    """The document as the file (indented JSON); a ``.jsonl`` file gets it appended as one line,
    as SGLang's bench_serving writes its results (a sweep appends a line per run)."""
    if not path:
        return
    if path.endswith(".jsonl"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(doc) + "\n")
        click.echo(f"results appended to {path}")
        return
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    click.echo(f"results written to {path}")


def bench_serving_fields(p: dict[str, Any], backend: str, metrics: dict[str, Any]
                         ) -> dict[str, Any]:
    """The flat keys of SGLang's bench_serving results line, from this run, so that scripts
    that read bench_serving's output read sgl's too."""
    fields: dict[str, Any] = {
        "backend": backend, "dataset_name": p["dataset"], "request_rate": p["request_rate"],
        "max_concurrency": p["max_concurrency"], "random_input_len": p["random_input_len"],
        "random_output_len": p["random_output_len"],
        "random_range_ratio": p["random_range_ratio"], "duration": metrics["duration_s"],
        **{key: metrics[key] for key in (
            "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "input_throughput", "output_throughput", "total_throughput", "concurrency")}}
    for name in ("e2e_latency", "ttft", "tpot", "itl"):
        stats = metrics[f"{name}_ms"] or {}
        for stat in ("mean", "median", "std", "p99"):
            fields[f"{stat}_{name}_ms"] = stats.get(stat)
    return fields


def _progress(total: int, desc: str, disable: bool, unit: str = "req") -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=disable, dynamic_ncols=True)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_report(title: str, rows: list[tuple[str, Any]], latencies: dict[str, Any]) -> None:
    width = 50
    click.echo(f" {title} ".center(width, "="))
    for label, value in rows:
        click.echo(f"{label:<36}{_fmt(value):>14}")
    for name, stats in latencies.items():
        click.echo(f" {name} ".center(width, "-"))
        for key in ("mean", "median", "p99"):
            click.echo(f"{key.capitalize() + ' (ms):':<36}{_fmt(stats[key]):>14}")
    click.echo("=" * width)


def _fail(exc: BenchError) -> click.ClickException:
    return click.ClickException(str(exc))


# --- engine settings passed through -------------------------------------------------------------

#: ServerSettings fields that only concern the HTTP server
_SERVER_ONLY = {"host", "port", "served_model_name", "frontends", "api_key",
                "max_request_body_size", "graceful_shutdown_timeout"}
#: the fields ``one-batch`` uses (it has no scheduler, cache or sampler settings)
_ONE_BATCH_FIELDS = ("model_path", "dtype", "quantization", "int8_activations", "num_threads",
                     "attention_backend",
                     "page_size", "context_length", "load_plugins", "disable_plugins")


def engine_options(names: typing.Iterable[str] | None = None) -> Callable[..., Any]:
    """Click options for sgl's engine settings (``--dtype``, ``--num-threads``,
    ``--disable-radix-cache`` ...), derived from ``sgl.config.ServerSettings`` so they stay in
    step with ``sgl serve``; only the ones given on the command line are passed on."""
    from sgl.config import ServerSettings, option_fields

    hints = typing.get_type_hints(ServerSettings)
    wanted = set(names) if names is not None else None
    options = []
    for f in option_fields(ServerSettings):
        if f.name in _SERVER_ONLY or (wanted is not None and f.name not in wanted):
            continue
        flag = (f.metadata.get("flags") or (f"--{f.name.replace('_', '-')}",))[0]
        options.append(option_for_field(f, hints[f.name], dest=f"engine__{f.name}",
                                        flags=(flag,),
                                        group="Engine settings (as for sgl serve)"))

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        params = getattr(command, "__click_params__", [])
        params.extend(reversed(options))
        command.__click_params__ = params  # type: ignore[attr-defined]
        return command

    return decorate


def split_engine_settings(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the command's own options, the engine settings given on the command line)."""
    own = {k: v for k, v in params.items() if not k.startswith("engine__")}
    engine = {k[len("engine__"):]: v for k, v in params.items()
              if k.startswith("engine__") and v not in (None, ())}
    return own, engine


# --- the commands -------------------------------------------------------------------------------

@click.group("bench", context_settings={"max_content_width": 100})
def bench() -> None:
    """Benchmark a server (serving), sgl.Engine in this process (offline) or one static batch
    on the model runner (one-batch)."""


@bench.command("serving", epilog=RESULTS_HELP)
@click.option("--base-url", default="http://127.0.0.1:30000", show_default=True,
              help="The server: sgl serve, SGLang, vLLM, llama.cpp's llama-server ...")
@click.option("--host", help="With --port, the server's address as SGLang's bench_serving "
                             "takes it (--base-url http://HOST:PORT); default 127.0.0.1.")
@click.option("--port", type=click.IntRange(1, 65535),
              help="The server's port, as SGLang's bench_serving takes it; default 30000.")
@click.option("--backend", type=click.Choice(BACKENDS), default="sgl", show_default=True,
              metavar="[sgl|openai-chat|openai-completions]",
              help="sgl: native /generate (sgl, SGLang); openai-*: /v1/chat/completions or "
                   "/v1/completions of any OpenAI-compatible server. SGLang's bench_serving "
                   "names work too: sglang and sglang-native (/generate), sglang-oai, vllm, "
                   "lmdeploy and openai (/v1/completions), sglang-oai-chat and vllm-chat "
                   "(/v1/chat/completions).")
@click.option("--model", help="Model name for the OpenAI backends; default: the first of "
                              "GET /v1/models, else 'default'.")
@click.option("--tokenizer", help="Tokenizer (HF folder or .gguf) for prompts and counts; "
                                  "default: the server's (/get_model_info) when it is on this "
                                  "machine, else the bundled SmolLM2's.")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Sent as 'Authorization: Bearer KEY'. "
                                                         "[env: OPENAI_API_KEY]")
@dataset_options
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Requests per second, Poisson arrivals; inf: all at once.")
@click.option("--max-concurrency", type=click.IntRange(min=1),
              help="At most this many requests in flight.")
@click.option("--warmup-requests", type=click.IntRange(min=0), default=1, show_default=True,
              help="Requests of at most 16 output tokens, sharing no prefix with the measured "
                   "ones, sent before the run.")
@click.option("--flush-cache", is_flag=True,
              help="POST /flush_cache before the run (after the warm-up), when the server has it.")
@click.option("--timeout", type=float, help="Seconds a request may take; default: no limit.")
@click.option("--disable-stream", is_flag=True,
              help="Send each request without streaming (as SGLang's bench_serving does with it):"
                   " TTFT is then the whole request's latency, and there are no ITLs.")
@click.option("--extra-request-body", metavar="JSON",
              help="A JSON object merged into every request body, as in SGLang's bench_serving "
                   "(for example '{\"top_p\": 0.9}').")
@click.option("--output-details", is_flag=True,
              help="Also write each request's lengths, TTFT, ITLs and error to the results file.")
def serving_cmd(**params: Any) -> None:
    """Measure a running server: throughput, TTFT, ITL, TPOT and end-to-end latency.

    The random and generated-shared-prefix prompts are random token ids: sent as ids to the sgl
    backend (exact lengths), as text decoded from those ids to the OpenAI backends (re-tokenized;
    lengths within a few tokens, the server's own count is used when it reports one).
    """
    try:
        _serving(params)
    except BenchError as exc:
        raise _fail(exc) from None


def _base_url(p: dict[str, Any]) -> str:
    """--base-url, or bench_serving's --host/--port; both at once is an error."""
    source = click.get_current_context().get_parameter_source("base_url")
    given = source is not None and source.name != "DEFAULT"
    if p["host"] is None and p["port"] is None:
        return p["base_url"].rstrip("/")
    if given:
        raise click.UsageError("give --base-url or --host/--port, not both")
    return f"http://{p['host'] or '127.0.0.1'}:{p['port'] or 30000}"


def _extra_body(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--extra-request-body") from None
    if not isinstance(body, dict):
        raise click.BadParameter("expected a JSON object", param_hint="--extra-request-body")
    return body


def warmup_request(req: BenchRequest) -> BenchRequest:
    """A short request shaped like ``req`` that shares no prefix with it (reversed ids, or
    text with another start), so that the warm-up leaves nothing in a prefix cache that the
    measured run could hit."""
    if isinstance(req.prompt, str):
        prompt: str | list[int] = "Warm-up. " + req.text
    else:
        prompt = list(reversed(req.prompt))
    return BenchRequest(prompt, req.prompt_len, min(req.output_len, 16))


def _serving(p: dict[str, Any]) -> None:
    import os

    from sgl_bench.metrics import compute_metrics
    from sgl_bench.serving import (
        ServingRun,
        check_server,
        flush_cache,
        resolve_model,
        run_serving,
        server_accept_length,
        server_tokenizer_path,
    )

    base = _base_url(p)
    backend = BENCH_SERVING_BACKENDS.get(p["backend"], p["backend"])
    extra_body = _extra_body(p["extra_request_body"])
    key = p["api_key"]
    check_server(base, key)
    tokenizer_path = p["tokenizer"]
    if tokenizer_path is None:
        served = server_tokenizer_path(base, key)
        tokenizer_path = served if served and os.path.exists(served) else None
    tokenizer = load_tokenizer(tokenizer_path)
    model = p["model"] or (resolve_model(base, key) if backend != "sgl" else None) or "default"
    requests = build_requests(p, tokenizer, as_text=backend != "sgl")
    run = ServingRun(base_url=base, backend=backend, model=model,
                     ignore_eos=not p["disable_ignore_eos"], api_key=key, timeout=p["timeout"],
                     extra_body=extra_body, stream=not p["disable_stream"])
    click.echo(f"{backend} backend at {base}, model {model}, tokenizer "
               f"{tokenizer_path or 'bundled SmolLM2'}; {len(requests)} requests, "
               f"{sum(r.prompt_len for r in requests)} prompt tokens")

    if p["warmup_requests"]:
        warm = [warmup_request(r) for r in requests[:p["warmup_requests"]]]
        results, _ = run_serving(run, warm)
        failed = [r for r in results if not r.success]
        if failed:
            raise BenchError(f"the warm-up request failed: {failed[0].error} (check --backend "
                             f"{backend!r}, --base-url and --model)")
    if p["flush_cache"]:
        click.echo(flush_cache(base, key))

    bar = _progress(len(requests), "serving", p["disable_tqdm"])
    with bar:
        results, duration = run_serving(run, requests, request_rate=p["request_rate"],
                                        max_concurrency=p["max_concurrency"], seed=p["seed"],
                                        on_done=lambda r: bar.update(1))
    metrics = compute_metrics(results, duration)
    metrics["accept_length"] = server_accept_length(base, key)
    errors = [r.error for r in results if not r.success]
    if errors:
        click.echo(f"{len(errors)} request(s) failed; the first: {errors[0]}", err=True)
    accept = ([("Accept length:", metrics["accept_length"])]
              if metrics["accept_length"] is not None else [])
    print_report("Serving benchmark", [
        ("Backend:", backend),
        ("Request rate (req/s):",
         "inf" if p["request_rate"] == float("inf") else p["request_rate"]),
        ("Max concurrency:", p["max_concurrency"] or "-"),
        ("Successful requests:", metrics["completed"]),
        ("Failed requests:", metrics["failed"]),
        ("Duration (s):", metrics["duration_s"]),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Total output tokens:", metrics["total_output_tokens"]),
        ("Request throughput (req/s):", metrics["request_throughput"]),
        ("Input token throughput (tok/s):", metrics["input_throughput"]),
        ("Output token throughput (tok/s):", metrics["output_throughput"]),
        ("Total token throughput (tok/s):", metrics["total_throughput"]),
        ("Concurrency:", metrics["concurrency"]),
        *accept,
    ], {"End-to-end latency": metrics["e2e_latency_ms"], "Time to first token":
        metrics["ttft_ms"], "Time per output token (excl. 1st)": metrics["tpot_ms"],
        "Inter-token latency": metrics["itl_ms"]})
    extra: dict[str, Any] = {"server": {"base_url": base, "backend": backend, "model": model,
                                        "tokenizer": tokenizer_path}}
    if p["output_details"]:
        extra["requests"] = [
            {"success": r.success, "error": r.error or None, "prompt_len": r.prompt_len,
             "output_len": r.output_len,
             "ttft_ms": r.ttft * 1000 if r.ttft is not None else None,
             "e2e_latency_ms": r.latency * 1000, "itl_ms": [g * 1000 for g in r.itl]}
            for r in results]
    extra.update(bench_serving_fields(p, backend, metrics))
    write_results(p["output_file"], result_document("serving", p, metrics, **extra))
    if metrics["completed"] == 0:
        raise BenchError("every request failed")


@bench.command("offline", cls=GroupedCommand, epilog=RESULTS_HELP)
@dataset_options
@engine_options()
@click.option("--tokenizer", help="Tokenizer for the prompts; default: the model's.")
def offline_cmd(**params: Any) -> None:
    """Throughput of sgl.Engine in this process: every request at once, continuous batching.

    Random and generated-shared-prefix prompts are token ids; ShareGPT prompts are text.
    Engine settings not given keep sgl serve's defaults (SGL_* variables are not read).
    """
    own, engine_settings = split_engine_settings(params)
    try:
        _offline(own, engine_settings)
    except BenchError as exc:
        raise _fail(exc) from None


def _offline(p: dict[str, Any], settings: dict[str, Any]) -> None:
    from sgl_bench.offline import run_offline

    tokenizer = load_tokenizer(p["tokenizer"] or settings.get("model_path"))
    requests = build_requests(p, tokenizer, as_text=False)
    settings.setdefault("log_level", "warning")
    import sgl

    try:
        engine = sgl.Engine(**settings)
    except (TypeError, ValueError) as exc:
        raise BenchError(f"engine settings: {exc}") from None
    with engine:
        engine.generate(input_ids=[list(range(100, 132))], sampling_params={"max_new_tokens": 4})
        engine.flush_cache()
        click.echo(f"sgl.Engine, {len(requests)} requests, "
                   f"{sum(r.prompt_len for r in requests)} prompt tokens, settings {settings}")
        bar = _progress(len(requests), "offline", p["disable_tqdm"])
        with bar:
            metrics = run_offline(engine, requests, ignore_eos=not p["disable_ignore_eos"],
                                  on_done=lambda: bar.update(1))
    print_report("Offline benchmark", [
        ("Requests:", metrics["completed"]),
        ("Duration (s):", metrics["duration_s"]),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Cached input tokens:", metrics["cached_tokens"]),
        ("Total output tokens:", metrics["total_output_tokens"]),
        ("Request throughput (req/s):", metrics["request_throughput"]),
        ("Input token throughput (tok/s):", metrics["input_throughput"]),
        ("Output token throughput (tok/s):", metrics["output_throughput"]),
        ("Total token throughput (tok/s):", metrics["total_throughput"]),
    ], {"End-to-end latency": metrics["e2e_latency_ms"],
        "Time to first token": metrics["ttft_ms"]})
    write_results(p["output_file"], result_document(
        "offline", {**p, "engine": settings}, metrics))


@bench.command("one-batch", cls=GroupedCommand, epilog=RESULTS_HELP)
@click.option("--batch-size", type=click.IntRange(min=1), multiple=True,
              help="Sequences in the batch (repeatable; default 1).")
@click.option("--input-len", type=click.IntRange(min=1), multiple=True,
              help="Prompt tokens of each sequence (repeatable; default 512).")
@click.option("--output-len", type=click.IntRange(min=1), multiple=True,
              help="Tokens generated per sequence, the first from the prefill (repeatable; "
                   "default 32).")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Run a short batch first (not reported).")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the prompts.")
@click.option("--output-file", type=click.Path(dir_okay=False),
              help="Write the results as JSON here (schema below).")
@click.option("--disable-tqdm", is_flag=True, help="No progress bar.")
@engine_options(_ONE_BATCH_FIELDS)
def one_batch_cmd(**params: Any) -> None:
    """Latency of one static batch on the model runner (no scheduler, no HTTP): the prefill of
    every prompt in one forward pass, then each decode step of the whole batch.

    Every combination of --batch-size, --input-len and --output-len is run, after loading the
    model once. Reported: prefill latency and tokens/s, median decode step latency and tokens/s
    (batch size / step), total latency and overall tokens/s.
    """
    own, settings = split_engine_settings(params)
    try:
        _one_batch(own, settings)
    except BenchError as exc:
        raise _fail(exc) from None


def _one_batch(p: dict[str, Any], settings: dict[str, Any]) -> None:
    import itertools

    from sgl_bench.one_batch import load_runner, run_one_batch

    sizes, ins, outs = (list(p["batch_size"]) or [1], list(p["input_len"]) or [512],
                        list(p["output_len"]) or [32])
    cases = list(itertools.product(sizes, ins, outs))
    max_tokens = max(b * (i + o) for b, i, o in cases) + 64
    try:
        runner = load_runner(
            model_path=settings.get("model_path"), dtype=settings.get("dtype", "auto"),
            quantization=settings.get("quantization", "auto"),
            int8_activations=settings.get("int8_activations", "auto"),
            attention_backend=settings.get("attention_backend", "torch"),
            num_threads=settings.get("num_threads"), page_size=settings.get("page_size", 1),
            context_length=settings.get("context_length"), max_batch=max(sizes),
            max_tokens=max_tokens, load_plugins=settings.get("load_plugins", ()),
            disable_plugins=settings.get("disable_plugins", ()))
    except Exception as exc:  # noqa: BLE001 - bad model path, backend, plugin: one line
        raise BenchError(f"cannot load the model runner: {type(exc).__name__}: {exc}") from None
    longest = max(i + o for _, i, o in cases)
    if longest > runner.context_length:
        raise BenchError(f"input + output length {longest} exceeds the context length "
                         f"{runner.context_length}")
    if p["warmup"]:
        run_one_batch(runner, batch_size=sizes[0], input_len=min(ins[0], 32), output_len=4)
    results = []
    bar = _progress(sum(o for _, _, o in cases), "one-batch", p["disable_tqdm"], unit="step")
    with bar:
        for b, i, o in cases:
            results.append(run_one_batch(runner, batch_size=b, input_len=i, output_len=o,
                                         seed=p["seed"], on_step=lambda: bar.update(1)))
    dtype = str(runner.dtype).replace("torch.", "")
    click.echo(f"model {runner.model_path.name}, {dtype}, quantization {runner.quantization}, "
               f"weights {runner.weights_bytes / 2**20:.1f} MiB, backend "
               f"{settings.get('attention_backend', 'torch')}")
    click.echo("| batch | input | output | prefill (s) | prefill tok/s | median decode (ms) "
               "| decode tok/s | total (s) | overall tok/s |")
    click.echo("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        med = r["median_decode_latency_s"]
        click.echo(f"| {r['batch_size']} | {r['input_len']} | {r['output_len']} | "
                   f"{r['prefill_latency_s']:.3f} | {r['prefill_throughput']:.1f} | "
                   f"{_fmt(med * 1000 if med else None)} | "
                   f"{_fmt(r['median_decode_throughput'], 1)} | {r['total_latency_s']:.3f} | "
                   f"{r['overall_throughput']:.1f} |")
    write_results(p["output_file"], result_document(
        "one-batch", {**p, "engine": settings}, results,
        model={"path": str(runner.model_path), "dtype": dtype}))
