"""What frontends get to work with: settings, the tokenizer manager and the model's facts."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.launch import SchedulerHandle
    from sgl.engine.messages import SchedulerInfo
    from sgl.plugins import SglPluginManager
    from sgl.server.tokenizer_manager import TokenizerManager

__all__ = ["ServerContext"]


@dataclass
class ServerContext:
    """Handed to every frontend's ``make_router(server)``."""

    settings: ServerSettings
    plugin_manager: SglPluginManager
    scheduler: SchedulerHandle
    info: SchedulerInfo
    tokenizer_manager: TokenizerManager
    exit_code: int = 0
    uvicorn_server: Any = field(default=None, repr=False)

    @functools.cached_property
    def model_name(self) -> str:
        """The name clients use in ``"model"`` fields (every streamed chunk carries it, so it is
        worked out once: the settings and the model path do not change while serving)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        path = Path(self.info.model_path)
        return path.stem if path.suffix == ".gguf" else path.name

    @property
    def healthy(self) -> bool:
        return self.scheduler.alive and self.tokenizer_manager.dead_reason is None
