"""Configuration options that plugins contribute."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.config import ServerSettings


@hookspec
def sgl_add_config() -> type | None:
    """Declare the plugin's settings as one frozen dataclass.

    Each field is an option named ``<plugin-id>_<field>`` at the top level: a command-line flag
    ``--<plugin-id>-<field>`` of ``sgl serve`` (listed under the plugin's own heading in
    ``--help``), an environment variable ``SGL_<PLUGIN_ID>_<FIELD>``, a key of a config file
    (at the top level, or ``<field>`` in its ``[plugins.<plugin-id>]`` table), a keyword of
    :class:`sgl.Engine` and a key of ``/get_server_info``. Precedence is flag > environment >
    file > the field's default.

    The field's metadata says more: ``help`` (the help text), ``name`` (another top-level name,
    for the flag names SGLang uses: ``name="load_balance_method"`` on a plugin ``parallel-dp``),
    ``flags`` (other flags), ``minimum`` (checked like the core's), ``registry`` (the registry
    whose names ``--help`` lists; the plugin checks the value in :func:`sgl_check_settings`) and
    ``secret`` (never printed). Supported field types: ``str``, ``int``, ``float``, ``bool``,
    their ``X | None`` forms, ``tuple[str, ...]`` and ``Literal[...]``. A name the core or
    another plugin uses is an error.

    The validated instance is available as ``settings.plugin_settings["<plugin-id>"]``.

    :return: a dataclass type, or None when the plugin has no options.

    Runs in: the process running the ``sgl`` command, when the command line is built and again
    when settings are resolved; every scheduler process, to rebuild the settings it is handed.
    Must return the same class each time.

    .. versionadded:: 0.1
    """


@hookspec
def sgl_check_settings(settings: ServerSettings, registries: Any) -> None:
    """Check the plugin's options against each other, the core's settings and what is
    registered, before anything starts.

    Raise ``settings.invalid(name, message)`` (a :class:`sgl.config.ConfigError`, which names
    the option, its value and where it came from) for a setting this plugin cannot serve:
    ``raise settings.invalid("disaggregation_bootstrap_port", "it is also the HTTP --port")``.
    ``settings.is_set(name)`` says whether an option was given at all.

    :param settings: the resolved settings, the plugins' options in ``plugin_settings``.
    :param registries: every registry (``sgl.plugins.Registries``), to check a name the
        plugin's options give.
    :return: nothing.

    Runs in: the process running ``sgl serve`` and the process of an :class:`sgl.Engine`, before
    the scheduler starts (``sgl config show`` does not run it).

    .. versionadded:: 0.2
    """
