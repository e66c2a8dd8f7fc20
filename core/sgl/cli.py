"""The ``sgl`` command line.

Parsing happens in two phases, like pytest's: :func:`main` first pre-scans argv (and the config
file) for ``--plugin``, ``--disable-plugin`` and ``--config``, loads the plugins, and only then
builds the click commands, so that options and sub-commands contributed by plugins are real
click parameters with help text and validation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

import click
from click.core import ParameterSource

from sgl.config import (
    ConfigError,
    ServerSettings,
    _type_hints,
    coerce_value,
    env_var_name,
    format_settings,
    load_settings,
    option_fields,
    option_flags,
    plugin_options,
    read_config_file,
)
from sgl.plugins import PluginError, PluginSelection, SglPluginManager, create_plugin_manager
from sgl.parallel.select import parallel_strategy
from sgl.registry import DuplicateRegistrationError

__all__ = ["build_cli", "main"]

_SELECTION_FLAGS = {"--plugin": "load", "--disable-plugin": "disable", "--config": "config"}


class GroupedCommand(click.Command):
    """A command whose ``--help`` lists options under headings (server, then each plugin)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            exc.message += (" If it is a plugin's option, that plugin is not loaded: `sgl "
                            "plugins` lists the loaded ones and says why one is unavailable.")
            raise

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "sgl_group", "Options"), []).append(record)
        for title, rows in groups.items():
            with formatter.section(title):
                formatter.write_dl(rows)


def option_for_field(f: dataclasses.Field[Any], tp: Any, *, dest: str, flags: Sequence[str],
                     group: str, env: str | None = None,
                     choices: list[str] | None = None) -> click.Option:
    """The click option of a settings dataclass field of type ``tp``: a choice for a
    ``Literal``, repeatable for a tuple, ``--x/--no-x`` for a bool; its help is the field's,
    with the choices, the default and the environment variable (``env``, if any). The default
    is None, so that only what the command line gives is taken from it. ``group`` is the
    heading it is listed under in :class:`GroupedCommand`'s ``--help``."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if origin in (typing.Union, __import__("types").UnionType) and args else tp
    kwargs: dict[str, Any] = {"default": None}
    default = f.default if f.default is not dataclasses.MISSING else None
    help_text = f.metadata.get("help", "")
    if typing.get_origin(base) is typing.Literal:
        kwargs["type"] = click.Choice([str(a) for a in typing.get_args(base)])
    elif typing.get_origin(base) is tuple:
        kwargs.update(multiple=True, default=(), type=str)
    elif base is bool:
        flags = [f"{flags[0]}/--no-{flags[0][2:]}"]
    elif base in (int, float, str):
        kwargs["type"] = base
    if choices is not None:
        help_text += f" [choices: {', '.join(choices) or 'none installed'}]"
    if default not in (None, (), ""):
        help_text += f" [default: {', '.join(default) if isinstance(default, tuple) else default}]"
    if env is not None:
        help_text += f" [env: {env}]"
    option = click.Option(list(flags) + [dest], help=help_text, **kwargs)
    option.sgl_group = group  # type: ignore[attr-defined]
    return option


def settings_options(pm: SglPluginManager) -> list[click.Option]:
    """One click option per server setting and per field of every plugin's settings class."""
    options: list[click.Option] = [
        click.Option(["--config", "config_file"], type=click.Path(dir_okay=False),
                     help="YAML or TOML file of settings (flags and SGL_* env override it).")
    ]
    options[0].sgl_group = "Server options"  # type: ignore[attr-defined]
    hints = _type_hints(ServerSettings)
    for f in option_fields(ServerSettings):
        registry = f.metadata.get("registry")
        choices = _registry_names(pm, registry) if registry else None
        if choices is not None:
            choices = [*f.metadata.get("keywords", ()), *choices]
        options.append(option_for_field(f, hints[f.name], dest=f.name,
                                        flags=option_flags(f, f.name), group="Server options",
                                        env=env_var_name(f.name), choices=choices))
    classes = pm.config_classes()
    for name, (pid, f) in plugin_options(classes).items():
        registry = f.metadata.get("registry")
        choices = _registry_names(pm, registry) if registry else None
        options.append(option_for_field(f, _type_hints(classes[pid])[f.name],
                                        dest=f"plugin__{_ident(pid)}__{f.name}",
                                        flags=option_flags(f, name),
                                        group=f"Options of plugin {pid}",
                                        env=env_var_name(name), choices=choices))
    return options


def _registry_names(pm: SglPluginManager, registry: str) -> list[str] | None:
    """Names for ``--help``; None when the registries cannot be built (the error surfaces when
    a command needs them, so that ``sgl plugins`` still works to diagnose it)."""
    try:
        return getattr(pm.registries, registry).names()
    except (DuplicateRegistrationError, PluginError):
        return None


def _ident(plugin_id: str) -> str:
    """A plugin id as a Python identifier (click's parameter names): ``-`` and ``.`` become
    ``_``."""
    return plugin_id.replace("-", "_").replace(".", "_")


def settings_from_click(ctx: click.Context, pm: SglPluginManager) -> ServerSettings:
    """Turn the parsed options of ``serve``/``config show`` into validated settings."""
    cli: dict[str, Any] = {}
    flags: dict[str, str] = {}
    plugin_cli: dict[str, dict[str, Any]] = {}
    plugin_ids = {_ident(pid): pid for pid in pm.config_classes()}
    for param in ctx.command.params:
        name = param.name or ""
        if name == "config_file" or ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[name]
        if name.startswith("plugin__"):
            _, pid, key = name.split("__", 2)
            plugin_cli.setdefault(plugin_ids.get(pid, pid), {})[key] = value
        else:
            cli[name] = value
            flags[name] = param.opts[0].split("/")[0]
    return load_settings(cli=cli, cli_flags=flags, plugin_cli=plugin_cli,
                         config_file=ctx.params.get("config_file"),
                         plugin_classes=pm.config_classes())


def build_cli(pm: SglPluginManager) -> click.Group:
    """The ``sgl`` group with the core commands and every plugin's commands."""

    @click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
    @click.version_option(package_name="sgl", prog_name="sgl")
    def cli() -> None:
        """sgl: serve large language models, with every feature a plugin.

        Start with `sgl serve` (serves the bundled SmolLM2 on port 30000), then point any
        OpenAI client at http://127.0.0.1:30000/v1.
        """

    @cli.command(cls=GroupedCommand, context_settings={"show_default": False})
    @click.pass_context
    def serve(ctx: click.Context, **_: Any) -> None:
        """Start the HTTP server and the scheduler process that runs the model."""
        settings = _settings_or_exit(ctx, pm)
        from sgl.server.launch import run_server

        sys.exit(run_server(settings, pm))

    serve.params.extend(settings_options(pm))

    @cli.command("plugins")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
    @click.option("--plugin", "load_plugins", multiple=True, help="Also load this plugin.")
    @click.option("--disable-plugin", "disable_plugins", multiple=True, help="Leave out a plugin.")
    def plugins_cmd(as_json: bool, **_: Any) -> None:
        """List plugins: name, distribution, version, hooks and availability."""
        rows = [dataclasses.asdict(r) for r in pm.records.values()]
        try:  # report clashes between plugins, but still list them
            pm.registries  # noqa: B018 (building them finds the clashes)
        except (DuplicateRegistrationError, PluginError) as exc:
            click.echo(f"Error: {exc}", err=True)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no plugins loaded")
        for r in rows:
            status = "available" if r["available"] else f"UNAVAILABLE: {r['reason']}"
            dist = f"{r['distribution']} {r['version']}" if r["distribution"] else r["source"]
            click.echo(f"{r['name']}  ({dist})  {status}")
            if r["hooks"]:
                click.echo(f"    hooks: {', '.join(r['hooks'])}")
            if r["note"]:
                click.echo(f"    note: {r['note']}")
        from sgl.kernels import cpu

        cpu.use_plugins(pm)
        try:
            if cpu.kernel_levels():
                click.echo(f"CPU kernel levels (--cpu-isa), best first: "
                           f"{', '.join(cpu.isa_levels())}")
            click.echo(f"CPU kernels: {cpu.describe_isa()}")
        except ValueError as exc:  # a bad SGL_CPU_ISA
            raise click.ClickException(str(exc)) from None

    @cli.group("config")
    def config_group() -> None:
        """Inspect settings."""

    @config_group.command("show", cls=GroupedCommand)
    @click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
    @click.pass_context
    def config_show(ctx: click.Context, as_json: bool, **_: Any) -> None:
        """Print the effective settings and where each came from (flag, env, file, default).

        Takes the same options as `sgl serve`."""
        click.echo(format_settings(_settings_or_exit(ctx, pm, check=False), as_json=as_json))

    config_show.params.extend(settings_options(pm))

    _add_plugin_commands(cli, pm)
    return cli


def _add_plugin_commands(cli: click.Group, pm: SglPluginManager) -> None:
    owners = {name: "sgl" for name in cli.commands}
    before = dict(cli.commands)
    for pid, _ in pm.call_each("sgl_register_commands", cli=cli):
        for name, command in cli.commands.items():
            if before.get(name) is command:
                continue
            if name in owners:
                raise PluginError(f"plugin {pid!r} registered the command {name!r}, which "
                                  f"{owners[name]!r} already provides")
            owners[name] = pid
        before = dict(cli.commands)


def _settings_or_exit(ctx: click.Context, pm: SglPluginManager,
                      check: bool = True) -> ServerSettings:
    try:
        settings = settings_from_click(ctx, pm)
        if check:
            pm.check_backends(settings)
            parallel_strategy(settings, pm.registries)
    except (ConfigError, DuplicateRegistrationError, PluginError) as exc:
        raise click.UsageError(str(exc), ctx) from None
    return settings


def _prescan(argv: Sequence[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"load": [], "disable": [], "config": []}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _SELECTION_FLAGS:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            found[_SELECTION_FLAGS[name]].append(value)
        elif arg == "--":
            break
        i += 1
    return found


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``sgl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    found = _prescan(argv)
    try:
        load = list(found["load"])
        disable = list(found["disable"])
        load += [p for p in os.environ.get("SGL_LOAD_PLUGINS", "").split(",") if p.strip()]
        if found["config"]:
            data = read_config_file(found["config"][-1])
            for key, target in (("load_plugins", load), ("disable_plugins", disable)):
                target += coerce_value(data.get(key, ()), tuple[str, ...], key=key,
                                       source=f"file {found['config'][-1]}")
        pm = create_plugin_manager(PluginSelection.from_args(load, disable))
        cli = build_cli(pm)
    except (ConfigError, PluginError, DuplicateRegistrationError) as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    cli.main(args=argv, prog_name="sgl")


if __name__ == "__main__":
    main()
