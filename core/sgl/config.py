"""Server settings and where they come from.

One frozen :class:`ServerSettings` holds every option of the server. Values come from four
sources, highest precedence first: command-line flags, ``SGL_*`` environment variables, a config
file (YAML or TOML, ``--config``) and the field defaults. The core's class holds the core's
options; each plugin adds its own frozen dataclass through ``sgl_add_config``, whose fields are
named ``<id>_<field>`` at the top level (or the name a field declares, for SGLang's flag names):
``--<id>-<field>`` flags, ``SGL_<ID>_<FIELD>`` variables, keys of a config file (top level or
its ``plugins.<id>`` table) and of ``/get_server_info``. A plugin checks its options against the
rest in ``sgl_check_settings``. Every resolved value remembers its source, which ``sgl config
show`` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from sgl.threads import check_thread_counts, usable_cores

__all__ = [
    "ConfigError",
    "ServerSettings",
    "coerce_value",
    "env_var_name",
    "load_settings",
    "option_fields",
    "read_config_file",
    "settings_from_dict",
]

#: list-valued selections that add up across sources instead of overriding each other
ADDITIVE_FIELDS = ("load_plugins", "disable_plugins")


class ConfigError(ValueError):
    """A setting is unknown or has a bad value; the message names the key, value and source."""


def _opt(default: Any, help: str, **extra: Any) -> Any:
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServerSettings:
    """Everything ``sgl serve`` and ``sgl.Engine`` can be told."""

    model_path: str | None = _opt(
        None, "Hugging Face model folder or .gguf file; default: the bundled SmolLM2-135M-Instruct.",
        flags=("--model-path", "--model"))
    served_model_name: str | None = _opt(
        None, "Model name reported by the API; default: derived from the model path.")
    chat_template: str | None = _opt(
        None, "Jinja chat template file used instead of the model's own.")
    host: str = _opt("127.0.0.1", "Address the HTTP server binds to.")
    port: int = _opt(30000, "Port of the HTTP server.")
    device: Literal["auto", "cpu", "cuda"] = _opt(
        "auto", "Where the model, its KV cache and the sampling live: cuda (an NVIDIA GPU "
        "through torch; the first one, or the one CUDA_VISIBLE_DEVICES leaves), cpu, or auto: "
        "cuda when torch sees a GPU, else cpu.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto", "Data type of weights and activations; auto: on CPU bfloat16 where sgl's "
        "kernels run at a level with bfloat16 instructions (faster decode), else float32; on "
        "accelerators the checkpoint's half type.")
    quantization: str = _opt(
        "auto", "How the weights are held. auto: a GGUF file's Q4_0, Q4_1 and Q8_0 blocks as "
        "they are (multiplied by sgl's quantized kernels; other GGUF types dequantized, with a "
        "log line), a checkpoint in a weight format a plugin registers (the choices after "
        "w8a8_int8) as its blocks too, any other Hugging Face checkpoint dense. none: everything "
        "dequantized to --dtype. int8 / int4: a dense Hugging Face checkpoint's linear weights "
        "rounded to 8-/4-bit blocks of 32 at load (weight-only; the embedding and LM head to 8 "
        "bits). w8a8_int8: SGLang's scheme, the linear weights rounded to int8 per output "
        "channel at load and each matmul's activations to int8 per token, multiplied as "
        "integers (the embedding and LM head stay --dtype). gguf, or a weight "
        "format's name: as auto, but only for that kind of checkpoint.",
        registry="weight_formats", keywords=("auto", "none", "gguf", "int8", "int4", "w8a8_int8"))
    int8_activations: Literal["auto", "on", "off"] = _opt(
        "auto", "Round the activations to int8 per block of 32 before every matmul of quantized "
        "weights (a GGUF file's blocks, --quantization int8/int4, packed checkpoints), prefill "
        "and decode, and multiply integers, as llama.cpp does: 1.4-2x as fast on CPU, the "
        "logits moved by about 0.5, greedy output still the same alone, in any batch and after "
        "a prefix-cache hit. auto (default): on for a GGUF file served on CPU with sgl's "
        "kernels, off otherwise. on: always. off: every product exact.")
    enable_deterministic_inference: bool = _opt(
        False, "Refuse the settings under which greedy output depends on the batch (SGLang's "
        "flag): a GPU device (its attention kernels are not batch-invariant). On the CPU "
        "sgl's kernels give a token the same result alone, in any batch and after a "
        "prefix-cache hit with or without it (docs/kernels.md, Batch invariance).")
    num_threads: int | None = _opt(
        None, "torch intra-op threads of the scheduler; default: 1 where sgl's CPU kernels run "
        "(they need it), else one less than the usable cores (the process's CPU affinity).",
        minimum=1)
    kernel_threads: int | None = _opt(
        None, "Threads of sgl's own CPU kernels (the bfloat16 and float32 matmuls, decode "
        "attention, norms), used while torch runs on one thread; they share the work chunk by "
        "chunk, so a busy core slows them little. Default: the usable cores where the kernels "
        "run, else 1. Not above the usable cores, nor above 1 with --num-threads above 1.",
        minimum=1)
    cpu_isa: str = _opt(
        "auto", "Highest instruction-set level of sgl's CPU kernels: one of the CPU kernel "
        "library's levels (`sgl plugins` lists them, best first) or none (torch's operators "
        "only); never above what the CPU has. auto: the CPU's best. For comparisons and for "
        "testing the lower paths.")
    disable_cpu_graph: bool = _opt(
        False, "Run every decode forward through the model's Python code instead of replaying "
        "the kernel calls recorded for its batch size (CPU; what --disable-cuda-graph is on a "
        "GPU).")
    cpu_graph_max_bs: int | None = _opt(
        None, "Largest decode batch whose forward is recorded at start-up for replays, every "
        "size from 1 up (a few seconds; their activations share one arena); larger batches "
        "are recorded when their size recurs. Default: --max-running-requests, at most 64. 0: "
        "record only sizes that recur. --device cpu only.", minimum=0)
    disable_cuda_graph: bool = _opt(
        False, "Run every decode forward eagerly instead of replaying the CUDA graph captured "
        "at start-up for its batch size (--device cuda; on CPU see --disable-cpu-graph).")
    cuda_graph_max_bs: int | None = _opt(
        None, "Largest decode batch captured as a CUDA graph at start-up (sizes 1, 2, 4, 8, "
        "then every 8); larger batches run eagerly. Default: 160; never above "
        "--max-running-requests. --device cuda only.", minimum=1)
    max_total_tokens: int | None = _opt(
        None, "Size of the KV pool in tokens; default: from --mem-fraction-static.", minimum=1)
    mem_fraction_static: float | None = _opt(
        None, "Memory for the model when --max-total-tokens is unset. On a GPU as SGLang means "
        "it: the fraction of the GPU's total memory that the weights and the KV pool take "
        "together (default 0.85; the rest is for activations and CUDA graphs). On CPU: the "
        "fraction of the host's available memory, after loading the weights, that the KV pool "
        "takes (default 0.1).")
    max_running_requests: int = _opt(64, "Most requests decoded together in one batch.",
                                     minimum=1)
    context_length: int | None = _opt(
        None, "Longest sequence (prompt + output); default: the model's own.", minimum=2)
    page_size: int = _opt(1, "Tokens per page of the KV pool.", minimum=1)
    chunked_prefill_size: int = _opt(
        512, "Most prompt tokens prefilled in one forward pass; longer prompts are split into "
        "chunks interleaved with decoding. -1 turns chunking off.")
    attention_backend: str = _opt("torch", "Attention backend, by registered name.",
                                  registry="attention")
    cache_policy: str | None = _opt(
        None, "Prefix-cache policy by name; default: radix when its plugin is installed, else "
        "none.", registry="cache")
    disable_radix_cache: bool = _opt(
        False, "Cache nothing across requests (no prefix cache), whatever --cache-policy says.")
    schedule_policy: Literal["lpm", "dfs-weight", "fcfs", "lof", "random"] = _opt(
        "lpm", "Order in which waiting requests are admitted: lpm (longest cached prefix "
        "first), dfs-weight (depth-first over the cache tree), fcfs, lof (longest output "
        "first) or random.")
    grammar_backend: str = _opt(
        "auto", "Grammar backend for structured output (json_schema, regex, ebnf), by name; auto: "
        "xgrammar when its plugin is installed, else none; none: refuse constraints.",
        registry="grammar", keywords=("auto", "none"))
    disable_jump_forward: bool = _opt(
        False, "Sample every token of constrained output, even where the grammar allows only one "
        "continuation (jump-forward decoding off).")
    grammar_compile_timeout: float = _opt(
        30.0, "Seconds one constraint (json_schema, regex, ebnf) may take to compile; past it the "
        "compile is killed and the request gets status 400 naming this flag.", minimum=0.001)
    grammar_compile_memory_mb: int = _opt(
        2048, "Memory (MiB) one constraint may take to compile, in the compile worker process; "
        "past it the compile fails and the request gets status 400 naming this flag.",
        minimum=16)
    speculative_algorithm: str | None = _opt(
        None, "Speculative decoding algorithm by registered name (SGLang's: NGRAM, "
        "STANDALONE, EAGLE, EAGLE3); default: none. Greedy and sampled outputs are those of decoding "
        "without it (docs/speculative.md).", registry="speculative")
    speculative_num_draft_tokens: int | None = _opt(
        None, "Tokens verified per request and step, the request's last token included (so "
        "this minus one are drafted); default: the algorithm's.", minimum=2)
    speculative_num_steps: int | None = _opt(
        None, "Draft-model forwards per step (STANDALONE, EAGLE, EAGLE3); default: "
        "num_draft_tokens - 1. "
        "NGRAM, which has no draft model, refuses it.", minimum=1)
    speculative_eagle_topk: int | None = _opt(
        None, "Branching of EAGLE's beam search per step: above 1, EAGLE and EAGLE3 draft "
        "token trees; default 1 (a chain). STANDALONE refuses it (NGRAM's trees: "
        "--speculative-ngram-max-bfs-breadth).", minimum=1)
    speculative_draft_model_path: str | None = _opt(
        None, "Draft model of STANDALONE (a folder or .gguf file sgl can load that shares the "
        "target's tokenizer), or the draft head of EAGLE / EAGLE3 (its Hugging Face folder).")
    speculative_token_map: str | None = _opt(
        None, "EAGLE's hot vocabulary (SGLang's flag, FR-Spec): a .pt file holding the token ids "
        "the head may draft; its LM head shrinks to those rows. EAGLE only.")
    speculative_disable_by_batch_size: int | None = _opt(
        None, "Run steps with more decoding requests than this without speculation (the "
        "verification then costs more than it saves); default: the algorithm's.", minimum=1)
    tp_size: int = _opt(
        1, "Tensor-parallel ranks: the model's heads, MLP and vocabulary are split over this "
        "many scheduler processes (torch.distributed: gloo on CPU), spread over --nnodes "
        "machines; each rank on this machine takes its share of the CPU cores. Needs the "
        "sgl-parallel-tp plugin.", minimum=1)
    nnodes: int = _opt(
        1, "Machines the --tp-size ranks run on; start `sgl serve` on each with the same "
        "settings, --node-rank and --dist-init-addr. Node 0 serves HTTP.", minimum=1)
    node_rank: int = _opt(
        0, "This machine's index among --nnodes (0 serves HTTP; the others only run their "
        "ranks).", minimum=0)
    dist_init_addr: str | None = _opt(
        None, "HOST:PORT where the ranks of all nodes meet (node 0's address and a free port); "
        "required with --nnodes above 1. Default on one machine: a free loopback port.")
    dp_size: int = _opt(
        1, "Data-parallel replicas: this many whole schedulers (each with the whole model and "
        "its own KV cache and prefix cache) behind one server, each on its share of the cores; "
        "--load-balance-method picks one per request. Needs the sgl-parallel-dp plugin.",
        minimum=1)
    dist_timeout: float = _opt(
        600.0, "Seconds the ranks wait for each other: at start-up for every node to join "
        "(--dist-init-addr), and in each collective of a forward.", minimum=1)
    frontends: tuple[str, ...] = _opt(
        (), "HTTP frontends to mount (repeatable); default: every installed one.",
        registry="frontends", flags=("--frontend",))
    log_level: Literal["debug", "info", "warning", "error"] = _opt("info", "Log level.")
    api_key: str | None = _opt(
        None, "Require 'Authorization: Bearer <key>' on every route except /health and "
        "/metrics (exactly those two); default: no key.", secret=True)
    max_request_body_size: int = _opt(
        32 * 2**20, "Largest HTTP request body in bytes; larger ones get status 413.", minimum=1)
    request_timeout: float | None = _opt(
        None, "Seconds a request may take from its arrival to its last token; then it is "
        "aborted (its KV memory freed) and the client gets status 504 naming this flag (a "
        "stream: an error event). Default: no limit.", minimum=0.001)
    max_logprobs: int = _opt(
        20, "Most logprobs a request may ask for per position (vLLM's flag): top_logprobs_num "
        "and token_ids_logprob's ids; more is a 400. Each is one entry per position of the "
        "output (and of the prompt from logprob_start_len).", minimum=0)
    graceful_shutdown_timeout: float = _opt(
        30.0, "Seconds SIGTERM waits for in-flight requests before aborting them.", minimum=0)
    load_plugins: tuple[str, ...] = _opt(
        (), "Load a plugin by entry-point name, module or .py file (repeatable); no:NAME disables.",
        flags=("--plugin",))
    disable_plugins: tuple[str, ...] = _opt(
        (), "Leave out an installed plugin by name (repeatable).", flags=("--disable-plugin",))
    # not options: filled by load_settings
    plugin_settings: Mapping[str, Any] = field(default_factory=dict, compare=False,
                                               metadata={"internal": True})
    sources: Mapping[str, str] = field(default_factory=dict, compare=False,
                                       metadata={"internal": True})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (picklable without any plugin module), for child processes and JSON."""
        out = {f.name: getattr(self, f.name) for f in option_fields(type(self))}
        out["plugins"] = {pid: dataclasses.asdict(obj) for pid, obj in self.plugin_settings.items()}
        return out

    def options(self) -> dict[str, tuple[Any, dataclasses.Field[Any]]]:
        """Every option by its top-level name (a core field's name, a plugin option's
        ``<id>_<field>`` or declared name): the object holding it and its field."""
        found: dict[str, tuple[Any, dataclasses.Field[Any]]] = {
            f.name: (self, f) for f in option_fields(type(self))}
        for pid, obj in self.plugin_settings.items():
            found.update({plugin_option_name(pid, f): (obj, f) for f in option_fields(type(obj))})
        return found

    def source(self, key: str) -> str:
        """Where option ``key`` (a top-level name, see :meth:`options`) got its value:
        ``default``, ``flag --port``, ``env SGL_PORT``, ``file sgl.toml``, ..."""
        return self.sources.get(self._source_key(key), "default")

    def is_set(self, key: str) -> bool:
        """Whether option ``key`` was given anywhere (not left at its default)."""
        return self.source(key) != "default"

    def invalid(self, key: str, message: str) -> ConfigError:
        """The error for option ``key`` (a top-level name): its value, where it came from,
        and ``message``; what plugins raise from ``sgl_check_settings``."""
        owner, f = self.options()[key]
        return ConfigError(f"{self.source(key)}: invalid value {getattr(owner, f.name)!r} for "
                           f"{key!r}: {message}")

    def _source_key(self, key: str) -> str:
        for pid, obj in self.plugin_settings.items():
            for f in option_fields(type(obj)):
                if plugin_option_name(pid, f) == key:
                    return f"plugins.{pid}.{f.name}"
        return key


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The user-settable fields of a settings dataclass."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def env_var_name(name: str) -> str:
    """The environment variable of the option of top-level name ``name``: ``SGL_PORT``."""
    return f"SGL_{name}".upper().replace("-", "_").replace(".", "_")


def plugin_option_name(plugin_id: str, f: dataclasses.Field[Any]) -> str:
    """A plugin option's top-level name: the field's ``name`` metadata (SGLang's names, such as
    ``disaggregation_mode``), else ``<plugin id>_<field>``. Its flag, environment variable,
    top-level config key and ``/get_server_info`` key derive from it."""
    return f.metadata.get("name") or f"{plugin_id}_{f.name}".replace("-", "_").replace(".", "_")


def option_flags(f: dataclasses.Field[Any], name: str) -> tuple[str, ...]:
    """The command-line flags of the option of top-level name ``name``: the field's ``flags``
    metadata, else ``--`` and the name with ``-`` for ``_``."""
    return tuple(f.metadata.get("flags") or (f"--{name.replace('_', '-')}",))


def plugin_options(plugin_classes: Mapping[str, type]
                   ) -> dict[str, tuple[str, dataclasses.Field[Any]]]:
    """Every plugin option by its top-level name: ``(plugin id, field)``.

    :raises ConfigError: when two plugins, or a plugin and the core, use one name.
    """
    core = {f.name for f in option_fields(ServerSettings)}
    found: dict[str, tuple[str, dataclasses.Field[Any]]] = {}
    for pid, cls in plugin_classes.items():
        for f in option_fields(cls):
            name = plugin_option_name(pid, f)
            if name in core or name in found:
                other = "the core" if name in core else f"plugin {found[name][0]!r}"
                raise ConfigError(f"plugin {pid!r}: its option {f.name!r} is named {name!r}, "
                                  f"which {other} already uses")
            found[name] = (pid, f)
    return found


def _type_hints(cls: type) -> dict[str, Any]:
    import sys

    module = sys.modules.get(cls.__module__)
    return typing.get_type_hints(cls, globalns=vars(module) if module else None)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in args) + " (or null)"
    if origin is tuple:
        return "a list of strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp))


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


_NULLS = ("", "none", "null")


def coerce_value(value: Any, tp: Any, *, key: str, source: str) -> Any:
    """Convert ``value`` (from a file, an env string or click) to type ``tp`` or raise
    :class:`ConfigError` naming ``key``, the value and ``source``.

    pydantic validates: leniently for strings (an environment variable's ``"8"`` or ``"yes"``),
    strictly for typed values (a YAML ``true`` is no integer). An optional setting takes
    ``""``, ``none`` or ``null`` as None; a list setting takes a comma-separated string."""
    given = value
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    base = args[0] if optional and args else tp
    if optional and (value is None or isinstance(value, str) and value.strip().lower() in _NULLS):
        return None
    if typing.get_origin(base) is tuple:
        if isinstance(value, str):
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        elif isinstance(value, list):
            value = tuple(value)
    elif isinstance(value, str) and base is not str:
        value = value.strip()
    try:
        return _adapter(tp).validate_python(value, strict=not isinstance(value, str))
    except ValidationError:
        raise ConfigError(f"{source}: invalid value {given!r} for {key!r}: expected "
                          f"{_describe(tp)}") from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) config file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    text = p.read_text()
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml", ".json"):
            import yaml

            data = yaml.safe_load(text) if text.strip() else {}
        else:
            raise ConfigError(f"{p}: unsupported config format {suffix!r}; "
                              "use .yaml, .yml, .json or .toml")
    except ConfigError:
        raise
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError
        raise ConfigError(f"{p}: cannot parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of settings at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _unknown(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint} (valid keys: {', '.join(valid)})")


def _resolve(cls: type, *, cli: Mapping[str, Any], cli_flags: Mapping[str, str],
             env: Mapping[str, str], file_data: Mapping[str, Any], file_label: str,
             plugin_id: str | None, cli_source: str | None = None
             ) -> tuple[dict[str, Any], dict[str, str]]:
    hints = _type_hints(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in option_fields(cls):
        tp = hints[f.name]
        layers: list[tuple[Any, str]] = []
        if f.name in file_data:
            layers.append((file_data[f.name], f"file {file_label}"))
        key = f.name if plugin_id is None else plugin_option_name(plugin_id, f)
        var = env_var_name(key)
        if var in env:
            layers.append((env[var], f"env {var}"))
        if f.name in cli:
            layers.append((cli[f.name], cli_source or f"flag {cli_flags.get(f.name, f.name)}"))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        values[f.name], sources[f.name] = default, "default"
        for raw, source in layers:
            value = coerce_value(raw, tp, key=key, source=source)
            if f.name in ADDITIVE_FIELDS and sources[f.name] != "default":
                value = tuple(dict.fromkeys(values[f.name] + value))
                source = f"{sources[f.name]} + {source}"
            values[f.name], sources[f.name] = value, source
    return values, sources


def load_settings(
    *,
    cli: Mapping[str, Any] | None = None,
    cli_flags: Mapping[str, str] | None = None,
    plugin_cli: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    file_data: Mapping[str, Any] | None = None,
    plugin_classes: Mapping[str, type] | None = None,
    cli_source: str | None = None,
) -> ServerSettings:
    """Merge defaults < config file < environment < command line into one :class:`ServerSettings`.

    :param cli: server options given on the command line (only those the user typed).
    :param cli_flags: the flag each CLI value came from, for messages (``{"port": "--port"}``).
    :param plugin_cli: per plugin id, its options given on the command line.
    :param env: environment (default ``os.environ``).
    :param config_file: path of a YAML/TOML file, read with :func:`read_config_file`.
    :param file_data: already-parsed file contents (instead of ``config_file``).
    :param plugin_classes: plugin id -> settings dataclass, from ``sgl_add_config``.
    :param cli_source: label of the ``cli`` values in ``sources`` and messages when they do not
        come from flags (``"Engine(...)"`` for keyword arguments of :class:`sgl.Engine`).
    """
    env = os.environ if env is None else env
    plugin_classes = plugin_classes or {}
    label = str(config_file) if config_file else "<config>"
    if file_data is None:
        file_data = read_config_file(config_file) if config_file else {}
    file_data = dict(file_data)
    plugin_tables = file_data.pop("plugins", {}) or {}
    if not isinstance(plugin_tables, dict):
        raise ConfigError(f"{label}: 'plugins' must be a table of plugin id -> options")
    named = plugin_options(plugin_classes)
    valid = [f.name for f in option_fields(ServerSettings)] + list(named) + ["plugins"]
    for key in list(file_data):
        if key not in valid:
            raise _unknown(key, valid, label)
        if key in named:  # a plugin option at the top level, by its flat name
            pid, f = named[key]
            table = plugin_tables.setdefault(pid, {})
            if not isinstance(table, dict) or f.name in table:
                raise ConfigError(f"{label}: {key!r} and 'plugins.{pid}.{f.name}' are one "
                                  "option; give it once")
            table[f.name] = file_data.pop(key)
    for pid, table in plugin_tables.items():
        if pid not in plugin_classes:
            known = ", ".join(sorted(plugin_classes)) or "no loaded plugin has options"
            raise ConfigError(f"{label}: unknown plugin {pid!r} in 'plugins' ({known})")
        if not isinstance(table, dict):
            raise ConfigError(f"{label}: 'plugins.{pid}' must be a table of options")
        fields = [f.name for f in option_fields(plugin_classes[pid])]
        for key in table:
            if str(key).replace("-", "_") not in fields:
                raise _unknown(str(key), fields, f"{label} [plugins.{pid}]")

    values, sources = _resolve(ServerSettings, cli=cli or {}, cli_flags=cli_flags or {}, env=env,
                               file_data=file_data, file_label=label, plugin_id=None,
                               cli_source=cli_source)
    plugin_settings: dict[str, Any] = {}
    for pid, cls in plugin_classes.items():
        table = {str(k).replace("-", "_"): v for k, v in (plugin_tables.get(pid) or {}).items()}
        pvalues, psources = _resolve(
            cls, cli=(plugin_cli or {}).get(pid, {}),
            cli_flags={f.name: option_flags(f, name)[0] for name, (owner, f) in named.items()
                       if owner == pid},
            env=env, file_data=table, file_label=f"{label} [plugins.{pid}]", plugin_id=pid,
            cli_source=cli_source)
        try:
            plugin_settings[pid] = cls(**pvalues)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"plugin {pid!r} settings: {exc}") from exc
        sources.update({f"plugins.{pid}.{k}": v for k, v in psources.items()})
    settings = ServerSettings(**values, plugin_settings=plugin_settings, sources=sources)
    _check_ranges(settings)
    return settings


def split_host_port(address: str) -> tuple[str, int] | None:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) as ``(host, port)``, else None."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def cores_per_rank(s: ServerSettings) -> int:
    """The CPU cores each scheduler process of this machine gets: the usable cores shared out
    among its tensor-parallel ranks (at least one)."""
    return max(1, usable_cores() // (s.tp_size // s.nnodes * s.dp_size))


def _check_ranges(s: ServerSettings) -> None:
    """The bounds of the settings: a field's ``minimum`` metadata, and the rules below."""
    def fail(key: str, msg: str) -> None:
        raise s.invalid(key, msg)

    for key, (owner, f) in s.options().items():
        value, low = getattr(owner, f.name), f.metadata.get("minimum")
        if low is not None and value is not None and value < low:
            raise s.invalid(key, f"expected at least {low}")
    if not 0 < s.port < 65536:
        fail("port", "expected 1-65535")
    problem = check_thread_counts(s.num_threads, s.kernel_threads, cores_per_rank(s))
    if problem:
        fail("kernel_threads" if s.kernel_threads is not None else "num_threads", problem)
    if s.mem_fraction_static is not None and not 0 < s.mem_fraction_static <= 1:
        fail("mem_fraction_static", "expected a fraction in (0, 1]")
    _check_device(s, fail)
    if s.chunked_prefill_size != -1 and s.chunked_prefill_size < 1:
        fail("chunked_prefill_size", "expected -1 (off) or at least 1")
    if s.speculative_algorithm is None:
        for key in ("speculative_num_draft_tokens", "speculative_num_steps",
                    "speculative_eagle_topk", "speculative_draft_model_path",
                    "speculative_token_map", "speculative_disable_by_batch_size"):
            if getattr(s, key) is not None:
                fail(key, "it needs --speculative-algorithm (speculative decoding is off)")
    if s.node_rank >= s.nnodes:
        fail("node_rank", f"expected a node index below --nnodes ({s.nnodes})")
    if s.tp_size % s.nnodes:
        fail("tp_size", f"expected a multiple of --nnodes ({s.nnodes}): every node runs the "
             "same number of ranks")
    if s.nnodes > 1 and s.dist_init_addr is None:
        fail("nnodes", "more than one node needs --dist-init-addr HOST:PORT (node 0's address)")
    if s.dist_init_addr is not None and split_host_port(s.dist_init_addr) is None:
        fail("dist_init_addr", "expected HOST:PORT with a port in 1-65535")
    if s.api_key is not None and not s.api_key.strip():
        fail("api_key", "expected a non-empty key")
    if s.chat_template and not Path(s.chat_template).expanduser().is_file() \
            and "{{" not in s.chat_template and "{%" not in s.chat_template:
        fail("chat_template", "no such file (expected a Jinja template file)")


def _check_device(s: ServerSettings, fail: Any) -> None:
    """The device and the flags that apply to one device only. torch is imported only when
    the answer depends on whether it sees a GPU."""
    gpu_flags = [key for key in ("disable_cuda_graph", "cuda_graph_max_bs")
                 if s.is_set(key)]
    if s.device == "cpu" or not (s.device == "cuda" or gpu_flags
                                   or s.enable_deterministic_inference):
        device = s.device
    else:
        from sgl.devices import resolve_device

        try:
            device = resolve_device(s.device).type
        except ValueError as exc:
            fail("device", str(exc))
    if s.enable_deterministic_inference:
        if device != "cpu":
            fail("enable_deterministic_inference", f"sgl's batch-invariant kernels are CPU "
                 f"kernels; on {device} the attention backends' sums depend on the batch")
    if device == "cpu":
        for key in gpu_flags:
            fail(key, "CUDA graphs need --device cuda (this server runs on the CPU, where "
                 "--disable-cpu-graph turns off the replayed decode forwards)")
    elif device == "cuda":
        if s.is_set("disable_cpu_graph"):
            fail("disable_cpu_graph", "it applies to --device cpu; on a GPU use "
                 "--disable-cuda-graph")
        if s.is_set("cpu_graph_max_bs"):
            fail("cpu_graph_max_bs", "it applies to --device cpu; on a GPU use "
                 "--cuda-graph-max-bs")


def settings_from_dict(data: Mapping[str, Any], plugin_classes: Mapping[str, type]) -> ServerSettings:
    """Rebuild settings from :meth:`ServerSettings.to_dict` (in a child process)."""
    data = dict(data)
    tables = data.pop("plugins", {})
    plugin_settings = {pid: plugin_classes[pid](**vals) for pid, vals in tables.items()
                       if pid in plugin_classes}
    return ServerSettings(**data, plugin_settings=plugin_settings)


def public_settings(settings: ServerSettings) -> dict[str, Any]:
    """The settings as ``/get_server_info`` shows them (SGLang's shape: every option at the top
    level by its name, a plugin's also in ``plugins``), secrets as ``<hidden>``."""
    out = settings.to_dict()
    for key, (owner, f) in settings.options().items():
        value = getattr(owner, f.name)
        if f.metadata.get("secret") and value is not None:
            value = "<hidden>"
        out[key] = value
    out["plugins"] = {pid: {f.name: out[plugin_option_name(pid, f)]
                            for f in option_fields(type(obj))}
                      for pid, obj in settings.plugin_settings.items()}
    return out


#: what ``sgl config show`` prints instead of a setting marked ``secret`` that is set
SECRET_MASK = "<set>"


def _shown(f: Any, value: Any) -> Any:
    """``value`` as ``sgl config show`` prints it: a ``secret`` setting's value is not shown
    (terminals, CI logs and shared screens keep what they print)."""
    return SECRET_MASK if f.metadata.get("secret") and value is not None else value


def format_settings(settings: ServerSettings, as_json: bool = False) -> str:
    """The effective settings and the source of each, for ``sgl config show``."""
    rows: list[tuple[str, Any, str]] = []
    for f in option_fields(ServerSettings):
        rows.append((f.name, _shown(f, getattr(settings, f.name)),
                     settings.sources.get(f.name, "default")))
    for pid, obj in settings.plugin_settings.items():
        for f in option_fields(type(obj)):
            key = f"plugins.{pid}.{f.name}"
            rows.append((key, _shown(f, getattr(obj, f.name)), settings.sources.get(key, "default")))
    if as_json:
        return json.dumps({k: {"value": list(v) if isinstance(v, tuple) else v, "source": s}
                           for k, v, s in rows}, indent=2)
    width = max(len(k) for k, _, _ in rows)
    vwidth = max(len(json.dumps(list(v) if isinstance(v, tuple) else v)) for _, v, _ in rows)
    return "\n".join(
        f"{k:<{width}}  {json.dumps(list(v) if isinstance(v, tuple) else v):<{vwidth}}  ({s})"
        for k, v, s in rows)
