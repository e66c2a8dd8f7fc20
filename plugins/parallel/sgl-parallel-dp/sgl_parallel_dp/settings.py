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
    if settings.is_set("load_balance_method") and settings.dp_size == 1:
        raise settings.invalid("load_balance_method", "it needs --dp-size above 1 (one "
                               "replica takes every request)")
