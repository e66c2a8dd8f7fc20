"""One test per hook: an inline plugin implements it and the core uses what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import click
import pytest
from click.testing import CliRunner

from sgl import hookimpl
from sgl.cli import build_cli, settings_options
from sgl.plugins import PluginError


def registering(hook: str, name: str, target: Any) -> object:
    """An inline plugin whose ``hook`` registers ``name``."""

    class Plugin:
        pass

    def impl(self: Any, register: Any) -> None:
        register(name, target)

    impl.__name__ = hook
    setattr(Plugin, hook, hookimpl(impl))
    return Plugin()


@pytest.mark.parametrize("hook,registry", [
    ("sgl_register_attention_backends", "attention"),
    ("sgl_register_model_archs", "models"),
    ("sgl_register_gguf_archs", "gguf_archs"),
    ("sgl_register_weight_formats", "weight_formats"),
    ("sgl_register_grammar_backends", "grammar"),
    ("sgl_register_cache_policies", "cache"),
    ("sgl_register_speculative_algorithms", "speculative"),
    ("sgl_register_parallel_strategies", "parallel"),
    ("sgl_register_kv_transfer_backends", "transfer"),
    ("sgl_register_scheduler_extensions", "extensions"),
    ("sgl_register_frontends", "frontends"),
    ("sgl_register_tool_parsers", "tool_parsers"),
    ("sgl_register_api_names", "api_names"),
])
def test_registry_hook(plugin_manager, register_plugin, hook: str, registry: str) -> None:
    register_plugin(registering(hook, "inline-thing", "collections:OrderedDict"), name="inline")
    entry = getattr(plugin_manager.registries, registry).entry("inline-thing")
    assert entry.owner == "inline"
    import collections

    assert entry.load() is collections.OrderedDict


def test_hook_sgl_register_attention_backends(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_attention_backends", "inline-attn", "a:B"), "p")
    assert "inline-attn" in plugin_manager.registries.attention.names()
    assert "torch" in plugin_manager.registries.attention.names()  # the default plugin's


def test_hook_sgl_register_model_archs(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_model_archs", "ToyForCausalLM", "a:B"), "p")
    assert {"ToyForCausalLM", "LlamaForCausalLM"} <= set(plugin_manager.registries.models.names())


def test_hook_sgl_register_grammar_backends(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_grammar_backends", "toy-grammar", "a:B"), "p")
    assert plugin_manager.registries.grammar.entry("toy-grammar").owner == "p"


def test_hook_sgl_register_cache_policies(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_cache_policies", "toy-cache", "a:B"), "p")
    assert plugin_manager.registries.cache.entry("toy-cache").owner == "p"


def test_hook_sgl_register_speculative_algorithms(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_speculative_algorithms", "toy-spec", "a:B"), "p")
    assert plugin_manager.registries.speculative.entry("toy-spec").owner == "p"


def test_hook_sgl_register_parallel_strategies(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_parallel_strategies", "toy-par", "a:B"), "p")
    assert plugin_manager.registries.parallel.entry("toy-par").owner == "p"


def test_hook_sgl_register_kv_transfer_backends(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_kv_transfer_backends", "toy-xfer", "a:B"), "p")
    assert plugin_manager.registries.transfer.entry("toy-xfer").owner == "p"


def test_hook_sgl_register_gguf_archs(plugin_manager, register_plugin) -> None:
    """A registered GGUF architecture is what the loader reads a file of that architecture
    with; an entry that is not a GGUFArch of its name is refused naming the plugin."""
    import dataclasses

    from sgl.model_loader import ModelLoadError, open_weights
    from sgl.model_loader.gguf_archs import gguf_arch, gguf_archs_of

    llama = gguf_archs_of(plugin_manager.registries)["llama"]
    toy = dataclasses.replace(llama, name="toyarch")
    register_plugin(registering("sgl_register_gguf_archs", "toyarch", toy), "p")
    archs = gguf_archs_of(plugin_manager.registries)
    assert archs["toyarch"] is toy and gguf_arch("toyarch", archs) is toy
    # the bundled model's file is "llama": without that architecture its weights are refused,
    # naming the architectures there are
    with pytest.raises(ModelLoadError, match="architecture 'llama'.*supported GGUF "
                                             "architectures: toyarch"):
        open_weights(None, gguf_archs={"toyarch": toy})
    register_plugin(registering("sgl_register_gguf_archs", "bad", llama), "q")
    with pytest.raises(ValueError, match="plugin 'q' registered GGUF architecture 'bad'"):
        gguf_archs_of(plugin_manager.registries)


def test_hook_sgl_register_weight_formats(plugin_manager, register_plugin, tmp_path) -> None:
    """A registered weight format is a --quantization choice and reads the checkpoints of its
    quant_method; an entry that is not a WeightFormat of its name is refused naming the
    plugin."""
    import json

    from sgl.engine.model_runner import resolve_quantization
    from sgl.model_loader import open_weights
    from sgl.model_loader.formats import WeightFormat, weight_formats_of

    opened = []

    class Toy(WeightFormat):
        name = "toyq"
        description = "a toy-quantized"

        @classmethod
        def check(cls, quant, name):
            if quant.get("bits") != 3:
                raise ValueError(f"{name}: toyq needs 3 bits")

        @classmethod
        def open(cls, path, dtype, quant, *, quantized):
            opened.append((path, quant["bits"], quantized))
            return "weights"

    register_plugin(registering("sgl_register_weight_formats", "toyq", Toy), "p")
    formats = weight_formats_of(plugin_manager.registries)
    assert formats["toyq"] is Toy and "gptq" in formats
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "toyq", "bits": 3}}))

    class Config:
        quantization_config = {"quant_method": "toyq", "bits": 3}

    assert resolve_quantization("auto", tmp_path, Config(), formats) == "toyq"
    assert resolve_quantization("toyq", tmp_path, Config(), formats) == "toyq"
    with pytest.raises(ValueError, match="--quantization toyq needs a toy-quantized checkpoint"):
        resolve_quantization("toyq", tmp_path, type("Dense", (), {})(), formats)
    Config.quantization_config = {"quant_method": "toyq", "bits": 4}
    with pytest.raises(ValueError, match="toyq needs 3 bits"):
        resolve_quantization("auto", tmp_path, Config(), formats)
    assert open_weights(tmp_path, quantized=True, weight_formats=formats) == "weights"
    assert opened == [(tmp_path, 3, True)]
    register_plugin(registering("sgl_register_weight_formats", "bad", Toy), "q")
    with pytest.raises(ValueError, match="plugin 'q' registered weight format 'bad'"):
        weight_formats_of(plugin_manager.registries)


def test_hook_sgl_register_scheduler_extensions(plugin_manager, register_plugin) -> None:
    """A registered extension whose settings ask for it is made by the scheduler, after the
    core's own; one that does not subclass the contract is refused by name."""
    from sgl.config import load_settings
    from sgl.engine.extension import SchedulerExtension
    from sgl.engine.scheduler_view import extension_classes

    class Counting(SchedulerExtension):
        name = "counting"

    class Off(SchedulerExtension):
        name = "off"

        @classmethod
        def enabled(cls, settings: Any) -> bool:
            return False

    register_plugin(registering("sgl_register_scheduler_extensions", "counting", Counting), "p")
    register_plugin(registering("sgl_register_scheduler_extensions", "off", Off), "q")
    assert plugin_manager.registries.extensions.entry("counting").owner == "p"
    settings = load_settings(env={}, cli={"speculative_algorithm": "NGRAM"})
    names = [cls.name for cls in extension_classes(settings, plugin_manager)]
    assert names[0] == "speculative" and "counting" in names and "off" not in names
    register_plugin(registering("sgl_register_scheduler_extensions", "bad", dict), "r")
    with pytest.raises(TypeError, match="not a subclass of sgl.engine.extension"):
        extension_classes(settings, plugin_manager)


def test_plugin_registrations_are_selected_by_their_flags(tmp_path) -> None:
    from sgl_testing import run_cli

    path = tmp_path / "eager_tp.py"
    path.write_text("from sgl import hookimpl\n\n@hookimpl\n"
                    "def sgl_register_parallel_strategies(register):\n"
                    "    register('pp', 'eager_tp:PP')\n"
                    "@hookimpl\n"
                    "def sgl_register_kv_transfer_backends(register):\n"
                    "    register('nixl', 'eager_tp:Nixl')\n"
                    "@hookimpl\n"
                    "def sgl_register_speculative_algorithms(register):\n"
                    "    register('MEDUSA', 'eager_tp:Medusa')\n")
    result = run_cli(["plugins", "--plugin", str(path)])
    assert result.returncode == 0, result.stderr
    assert "Not used" not in result.stdout
    # speculative algorithms, parallel strategies and transfer backends are selected by their
    # flags, and one whose class cannot be imported fails with a message naming the plugin,
    # before any model loads
    xfer = run_cli(["serve", "--disaggregation-mode", "decode",
                    "--disaggregation-transfer-backend", "nixl", "--plugin", str(path)])
    assert xfer.returncode != 0 and "Traceback" not in xfer.stderr, xfer.stderr
    assert "plugin 'eager_tp' registered it as 'eager_tp:Nixl', which failed to import" \
        in xfer.stderr, xfer.stderr
    assert "speculative algorithm" not in result.stdout
    assert "parallel strategy" not in result.stdout
    flag = run_cli(["serve", "--speculative-algorithm", "MEDUSA", "--plugin", str(path)])
    assert flag.returncode != 0 and "Traceback" not in flag.stderr, flag.stderr
    assert "eager_tp" in flag.stderr, flag.stderr
    tp = run_cli(["serve", "--tp-size", "3", "--disable-plugin", "parallel-tp", "--plugin",
                  str(path)])
    assert tp.returncode != 0 and "Traceback" not in tp.stderr, tp.stderr
    assert "no installed plugin provides tensor parallelism" in tp.stderr, tp.stderr
    assert "parallel strategy 'pp' of plugin 'eager_tp' failed to import" in tp.stderr


def test_hook_sgl_register_api_names(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_api_names", "toy_name", "collections:deque"), "p")
    assert plugin_manager.registries.api_names.entry("toy_name").owner == "p"
    assert "function" in plugin_manager.registries.api_names  # the language plugin's


def test_sgl_names_come_from_the_plugins_that_register_them() -> None:
    """``sgl.function`` & co. are the language plugin's, found through
    sgl_register_api_names; with that plugin left out they are not there, and the error
    says where such names come from."""
    import subprocess
    import sys

    probe = "import sgl, sgl_lang; print(sgl.function is sgl_lang.function, sgl.gen is sgl_lang.gen)"
    ok = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=120)
    assert ok.stdout.split() == ["True", "True"], ok.stderr
    import os

    gone = subprocess.run([sys.executable, "-c", "import sgl; sgl.function"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SGL_DISABLE_PLUGINS": "lang"})
    assert gone.returncode == 1
    assert ("AttributeError: module 'sgl' has no attribute 'function' (no loaded plugin "
            "registers it through sgl_register_api_names)") in gone.stderr


def test_hook_sgl_register_frontends(plugin_manager, register_plugin) -> None:
    register_plugin(registering("sgl_register_frontends", "toy-front", "a:make"), "p")
    assert {"toy-front", "openai"} <= set(plugin_manager.registries.frontends.names())


def test_hook_sgl_resolve_model_arch(plugin_manager, register_plugin, tiny_llama_config) -> None:
    class Claims:
        @hookimpl
        def sgl_resolve_model_arch(self, hf_config: Any) -> str | None:
            return "LlamaForCausalLM" if hf_config.architectures == ["MyLlama"] else None

    register_plugin(Claims(), name="claims")
    tiny_llama_config.architectures = ["MyLlama"]
    assert plugin_manager.hook.sgl_resolve_model_arch(hf_config=tiny_llama_config) \
        == "LlamaForCausalLM"
    tiny_llama_config.architectures = ["Other"]
    assert plugin_manager.hook.sgl_resolve_model_arch(hf_config=tiny_llama_config) is None


def test_hook_sgl_register_commands(plugin_manager, register_plugin) -> None:
    class Commands:
        @hookimpl
        def sgl_register_commands(self, cli: click.Group) -> None:
            @cli.command("greet")
            @click.argument("who")
            def greet(who: str) -> None:
                """Say hello."""
                click.echo(f"hello {who}")

    register_plugin(Commands(), name="greeter")
    cli = build_cli(plugin_manager)
    result = CliRunner().invoke(cli, ["greet", "sgl"])
    assert result.exit_code == 0 and result.output == "hello sgl\n"
    assert "greet" in CliRunner().invoke(cli, ["--help"]).output


def test_hook_sgl_add_config(plugin_manager, register_plugin) -> None:
    @dataclass(frozen=True)
    class Settings:
        depth: int = field(default=3, metadata={"help": "How deep."})
        fast: bool = False

    class Configured:
        @hookimpl
        def sgl_add_config(self) -> type:
            return Settings

    register_plugin(Configured(), name="deep")
    assert plugin_manager.config_classes()["deep"] is Settings
    flags = {opt for o in settings_options(plugin_manager) for opt in o.opts}
    assert {"--deep-depth", "--deep-fast"} <= flags


def test_add_config_must_return_a_dataclass(plugin_manager, register_plugin) -> None:
    class Wrong:
        @hookimpl
        def sgl_add_config(self) -> Any:
            return {"depth": 3}

    register_plugin(Wrong(), name="wrong")
    with pytest.raises(PluginError, match="plugin 'wrong'.*dataclass"):
        plugin_manager.config_classes()


@dataclass(frozen=True)
class _LinkSettings:
    mode: str = field(default="off", metadata={"help": "on or off."})
    balance: str | None = field(default=None, metadata={"name": "balance_method",
                                                         "help": "How to balance."})
    token: str | None = field(default=None, metadata={"secret": True, "help": "A secret."})
    retries: int = field(default=3, metadata={"minimum": 1, "help": "Tries."})


class _Link:
    @hookimpl
    def sgl_add_config(self) -> type:
        return _LinkSettings

    @hookimpl
    def sgl_check_settings(self, settings: Any, registries: Any) -> None:
        opts = settings.plugin_settings["link"]
        if opts.mode == "off" and settings.is_set("link_token"):
            raise settings.invalid("link_token", "it needs --link-mode on")
        if opts.balance == "crash":
            raise RuntimeError("kaboom")


def test_hook_sgl_check_settings(plugin_manager, register_plugin) -> None:
    from sgl.config import ConfigError, load_settings

    register_plugin(_Link(), name="link")
    classes = plugin_manager.config_classes()

    def check(**kwargs: Any) -> None:
        plugin_manager.check_backends(load_settings(plugin_classes=classes, **kwargs))

    check(env={"SGL_LINK_MODE": "on", "SGL_LINK_TOKEN": "x"})
    with pytest.raises(ConfigError, match=r"^env SGL_LINK_TOKEN: invalid value 'x' for "
                                          r"'link_token': it needs --link-mode on$"):
        check(env={"SGL_LINK_TOKEN": "x"})
    with pytest.raises(PluginError, match="plugin 'link' failed in sgl_check_settings: kaboom"):
        check(env={}, file_data={"balance_method": "crash"})


def test_plugin_options_by_their_top_level_names(plugin_manager, register_plugin) -> None:
    """A plugin option is one name everywhere: ``<id>_<field>`` or the name its field declares,
    as a flag, an environment variable, a top-level key of a file, an Engine keyword and a key
    of the server info; ``minimum`` is checked and secrets are hidden."""
    from sgl.config import ConfigError, load_settings, public_settings
    from sgl.entrypoints.engine import engine_settings

    register_plugin(_Link(), name="link")
    classes = plugin_manager.config_classes()
    flags = {opt for o in settings_options(plugin_manager) for opt in o.opts}
    assert {"--link-mode", "--balance-method", "--link-token", "--link-retries"} <= flags
    settings = load_settings(env={"SGL_BALANCE_METHOD": "fair", "SGL_LINK_TOKEN": "s3cret"},
                             file_data={"link_mode": "on"}, plugin_classes=classes)
    opts = settings.plugin_settings["link"]
    assert (opts.mode, opts.balance, opts.token) == ("on", "fair", "s3cret")
    assert settings.source("balance_method") == "env SGL_BALANCE_METHOD"
    assert settings.source("link_mode").startswith("file ")
    shown = public_settings(settings)
    assert shown["link_mode"] == "on" and shown["balance_method"] == "fair"
    assert shown["link_token"] == "<hidden>" and shown["plugins"]["link"]["token"] == "<hidden>"
    assert "s3cret" not in repr(shown)
    engine = engine_settings(None, {"balance_method": "fair", "link_retries": 5}, classes)
    assert engine.plugin_settings["link"].retries == 5
    assert engine.source("link_retries") == "Engine(...)"
    with pytest.raises(ConfigError, match="'link_retries': expected at least 1"):
        load_settings(env={"SGL_LINK_RETRIES": "0"}, plugin_classes=classes)
    with pytest.raises(ConfigError, match="give it once"):
        load_settings(env={}, file_data={"link_mode": "on", "plugins": {"link": {"mode": "off"}}},
                      plugin_classes=classes)
    with pytest.raises(TypeError, match="did you mean 'link_mode'"):
        engine_settings(None, {"link_mod": "on"}, classes)


def test_a_plugin_option_may_not_take_a_name_in_use(plugin_manager, register_plugin) -> None:
    from sgl.config import ConfigError

    @dataclass(frozen=True)
    class Clashing:
        port: int = field(default=1, metadata={"name": "port", "help": "A second port."})

    class Clash:
        @hookimpl
        def sgl_add_config(self) -> type:
            return Clashing

    register_plugin(Clash(), name="clash")
    with pytest.raises(ConfigError, match="plugin 'clash': its option 'port' is named 'port', "
                                          "which the core already uses"):
        settings_options(plugin_manager)


def test_failing_hook_names_the_plugin(plugin_manager, register_plugin) -> None:
    class Crashes:
        @hookimpl
        def sgl_register_cache_policies(self, register: Any) -> None:
            raise RuntimeError("kaboom")

    register_plugin(Crashes(), name="crashy")
    with pytest.raises(PluginError, match="plugin 'crashy' failed in sgl_register_cache_policies"):
        plugin_manager.registries  # noqa: B018


def test_command_name_clash_names_both(plugin_manager, register_plugin) -> None:
    class Hijacker:
        @hookimpl
        def sgl_register_commands(self, cli: click.Group) -> None:
            @cli.command("serve")
            def serve() -> None:
                """Not the real one."""

    register_plugin(Hijacker(), name="hijacker")
    with pytest.raises(PluginError, match="plugin 'hijacker' registered the command 'serve'.*'sgl'"):
        build_cli(plugin_manager)


def test_shutdown_failure_does_not_stop_other_plugins(plugin_manager, register_plugin) -> None:
    seen: list[str] = []

    class Fails:
        @hookimpl
        def sgl_on_shutdown(self, settings: Any, process: str) -> None:
            raise RuntimeError("cannot clean up")

    class Records:
        @hookimpl
        def sgl_on_shutdown(self, settings: Any, process: str) -> None:
            seen.append(process)

    register_plugin(Records(), name="records")
    register_plugin(Fails(), name="fails")
    plugin_manager.notify_shutdown(settings=None, process="server")
    assert seen == ["server"]
