"""Plugin discovery, selection and failure reporting, through the real `sgl` command."""

from __future__ import annotations

import json
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from sgl.plugins import PluginError, PluginLoadError, PluginSelection, create_plugin_manager
from sgl_testing import run_cli

DEFAULT_PLUGINS = {"model-llama", "attn-torch", "frontend-openai"}


def install_dist(site: Path, dist: str, ep_name: str, module: str, source: str) -> None:
    """Lay out a distribution the way pip installs one: a module plus its .dist-info with an
    entry point in the `sgl` group, so importlib.metadata discovers it from PYTHONPATH."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[sgl]\n{ep_name} = {module}\n")


def plugins_json(*args: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    result = run_cli(["plugins", "--json", *args], env=env)
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)}


def test_default_plugins_are_discovered_with_their_hooks() -> None:
    plugins = plugins_json()
    assert DEFAULT_PLUGINS <= set(plugins)
    assert plugins["attn-torch"]["hooks"] == ["sgl_register_attention_backends"]
    assert plugins["model-llama"]["hooks"] == ["sgl_register_gguf_archs",
                                               "sgl_register_model_archs"]
    assert plugins["frontend-openai"]["distribution"] == "sgl-frontend-openai"
    assert all(plugins[name]["available"] for name in DEFAULT_PLUGINS)


def test_plugin_ids_are_unique() -> None:
    names = [ep.name for ep in entry_points(group="sgl")]
    assert len(names) == len(set(names)), names


def test_text_listing_names_plugins_and_hooks() -> None:
    result = run_cli(["plugins"])
    assert result.returncode == 0
    assert "attn-torch  (sgl-attn-torch" in result.stdout
    assert "hooks: sgl_register_attention_backends" in result.stdout


def test_text_listing_says_the_cpu_kernels_level() -> None:
    """`sgl plugins` ends with the CPU kernels' level and why; a bad SGL_CPU_ISA is an error
    that lists the levels, not a traceback."""
    from sgl.kernels import cpu

    result = run_cli(["plugins"], env={"SGL_CPU_ISA": "none"})
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]
    assert last.startswith(f"CPU kernels: none (CPU has {cpu.detected_isa()}")
    assert last.endswith("torch operators only)")
    levels = result.stdout.splitlines()[-2]  # the library's levels, for --cpu-isa
    assert levels == f"CPU kernel levels (--cpu-isa), best first: {', '.join(cpu.isa_levels())}"
    result = run_cli(["plugins"], env={"SGL_CPU_ISA": "avx9"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "SGL_CPU_ISA='avx9': expected auto or one of amx, avx512_bf16" in result.stderr


def test_broken_plugin_is_reported_and_others_still_load(tmp_path: Path) -> None:
    install_dist(tmp_path, "sgl-broken", "broken", "sgl_broken_plugin",
                 'raise ImportError("No module named frobnicate")\n')
    env = {"PYTHONPATH": str(tmp_path)}
    plugins = plugins_json(env=env)
    assert plugins["broken"]["available"] is False
    assert "frobnicate" in plugins["broken"]["reason"]
    assert plugins["broken"]["distribution"] == "sgl-broken"
    assert all(plugins[name]["available"] for name in DEFAULT_PLUGINS)

    # asked for explicitly, the same failure stops start-up with the reason
    result = run_cli(["plugins", "--plugin", "broken"], env=env)
    assert result.returncode == 2
    assert "plugin 'broken' could not be loaded" in result.stderr
    assert "frobnicate" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_dependency_marks_plugin_unavailable(tmp_path: Path) -> None:
    install_dist(tmp_path, "sgl-needy", "needy", "sgl_needy_plugin", '''
        from sgl import hookimpl
        SGL_REQUIRES = ("surely_not_an_installed_module",)

        @hookimpl
        def sgl_register_grammar_backends(register):
            register("needy", "sgl_needy_plugin:Nothing")
    ''')
    plugins = plugins_json(env={"PYTHONPATH": str(tmp_path)})
    assert plugins["needy"]["available"] is False
    assert "missing dependency: surely_not_an_installed_module" in plugins["needy"]["reason"]


def test_misspelled_hook_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "typo_plugin.py"
    path.write_text("from sgl import hookimpl\n\n@hookimpl\n"
                    "def sgl_register_atention_backends(register):\n    pass\n")
    result = run_cli(["plugins", "--plugin", str(path)])
    assert result.returncode == 2
    assert "sgl_register_atention_backends" in result.stderr


def test_plugin_from_module_path_and_file(tmp_path: Path) -> None:
    source = "from sgl import hookimpl\n\n@hookimpl\ndef sgl_register_cache_policies(register):\n" \
             "    register('{name}', 'collections:OrderedDict')\n"
    (tmp_path / "my_cache_plugin.py").write_text(source.format(name="by-module"))
    other = tmp_path / "elsewhere" / "file_cache.py"
    other.parent.mkdir()
    other.write_text(source.format(name="by-file"))
    plugins = plugins_json("--plugin", "my_cache_plugin", "--plugin", str(other),
                           env={"PYTHONPATH": str(tmp_path)})
    assert plugins["my_cache_plugin"]["source"] == "module"
    assert plugins["my_cache_plugin"]["hooks"] == ["sgl_register_cache_policies"]
    assert plugins["file_cache"]["source"] == "file"

    result = run_cli(["plugins", "--plugin", str(tmp_path / "missing.py")])
    assert result.returncode == 2 and "no such file" in result.stderr


@pytest.mark.parametrize("args,env", [
    (["--disable-plugin", "frontend-openai"], {}),
    (["--plugin", "no:frontend-openai"], {}),
    ([], {"SGL_DISABLE_PLUGINS": "frontend-openai"}),
    ([], {"SGL_PLUGINS": "attn-torch,model-llama"}),
])
def test_leaving_a_plugin_out(args: list[str], env: dict[str, str]) -> None:
    plugins = plugins_json(*args, env=env)
    assert "frontend-openai" not in plugins
    assert {"attn-torch", "model-llama"} <= set(plugins)


def test_no_plugins_gives_a_clear_not_available_error() -> None:
    result = run_cli(["serve"], env={"SGL_PLUGINS": ""})
    assert result.returncode == 2
    assert "no installed plugin provides that attention backend" in result.stderr
    assert "Traceback" not in result.stderr


def test_two_plugins_claiming_one_backend_name_both_named(tmp_path: Path) -> None:
    path = tmp_path / "impostor.py"
    path.write_text("from sgl import hookimpl\n\n@hookimpl\n"
                    "def sgl_register_attention_backends(register):\n"
                    "    register('torch', 'impostor:Backend')\n")
    result = run_cli(["serve", "--plugin", str(path)])
    assert result.returncode == 2
    assert "'attn-torch'" in result.stderr and "'impostor'" in result.stderr


def test_workers_get_exactly_the_parents_plugins(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "extra_plugin.py"
    path.write_text("from sgl import hookimpl\n\n@hookimpl\n"
                    "def sgl_register_parallel_strategies(register):\n"
                    "    register('extra', 'collections:OrderedDict')\n")
    parent = create_plugin_manager(PluginSelection(load=(str(path),), disable=("frontend-openai",)))
    child = create_plugin_manager(PluginSelection(exact=parent.loaded_records()))
    # the parent's available plugins; one unavailable there (flashinfer without a GPU) is not
    # handed down
    assert set(child.records) == {name for name, r in parent.records.items() if r.available}
    assert all(r.available for r in child.records.values())
    assert "extra" in child.registries.parallel
    assert "openai" not in child.registries.frontends


def test_explicit_unknown_module_fails() -> None:
    with pytest.raises(PluginLoadError, match="no_such_module_xyz"):
        create_plugin_manager(PluginSelection(load=("no_such_module_xyz",)))


def test_clash_is_still_listed_by_sgl_plugins(tmp_path: Path) -> None:
    path = tmp_path / "impostor.py"
    path.write_text("from sgl import hookimpl\n\n@hookimpl\n"
                    "def sgl_register_attention_backends(register):\n"
                    "    register('torch', 'impostor:Backend')\n")
    result = run_cli(["plugins", "--plugin", str(path)])
    assert result.returncode == 0
    assert "impostor" in result.stdout and "'attn-torch'" in result.stderr


ORDER_PLUGIN = """\
from sgl import hookimpl

@hookimpl({opts})
def sgl_register_cache_policies(register):
    register('{name}', 'collections:OrderedDict')

@hookimpl({opts})
def sgl_on_startup(settings, process, context):
    context.append('{name}')
"""


def _ignore(plugin: str) -> Any:
    return lambda name, target: None


def test_plugin_by_plugin_calls_follow_pluggys_order(tmp_path: Path) -> None:
    """``call_each`` (registrations, start-up) calls implementations in the order pluggy's own
    hook call does: tryfirst first, then last registered first, trylast last. It used to call
    them in registration order, which inverted tryfirst and trylast."""
    kinds = {"order_plain_a": "", "order_first": "tryfirst=True", "order_plain_b": "",
             "order_last": "trylast=True"}
    for name, opts in kinds.items():
        (tmp_path / f"{name}.py").write_text(ORDER_PLUGIN.format(name=name, opts=opts))
    pm = create_plugin_manager(PluginSelection(
        load=tuple(str(tmp_path / f"{name}.py") for name in kinds), autoload=False))
    pluggy_order: list[str] = []
    pm.hook.sgl_on_startup(settings=None, process="test", context=pluggy_order)
    assert pluggy_order == ["order_first", "order_plain_b", "order_plain_a", "order_last"]

    startup: list[str] = []
    pm.notify_startup(settings=None, process="test", context=startup)
    assert startup == pluggy_order
    called = [name for name, _ in pm.call_each("sgl_register_cache_policies",
                                               per_plugin={"register": _ignore})]
    assert called == pluggy_order


def test_a_hook_wrapper_on_a_plugin_by_plugin_hook_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wrapping.py"
    path.write_text("from sgl import hookimpl\n\n@hookimpl(wrapper=True)\n"
                    "def sgl_on_startup(settings, process, context):\n"
                    "    return (yield)\n")
    pm = create_plugin_manager(PluginSelection(load=(str(path),), autoload=False))
    with pytest.raises(PluginError, match="'wrapping' registered a hook wrapper for "
                                          "sgl_on_startup"):
        pm.notify_startup(settings=None, process="test", context=None)
