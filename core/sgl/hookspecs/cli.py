"""Commands that plugins add to the ``sgl`` command line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    import click


@hookspec
def sgl_register_commands(cli: click.Group) -> None:
    """Add sub-commands (for example ``sgl router`` or ``sgl bench``) to the ``sgl`` group.

    :param cli: the top-level :class:`click.Group`; call ``cli.add_command(cmd)`` or decorate
        with ``@cli.command()``. Taking a name that the core or another plugin already uses is an
        error naming both.
    :return: nothing.

    Runs in: the process running the ``sgl`` command, before the command line is parsed.

    .. versionadded:: 0.1
    """
