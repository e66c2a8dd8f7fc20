"""The dependency order of the code, as pyproject.toml's import-linter contracts state it: in
the core, the CLI over the entry points over the server over the engine over the contracts
over the plugin machinery, with no cycles between the modules of a package; plugins import the
core and never each other (a model plugin may build on the Llama plugin's decoder); the core
never imports a plugin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:  # a changed copy of some packages, found before the installed
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


def test_the_code_keeps_the_import_contracts() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("package,module,added,broken", [
    ("core/sgl", "engine/scheduler.py", "import sgl.cli", "sgl.engine.scheduler -> sgl.cli"),
    ("core/sgl", "layers/norm.py", "import sgl_kernels_cpu",
     "sgl.layers.norm -> sgl_kernels_cpu"),
    ("plugins/frontends/sgl-frontend-anthropic/sgl_frontend_anthropic", "routes.py",
     "import sgl_frontend_openai.common",
     "sgl_frontend_anthropic.routes -> sgl_frontend_openai.common"),
], ids=["engine-imports-cli", "core-imports-a-plugin", "plugin-imports-a-plugin"])
def test_an_import_against_the_order_breaks_a_contract(tmp_path: Path, package: str, module: str,
                                                       added: str, broken: str) -> None:
    copy = tmp_path / Path(package).name
    shutil.copytree(ROOT / package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with (copy / module).open("a") as f:
        f.write(f"\n{added}  # against the order\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout, result.stdout
