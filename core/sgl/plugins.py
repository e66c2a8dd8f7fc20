"""Finding, loading and inspecting plugins.

Plugins are Python modules with ``@sgl.hookimpl`` functions. They come from the ``sgl``
entry-point group of installed distributions, from ``--plugin NAME|module|path.py`` and from
``load_plugins`` in a config file. Nothing is loaded at import time: call
:func:`create_plugin_manager`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterator

import pluggy

from sgl.hookspecs import PROJECT_NAME, SPEC_MODULES
from sgl.registry import DuplicateRegistrationError, Registry

if TYPE_CHECKING:
    from sgl.config import ServerSettings

__all__ = [
    "PluginError",
    "PluginLoadError",
    "PluginRecord",
    "PluginSelection",
    "Registries",
    "SglPluginManager",
    "create_plugin_manager",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME


class PluginError(RuntimeError):
    """A plugin misbehaved while one of its hooks ran."""


class PluginLoadError(PluginError):
    """A plugin the user asked for explicitly could not be loaded."""


@dataclass
class PluginRecord:
    """What ``sgl plugins`` reports about one plugin."""

    name: str
    source: str  # "entry point", "module" or "file"
    target: str  # entry-point value, module path or file path
    distribution: str | None = None
    version: str | None = None
    available: bool = True
    reason: str | None = None
    #: where or how the plugin runs, when that needs saying (its module's ``SGL_NOTE``)
    note: str | None = None
    #: unavailable because of this machine (its module's ``SGL_UNAVAILABLE``: no GPU, a system
    #: library missing), not because the install is broken
    machine_limited: bool = False
    explicit: bool = False
    hooks: list[str] = field(default_factory=list)


def _split(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class PluginSelection:
    """Which plugins to load.

    :param load: names the user asked for (entry-point name, dotted module or ``.py`` path);
        any failure to load one of these is fatal.
    :param disable: entry-point names to leave out (``--disable-plugin``, ``--plugin no:NAME``).
    :param allowlist: when not None, only these entry points are auto-loaded (``SGL_PLUGINS``).
    :param autoload: discover installed entry points at all (``SGL_DISABLE_PLUGIN_AUTOLOAD``).
    :param exact: records handed down by a parent process: load exactly these, discover nothing.
    """

    load: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    allowlist: tuple[str, ...] | None = None
    autoload: bool = True
    exact: tuple[PluginRecord, ...] | None = None

    @classmethod
    def from_args(
        cls, plugins: tuple[str, ...] | list[str] = (), disable: tuple[str, ...] | list[str] = ()
    ) -> PluginSelection:
        """Build from ``--plugin`` / ``--disable-plugin`` values plus the ``SGL_*`` environment."""
        load = [p for p in plugins if not p.startswith("no:")]
        blocked = [p[3:] for p in plugins if p.startswith("no:")] + list(disable)
        blocked += _split(os.environ.get("SGL_DISABLE_PLUGINS")) or ()
        return cls(
            load=tuple(dict.fromkeys(load)),
            disable=tuple(dict.fromkeys(blocked)),
            allowlist=_split(os.environ.get("SGL_PLUGINS")),
            autoload=os.environ.get("SGL_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower()
            in ("", "0", "false", "no", "off"),
        )


def _registry(kind: str, hook: str) -> Any:
    return field(default_factory=lambda: Registry(kind), metadata={"hook": hook})


@dataclass
class Registries:
    """Every registry the core keeps, each filled from the plugins' ``sgl_register_*`` hook
    named in its field's metadata."""

    attention: Registry[Any] = _registry("attention backend", "sgl_register_attention_backends")
    models: Registry[Any] = _registry("model architecture", "sgl_register_model_archs")
    gguf_archs: Registry[Any] = _registry("GGUF architecture", "sgl_register_gguf_archs")
    weight_formats: Registry[Any] = _registry("weight format", "sgl_register_weight_formats")
    grammar: Registry[Any] = _registry("grammar backend", "sgl_register_grammar_backends")
    cache: Registry[Any] = _registry("cache policy", "sgl_register_cache_policies")
    speculative: Registry[Any] = _registry("speculative algorithm",
                                           "sgl_register_speculative_algorithms")
    parallel: Registry[Any] = _registry("parallel strategy", "sgl_register_parallel_strategies")
    transfer: Registry[Any] = _registry("KV transfer backend", "sgl_register_kv_transfer_backends")
    extensions: Registry[Any] = _registry("scheduler extension",
                                          "sgl_register_scheduler_extensions")
    frontends: Registry[Any] = _registry("frontend", "sgl_register_frontends")
    kernels: Registry[Any] = _registry("kernel library", "sgl_register_kernel_libraries")
    tool_parsers: Registry[Any] = _registry("tool-call parser", "sgl_register_tool_parsers")
    api_names: Registry[Any] = _registry("top-level name", "sgl_register_api_names")


class SglPluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers what was loaded, from where, and what failed."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        for module in SPEC_MODULES:
            self.add_hookspecs(module)
        self.records: dict[str, PluginRecord] = {}

    def impls_in_call_order(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The implementations of ``hook_name`` in the order pluggy calls them: ``tryfirst``
        ones first, then the others from the last registered to the first, ``trylast`` ones
        last.

        :raises PluginError: when a plugin registered a hook wrapper for it; the hooks sgl
            calls plugin by plugin (registrations, start-up, shut-down) take plain
            implementations only.
        """
        impls = getattr(self.hook, hook_name).get_hookimpls()
        for impl in impls:
            if impl.hookwrapper or impl.wrapper:
                name = self.get_name(impl.plugin) or repr(impl.plugin)
                raise PluginError(f"plugin {name!r} registered a hook wrapper for {hook_name}, "
                                  f"which sgl calls plugin by plugin; make it a plain "
                                  f"@hookimpl (tryfirst/trylast set its place)")
        return impls[::-1]  # pluggy keeps them in reverse call order

    def call_each(self, hook_name: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Call one hook plugin by plugin, in pluggy's order (:meth:`impls_in_call_order`),
        yielding ``(plugin name, result)``.

        ``per_plugin={"arg": factory}`` passes ``factory(plugin_name)`` as ``arg``, so that a
        callback knows which plugin calls it.
        """
        per_plugin = kwargs.pop("per_plugin", {})
        for impl in self.impls_in_call_order(hook_name):
            name = self.get_name(impl.plugin) or repr(impl.plugin)
            values = {**kwargs, **{key: make(name) for key, make in per_plugin.items()}}
            try:
                yield name, impl.function(**{arg: values[arg] for arg in impl.argnames})
            except (DuplicateRegistrationError, PluginError):
                raise
            except Exception as exc:
                raise PluginError(f"plugin {name!r} failed in {hook_name}: {exc}") from exc

    def config_classes(self) -> dict[str, type]:
        """Each plugin's settings dataclass from ``sgl_add_config``, by plugin name."""
        classes: dict[str, type] = {}
        for pid, cls in self.call_each("sgl_add_config"):
            if cls is None:
                continue
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise PluginError(f"plugin {pid!r}: sgl_add_config must return a dataclass "
                                  f"type, got {cls!r}")
            classes[pid] = cls
        return classes

    def check_backends(self, settings: ServerSettings) -> None:
        """Every backend named in ``settings`` must be registered by a loaded plugin, and each
        plugin must accept its options (``sgl_check_settings``);
        :class:`~sgl.config.ConfigError` names the setting, where it came from and what is
        available."""
        from sgl.config import ConfigError, option_fields
        from sgl.config import ServerSettings as Settings

        for f in option_fields(Settings):
            registry_name = f.metadata.get("registry")
            value = getattr(settings, f.name)
            if not registry_name or value in (None, ()):
                continue
            registry = getattr(self.registries, registry_name)
            for name in value if isinstance(value, tuple) else (value,):
                if name in registry or name in f.metadata.get("keywords", ()):
                    continue
                # a registered name may also be a keyword (w8a8_int8: a core mode and a
                # checkpoint format): named once
                choices = list(dict.fromkeys([*f.metadata.get("keywords", ()),
                                              *registry.names()]))
                raise ConfigError(
                    f"invalid value {name!r} for {f.name!r} (from {settings.source(f.name)}): "
                    f"no installed plugin provides that {registry.kind}; available: "
                    f"{', '.join(choices) or 'none installed'}{self.unavailable_hint()}")
        if settings.cpu_isa not in ("auto", "none") and "cpu" in self.registries.kernels:
            levels = getattr(self.registries.kernels.load("cpu"), "levels", ())
            if settings.cpu_isa not in levels:
                raise ConfigError(
                    f"invalid value {settings.cpu_isa!r} for 'cpu_isa' (from "
                    f"{settings.source('cpu_isa')}): expected auto, none or a level of the CPU "
                    f"kernel library: {', '.join(levels)}")
        if settings.speculative_algorithm is not None:
            self._check_speculative(settings)
        try:
            for _ in self.call_each("sgl_check_settings", settings=settings,
                                    registries=self.registries):
                pass
        except PluginError as exc:
            if isinstance(exc.__cause__, ConfigError):
                raise exc.__cause__ from None
            raise

    def unavailable_hint(self) -> str:
        """One line per installed plugin that failed to load, saying why (for errors about
        something no plugin provides)."""
        return "".join(f"\n  plugin {r.name!r} is unavailable: {r.reason}"
                       for r in self.records.values() if not r.available)

    def _check_speculative(self, settings: ServerSettings) -> None:
        from sgl.config import ConfigError

        name = settings.speculative_algorithm
        entry = self.registries.speculative.entry(name)
        try:
            algorithm = entry.load()
        except Exception as exc:
            raise ConfigError(
                f"--speculative-algorithm {name}: plugin {entry.owner!r} registered it as "
                f"{entry.target!r}, which failed to import: {type(exc).__name__}: {exc}"
            ) from None
        if not (isinstance(algorithm, type)
                and callable(getattr(algorithm, "check_settings", None))):
            raise ConfigError(
                f"--speculative-algorithm {name}: plugin {entry.owner!r} registered "
                f"{algorithm!r}, which is not a subclass of "
                "sgl.speculative.BaseSpeculativeAlgorithm")
        problem = algorithm.check_settings(settings)
        if problem is None and settings.tp_size > 1 and not algorithm.tensor_parallel:
            problem = (f"not supported with --tp-size {settings.tp_size} (its draft model "
                       "is not split over the ranks); NGRAM is")
        if problem:
            raise ConfigError(f"--speculative-algorithm {name}: {problem}")

    @cached_property
    def registries(self) -> Registries:
        """Every registry, built once from the registration hooks of all loaded plugins."""
        registries = Registries()
        for f in dataclasses.fields(registries):
            registry: Registry[Any] = getattr(registries, f.name)

            def register_for(owner: str, registry: Registry[Any] = registry) -> Any:
                return lambda name, target: registry.register(name, target, owner=owner)

            for _ in self.call_each(f.metadata["hook"], per_plugin={"register": register_for}):
                pass
        return registries

    def notify_startup(self, **kwargs: Any) -> None:
        """Call ``sgl_on_startup``; a failure raises :class:`PluginError` naming the plugin."""
        for _ in self.call_each("sgl_on_startup", **kwargs):
            pass

    def notify_shutdown(self, **kwargs: Any) -> None:
        """Call ``sgl_on_shutdown`` on every plugin; failures are logged, none stops the rest."""
        for impl in self.impls_in_call_order("sgl_on_shutdown"):
            try:
                impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            except Exception:
                logger.exception("plugin %r failed in sgl_on_shutdown", self.get_name(impl.plugin))

    def loaded_records(self) -> tuple[PluginRecord, ...]:
        """The plugins a child process must load to match this one."""
        return tuple(r for r in self.records.values() if r.available)


def _import_file(path: Path) -> ModuleType:
    module_name = f"sgl_file_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _import_target(source: str, target: str) -> ModuleType:
    if source == "file":
        return _import_file(Path(target))
    return importlib.import_module(target.partition(":")[0])


def _missing_requirements(module: ModuleType) -> str | None:
    missing = [
        name
        for name in getattr(module, "SGL_REQUIRES", ())
        if importlib.util.find_spec(name.split(".")[0]) is None
    ]
    if missing:
        return f"missing dependency: {', '.join(missing)} (pip install {' '.join(missing)})"
    # a plugin whose dependency is installed but cannot run here (a system library missing)
    # sets SGL_UNAVAILABLE to the reason when it is imported
    return getattr(module, "SGL_UNAVAILABLE", None)


def _register_checked(pm: SglPluginManager, module: ModuleType, name: str) -> str | None:
    """Register ``module``; on a hook that is misspelled or has wrong arguments, undo and
    return why (``pm.check_pending`` fails fast instead of silently ignoring the hook)."""
    try:
        pm.register(module, name=name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        if pm.is_registered(module):
            pm.unregister(module)
        return f"invalid hook implementation: {exc}"
    return None


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or spec.startswith(".")


@functools.cache
def installed_plugin_manager() -> SglPluginManager:
    """The plugin manager of the installed plugins (as the environment selects them), built
    once: for code that runs outside a server, an engine or a scheduler, which pass their
    own (scripts, tests, a model config read on its own)."""
    return create_plugin_manager()


def create_plugin_manager(selection: PluginSelection | None = None) -> SglPluginManager:
    """Build a plugin manager: discover, import and register plugins as ``selection`` says.

    A plugin that fails to import or lacks a dependency is recorded as unavailable with the
    reason, unless the user named it explicitly: then :class:`PluginLoadError` is raised.
    """
    selection = selection or PluginSelection.from_args()
    pm = SglPluginManager()
    if os.environ.get("SGL_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: logger.info("%s", msg.rstrip()))
        pm.enable_tracing()

    candidates: list[PluginRecord] = []
    if selection.exact is not None:
        candidates = [PluginRecord(r.name, r.source, r.target, r.distribution, r.version,
                                   explicit=True) for r in selection.exact]
    else:
        entry_points: dict[str, importlib.metadata.EntryPoint] = {}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in entry_points and entry_points[ep.name].value != ep.value:
                first = getattr(entry_points[ep.name], "dist", None)
                second = getattr(ep, "dist", None)
                raise PluginLoadError(
                    f"two installed distributions declare the plugin id {ep.name!r}: "
                    f"{first.name if first else entry_points[ep.name].value} and "
                    f"{second.name if second else ep.value}; uninstall one of them")
            entry_points[ep.name] = ep
        for ep in entry_points.values():
            wanted = ep.name in selection.load
            if not wanted and (
                not selection.autoload
                or ep.name in selection.disable
                or (selection.allowlist is not None and ep.name not in selection.allowlist)
            ):
                continue
            dist = getattr(ep, "dist", None)
            candidates.append(PluginRecord(
                ep.name, "entry point", ep.value,
                distribution=dist.name if dist else None,
                version=dist.version if dist else None,
                explicit=wanted,
            ))
        for spec in selection.load:
            if spec in entry_points:
                continue
            if _is_path(spec):
                path = Path(spec).expanduser().resolve()
                if not path.is_file():
                    raise PluginLoadError(f"--plugin {spec}: no such file {path}")
                candidates.append(PluginRecord(path.stem, "file", str(path), explicit=True))
            else:
                candidates.append(PluginRecord(spec, "module", spec, explicit=True))

    for record in candidates:
        if record.name in pm.records:
            raise PluginLoadError(
                f"two plugins are named {record.name!r}: {pm.records[record.name].target} and "
                f"{record.target}"
            )
        pm.records[record.name] = record
        # a plugin that says it cannot run on this machine (SGL_UNAVAILABLE: no GPU, no system
        # library) is expected to be so on most machines: said at info level, not on every
        # command; a missing dependency or a broken plugin is a warning
        try:
            module = _import_target(record.source, record.target)
            record.reason = _missing_requirements(module)
            record.note = getattr(module, "SGL_NOTE", None)
            record.machine_limited = record.reason is not None and \
                record.reason == getattr(module, "SGL_UNAVAILABLE", None)
        except Exception as exc:  # a broken plugin must not stop the others
            record.reason = f"{type(exc).__name__}: {exc}"
        if record.reason is None:
            record.reason = _register_checked(pm, module, record.name)
        if record.reason is not None:
            record.available = False
            if record.explicit:
                raise PluginLoadError(f"plugin {record.name!r} could not be loaded: {record.reason}")
            logger.log(logging.INFO if record.machine_limited else logging.WARNING,
                       "plugin %r is unavailable: %s", record.name, record.reason)

    for name, plugin in pm.list_name_plugin():
        if name in pm.records:
            pm.records[name].hooks = sorted(c.name for c in pm.get_hookcallers(plugin) or ())
    return pm
