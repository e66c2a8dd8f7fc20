"""Settings: precedence flag > env > file > default, plugin options, and rejection of bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from sgl.config import ConfigError, load_settings, read_config_file
from sgl_testing import run_cli


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("port: 1111\ndtype: bfloat16\nmax_running_requests: 7\n")
    env = {"SGL_PORT": "2222", "SGL_DTYPE": "float32"}
    s = load_settings(cli={"port": 3333}, cli_flags={"port": "--port"}, env=env, config_file=cfg)
    assert (s.port, s.sources["port"]) == (3333, "flag --port")
    assert (s.dtype, s.sources["dtype"]) == ("float32", "env SGL_DTYPE")
    assert (s.max_running_requests, s.sources["max_running_requests"]) == (7, f"file {cfg}")
    assert (s.host, s.sources["host"]) == ("127.0.0.1", "default")

    s = load_settings(env=env, config_file=cfg)
    assert (s.port, s.sources["port"]) == (2222, "env SGL_PORT")
    s = load_settings(env={}, config_file=cfg)
    assert (s.port, s.sources["port"]) == (1111, f"file {cfg}")
    assert load_settings(env={}).port == 30000


def test_toml_file_and_plugin_table(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class Knobs:
        depth: int = field(default=3, metadata={"help": "how deep"})
        label: str = "x"

    cfg = tmp_path / "deploy.toml"
    cfg.write_text('port = 4444\n\n[plugins.knobby]\ndepth = 9\nlabel = "file"\n')
    s = load_settings(env={"SGL_KNOBBY_LABEL": "env"}, config_file=cfg,
                      plugin_classes={"knobby": Knobs})
    assert s.port == 4444
    assert s.plugin_settings["knobby"] == Knobs(depth=9, label="env")
    assert s.sources["plugins.knobby.label"] == "env SGL_KNOBBY_LABEL"
    s = load_settings(plugin_cli={"knobby": {"depth": 1}}, env={}, config_file=cfg,
                      plugin_classes={"knobby": Knobs})
    assert s.plugin_settings["knobby"].depth == 1


@pytest.mark.parametrize("text,message", [
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("prot: 1\n", "did you mean 'port'?"),
    ("port: abc\n", "invalid value 'abc' for 'port': expected an integer"),
    ("port: 70000\n", "invalid value 70000 for 'port'"),
    ("dtype: float64\n", "invalid value 'float64' for 'dtype'"),
    ("kernel_threads: 0\n", "invalid value 0 for 'kernel_threads': expected at least 1"),
    ("plugins:\n  nobody:\n    x: 1\n", "unknown plugin 'nobody'"),
    ("- just\n- a list\n", "expected a mapping"),
    ("port: [unclosed\n", "cannot parse"),
])
def test_bad_config_file_names_key_value_and_file(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(env={}, config_file=cfg)
    assert message in str(err.value)
    assert str(cfg) in str(err.value)


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="env SGL_MEM_FRACTION_STATIC: invalid value 'lots'"):
        load_settings(env={"SGL_MEM_FRACTION_STATIC": "lots"})


def test_unsupported_or_missing_file(tmp_path: Path) -> None:
    (tmp_path / "x.ini").write_text("a=1")
    with pytest.raises(ConfigError, match="unsupported config format"):
        read_config_file(tmp_path / "x.ini")
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_file(tmp_path / "nope.yaml")


def test_serve_with_bad_key_fails_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("port: 30001\nmax_tokens_total: 5\n")
    result = run_cli(["serve", "--config", str(cfg)])
    assert result.returncode == 2
    assert "unknown key 'max_tokens_total'" in result.stderr and str(cfg) in result.stderr
    assert "Traceback" not in result.stderr


def test_config_show_reports_sources(tmp_path: Path) -> None:
    cfg = tmp_path / "deploy.toml"
    cfg.write_text('port = 1111\nhost = "0.0.0.0"\nlog_level = "debug"\n')
    result = run_cli(["config", "show", "--json", "--config", str(cfg), "--port", "3333"],
                     env={"SGL_HOST": "127.0.0.2"})
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["port"] == {"value": 3333, "source": "flag --port"}
    assert shown["host"] == {"value": "127.0.0.2", "source": "env SGL_HOST"}
    assert shown["log_level"] == {"value": "debug", "source": f"file {cfg}"}
    assert shown["page_size"] == {"value": 1, "source": "default"}
    text = run_cli(["config", "show", "--port", "3333"]).stdout
    assert "port" in text and "(flag --port)" in text


def test_config_show_hides_the_api_key() -> None:
    result = run_cli(["config", "show", "--json", "--api-key", "hunter2-key"])
    assert result.returncode == 0, result.stderr
    assert "hunter2-key" not in result.stdout
    assert json.loads(result.stdout)["api_key"] == {"value": "<set>", "source": "flag --api-key"}
    text = run_cli(["config", "show"], env={"SGL_API_KEY": "hunter2-key"}).stdout
    assert "hunter2-key" not in text and "<set>" in text and "(env SGL_API_KEY)" in text
    assert json.loads(run_cli(["config", "show", "--json"]).stdout)["api_key"]["value"] is None


def test_plugin_options_in_help_flags_and_file(tmp_path: Path) -> None:
    plugin = tmp_path / "knobs.py"
    plugin.write_text(
        "from dataclasses import dataclass, field\nfrom sgl import hookimpl\n\n"
        "@dataclass(frozen=True)\nclass Settings:\n"
        "    depth: int = field(default=3, metadata={'help': 'How deep to go.'})\n\n"
        "@hookimpl\ndef sgl_add_config():\n    return Settings\n")
    help_text = run_cli(["serve", "--help", "--plugin", str(plugin)]).stdout
    assert "Options of plugin knobs:" in help_text
    assert "--knobs-depth INTEGER" in help_text and "How deep to go." in help_text

    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"load_plugins: [{plugin}]\nplugins:\n  knobs:\n    depth: 5\n")
    shown = json.loads(run_cli(["config", "show", "--json", "--config", str(cfg)]).stdout)
    assert shown["plugins.knobs.depth"]["value"] == 5
    shown = json.loads(run_cli(["config", "show", "--json", "--config", str(cfg),
                                "--knobs-depth", "8"]).stdout)
    assert shown["plugins.knobs.depth"] == {"value": 8, "source": "flag --knobs-depth"}
    bad = run_cli(["config", "show", "--config", str(cfg), "--knobs-depth", "deep"])
    assert bad.returncode == 2 and "--knobs-depth" in bad.stderr


def test_deterministic_inference_refuses_what_depends_on_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's --enable-deterministic-inference: accepted with every --int8-activations value
    (a row's rounding is its own, so none depends on the batch), and a clear error, naming the
    flag, off the CPU."""
    settings = load_settings(env={}, cli={"enable_deterministic_inference": True})
    assert settings.enable_deterministic_inference and settings.int8_activations == "auto"
    for mode in ("auto", "on", "off"):
        assert load_settings(env={}, cli={"enable_deterministic_inference": True,
                                          "int8_activations": mode}).int8_activations == mode
    result = run_cli(["serve", "--enable-deterministic-inference", "--device", "cuda"])
    assert result.returncode != 0
    if torch.cuda.is_available():  # refused: the GPU attention kernels are not batch-invariant
        assert "--enable-deterministic-inference" in result.stderr
    else:  # refused first for the missing device
        assert "--device" in result.stderr
    assert "Traceback" not in result.stderr
    # a stand-in for a GPU where there is none (a fake: the refusal cannot be caused otherwise)
    import sgl.devices

    monkeypatch.setattr(sgl.devices, "resolve_device", lambda name: torch.device("cuda"))
    with pytest.raises(ConfigError, match="enable_deterministic_inference.*on cuda the "
                                          "attention backends' sums depend on the batch"):
        load_settings(env={}, cli={"enable_deterministic_inference": True, "device": "cuda"})
