"""The options of disaggregation (SGLang's ``--disaggregation-*`` flags) and their checks."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.plugins import Registries

#: the plugin's id: its options are named ``disaggregation_<field>`` (SGLang's flags)
PLUGIN_ID = "disaggregation"


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class DisaggregationSettings:
    """``--disaggregation-mode`` and the options of the link between the two servers."""

    mode: Literal["null", "prefill", "decode"] = _opt(
        "null", "Prefill/decode disaggregation (SGLang's flag): prefill runs prompts only and "
        "hands their KV to a decode server, decode takes it over and generates; null: both "
        "here. Put SGLang's router in PD mode in front (sgl router --pd-disaggregation). "
        "docs/disaggregation.md.")
    transfer_backend: str = _opt(
        "tcp", "What moves the KV pages from the prefill to the decode server, by registered "
        "name: tcp (sockets, no extra dependency), mooncake (Mooncake's transfer engine) or "
        "fake (moves nothing: warm-up and tests only). Both servers must use the same one.",
        registry="transfer")
    bootstrap_port: int = _opt(
        8998, "Port of the prefill server's bootstrap server, where decode servers learn how "
        "to reach it (the PORT after --prefill URL in the router's PD mode).")
    timeout: float = _opt(
        300.0, "Seconds a disaggregated request waits for its peer: on the prefill side for "
        "the decode server to ask for the KV, on the decode side for the KV to arrive, and "
        "for one transfer; then it ends with an error and its KV memory is freed.",
        minimum=0.1)
    prefill_hosts: tuple[str, ...] = _opt(
        (), "A prefill server a decode server may take KV from, by the bootstrap_host requests "
        "name (repeatable): a host name, an IP address, a network such as 10.0.0.0/24, or * "
        "for any. A request naming another host is refused with status 400, before anything "
        "is fetched from it. Default: this machine's loopback addresses only.",
        flags=("--disaggregation-prefill-host",))
    secret: str | None = _opt(
        None, "A secret shared by the prefill and decode servers: their link messages carry an "
        "HMAC-SHA256 of it, messages without a valid one are refused, and a decode server "
        "shares KV from prefill servers in its prefix cache only with it (without, that KV "
        "serves its own request only). Give it through SGL_DISAGGREGATION_SECRET rather than "
        "the command line.", secret=True)


def options_of(settings: ServerSettings) -> DisaggregationSettings:
    """This plugin's options in ``settings`` (the defaults when the plugin was not loaded
    while they were resolved)."""
    return settings.plugin_settings.get(PLUGIN_ID) or DisaggregationSettings()


def check(settings: ServerSettings, registries: Registries) -> None:
    """The rules of the options: what needs a mode, what each mode refuses, the backend."""
    opts = options_of(settings)
    if opts.mode == "null":
        for name in ("transfer_backend", "bootstrap_port", "timeout", "prefill_hosts", "secret"):
            if settings.is_set(f"disaggregation_{name}"):
                raise settings.invalid(f"disaggregation_{name}",
                                       "it needs --disaggregation-mode prefill or decode")
        return
    if not 0 < opts.bootstrap_port < 65536:
        raise settings.invalid("disaggregation_bootstrap_port", "expected 1-65535")
    if opts.mode == "prefill" and opts.bootstrap_port == settings.port:
        raise settings.invalid("disaggregation_bootstrap_port", "it is also the HTTP --port; "
                               "give each its own port")
    for key, what in (("tp_size", "tensor parallelism"), ("dp_size", "data parallelism")):
        if getattr(settings, key) > 1:
            raise settings.invalid(key, f"{what} with --disaggregation-mode is not built yet; "
                                   "run one scheduler per prefill or decode server")
    if settings.speculative_algorithm is not None:
        raise settings.invalid("speculative_algorithm", "speculative decoding with "
                               "--disaggregation-mode is not built yet (the draft model's KV is "
                               "not transferred)")
    if opts.prefill_hosts and opts.mode != "decode":
        raise settings.invalid("disaggregation_prefill_hosts", "only a decode server takes KV "
                               "from prefill servers (--disaggregation-mode decode)")
    for host in opts.prefill_hosts:
        if (why := prefill_host_error(host)) is not None:
            raise settings.invalid("disaggregation_prefill_hosts", why)
    if opts.secret is not None and len(opts.secret) < 16:
        raise settings.invalid("disaggregation_secret", "expected at least 16 characters (for "
                               "example the output of: python -c 'import secrets; "
                               "print(secrets.token_hex(16))')")
    _check_backend(settings, opts.transfer_backend, registries)


def _check_backend(settings: ServerSettings, name: str, registries: Registries) -> None:
    from sgl.config import ConfigError

    if name not in registries.transfer:
        raise settings.invalid("disaggregation_transfer_backend", "no installed plugin provides "
                               "that KV transfer backend; available: "
                               f"{', '.join(registries.transfer.names()) or 'none installed'}")
    entry = registries.transfer.entry(name)
    try:
        backend = entry.load()
    except Exception as exc:
        raise ConfigError(f"--disaggregation-transfer-backend {name}: plugin {entry.owner!r} "
                          f"registered it as {entry.target!r}, which failed to import: "
                          f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(backend, type) and callable(getattr(backend, "write", None))):
        raise ConfigError(f"--disaggregation-transfer-backend {name}: plugin {entry.owner!r} "
                          f"registered {backend!r}, which is not a subclass of "
                          "sgl.transfer.BaseKVTransfer")


_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62})"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")


def prefill_host_error(entry: str) -> str | None:
    """Why ``entry`` is not a ``--disaggregation-prefill-host`` (None: it is one): ``*``, an
    IP address, a network in CIDR notation, or a host name."""
    if entry == "*" or _network(entry) is not None or _HOST_NAME.fullmatch(entry):
        return None
    return f"{entry!r} is not a host name, an IP address, a network such as 10.0.0.0/24, or *"


def _network(text: str) -> Any:
    try:
        return ipaddress.ip_network(text.removeprefix("[").removesuffix("]"), strict=False)
    except ValueError:
        return None


def prefill_host_allowed(host: str, entries: tuple[str, ...]) -> bool:
    """Whether a request's ``bootstrap_host`` names a prefill server ``entries`` allow (no
    entries: the loopback addresses and ``localhost``). Names are compared as written, never
    resolved: resolving a client's name would let it point anywhere."""
    try:
        address: Any = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        address = None
    if not entries:
        return host == "localhost" or (address is not None and address.is_loopback)
    for entry in entries:
        network = _network(entry)
        if entry == "*" or (network is None and entry.lower() == host.lower()):
            return True
        if network is not None and address is not None and address in network:
            return True
    return False
