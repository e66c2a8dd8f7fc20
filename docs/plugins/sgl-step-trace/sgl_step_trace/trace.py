"""A scheduler extension that writes what each step ran, as one JSON object per line:

``{"step": 7, "time": 1733540000.1, "batch": [["rid", tokens], ...], "finished": ["rid"]}``

``batch`` lists the requests of the step's forward with the tokens each ran (a prompt chunk,
or one decode token), ``finished`` the requests whose memory was freed in the step (finished
or retracted). Steps without a forward or a finish are not written.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from sgl.engine.extension import SchedulerExtension

if TYPE_CHECKING:
    import torch

    from sgl.config import ServerSettings
    from sgl.engine.extension import SchedulerView
    from sgl.engine.schedule_policy import ScheduledBatch
    from sgl.engine.sequence import Req


class StepTrace(SchedulerExtension):
    name = "step-trace"

    @classmethod
    def enabled(cls, settings: ServerSettings) -> bool:
        return settings.plugin_settings["step-trace"].path is not None

    def __init__(self, scheduler: SchedulerView) -> None:
        super().__init__(scheduler)
        path = scheduler.settings.plugin_settings["step-trace"].path
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.steps = 0
        self.tokens = 0
        self._batch: list[tuple[str, int]] = []
        self._finished: list[str] = []

    def batch_ran(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        self._batch += [(req.rid, n) for req, n in batch.items]

    def released(self, req: Req) -> None:
        self._finished.append(req.rid)

    def after_step(self) -> None:
        # released() of this step's finished requests comes after after_step(): they are
        # written with the next step's line, or at close
        self._write()

    def _write(self) -> None:
        if not (self._batch or self._finished):
            return
        self.steps += 1
        self.tokens += sum(n for _, n in self._batch)
        self.file.write(json.dumps({"step": self.steps, "time": time.time(),
                                    "batch": self._batch, "finished": self._finished}) + "\n")
        self._batch, self._finished = [], []

    def info(self) -> dict[str, Any]:
        return {"step_trace_steps": self.steps, "step_trace_tokens": self.tokens}

    def close(self) -> None:
        self._write()
        self.file.close()
