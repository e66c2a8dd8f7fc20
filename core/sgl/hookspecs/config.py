"""Configuration options that plugins contribute."""

from __future__ import annotations

from sgl.hookspecs._marker import hookspec


@hookspec
def sgl_add_config() -> type | None:
    """Declare the plugin's settings as one frozen dataclass.

    Each field becomes a command-line flag ``--<plugin-id>-<field>`` of ``sgl serve`` (listed
    under the plugin's own heading in ``--help``), an environment variable
    ``SGL_<PLUGIN_ID>_<FIELD>`` and a key of the ``[plugins.<plugin-id>]`` table of a config file.
    Precedence is flag > environment > file > the field's default. The field's
    ``metadata={"help": "..."}`` is the help text. Supported field types: ``str``, ``int``,
    ``float``, ``bool``, their ``X | None`` forms, ``tuple[str, ...]`` and ``Literal[...]``.

    The validated instance is available as ``settings.plugin_settings["<plugin-id>"]``.

    :return: a dataclass type, or None when the plugin has no options.

    Runs in: the process running the ``sgl`` command, when the command line is built and again
    when settings are resolved; every scheduler process, to rebuild the settings it is handed.
    Must return the same class each time.

    .. versionadded:: 0.1
    """
