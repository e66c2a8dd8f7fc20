"""Start-up and shutdown notifications."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.config import ServerSettings


@hookspec
def sgl_on_startup(settings: ServerSettings, process: str, context: Any) -> None:
    """Called once a process of sgl has finished starting.

    :param settings: the effective, validated server settings.
    :param process: which process is starting: ``"server"`` (the HTTP server, once the scheduler
        reported ready and the app is built, before the port is opened), ``"scheduler"`` (each
        scheduler process, once the model is loaded and before the first batch runs) or
        ``"engine"`` (the Python process of an in-process :class:`sgl.Engine`, once its
        scheduler is ready).
    :param context: the process's runtime object: the :class:`sgl.server.context.ServerContext`
        in the server process, the :class:`sgl.engine.scheduler.Scheduler` in a scheduler
        process, the :class:`sgl.Engine` for ``"engine"``.
    :return: nothing. An exception aborts start-up; the error names the plugin.

    Runs in: the server process (or the process of an :class:`sgl.Engine`) and every scheduler
    process.

    .. versionadded:: 0.1
    """


@hookspec
def sgl_on_shutdown(settings: ServerSettings, process: str) -> None:
    """Called once when a process of sgl shuts down cleanly.

    :param settings: the effective server settings.
    :param process: ``"server"``, ``"scheduler"`` or ``"engine"``, as for
        :func:`sgl_on_startup`.
    :return: nothing. Exceptions are logged and do not stop the shutdown of other plugins.

    Runs in: the server process (or the process of an :class:`sgl.Engine`) and every scheduler
    process.

    .. versionadded:: 0.1
    """
