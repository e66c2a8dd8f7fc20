"""The option of data parallelism beyond ``--dp-size`` (a core setting, since the core
shares the cores out): SGLang's ``--load-balance-method``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from sgl.config import ServerSettings

PLUGIN_ID = "parallel-dp"


@dataclass(frozen=True)
class DataParallelSettings:
    load_balance_method: Literal["round_robin", "shortest_queue", "cache_aware"] | None = field(
        default=None, metadata={
            "name": "load_balance_method",
            "help": "How --dp-size replicas share the requests: round_robin (default), "
                    "shortest_queue (fewest requests in flight) or cache_aware (the replica "
                    "whose cache likely holds the longest prefix of the prompt, else the least "
                    "loaded). A session's requests stay on one replica."})


def load_balance_method(settings: ServerSettings) -> str:
    opts = settings.plugin_settings.get(PLUGIN_ID)
    return (opts.load_balance_method if opts is not None else None) or "round_robin"


def check(settings: ServerSettings) -> None:
    """``--load-balance-method`` needs replicas; replicas are of one rank on one machine."""
    if settings.is_set("load_balance_method") and settings.dp_size == 1:
        raise settings.invalid("load_balance_method", "it needs --dp-size above 1 (one "
                               "replica takes every request)")
    if settings.dp_size > 1 and (settings.tp_size > 1 or settings.nnodes > 1):
        raise settings.invalid("dp_size", f"with --tp-size {settings.tp_size} and --nnodes "
                               f"{settings.nnodes}: data parallelism runs replicas of one rank "
                               "each on one machine; use one of the two, or SGLang's router "
                               "(`sgl router`) in front of several servers")
