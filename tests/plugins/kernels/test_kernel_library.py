"""The kernel plugin's contract with the core: registered through the hook, found through the
plugins a process loaded (or not, and then said why), the ``sgl`` operators' CPU kernels held to
their pure-torch references, visible to torch's profiler."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl.kernels import cpu, ops, quant
from sgl.plugins import PluginSelection, create_plugin_manager

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def restore_plugins():
    """The test may point the kernels at another plugin manager; the installed plugins after."""
    yield
    cpu.use_plugins(None)


def test_hook_sgl_register_kernel_libraries() -> None:
    pm = create_plugin_manager(PluginSelection())
    entry = pm.registries.kernels.entry("cpu")
    assert entry.owner == "kernels-cpu"
    assert entry.target == "sgl_kernels_cpu.library:CpuKernelLibrary"
    from sgl.kernels.library import KernelLibrary

    assert issubclass(entry.load(), KernelLibrary)


@pytest.mark.usefixtures("restore_plugins", "one_torch_thread")
def test_without_the_plugin_the_layers_run_torch_and_say_why() -> None:
    """--disable-plugin kernels-cpu: no kernels at any level, the reason on the CPU-kernels
    line, and the layers' results those of torch."""
    from sgl.layers.packed_linear import linear, pack_weight

    had_kernels = cpu.load() is not None  # not with SGL_DISABLE_PLUGINS=kernels-cpu, say
    pm = create_plugin_manager(PluginSelection(disable=("kernels-cpu",)))
    cpu.use_plugins(pm)
    assert cpu.load() is None and cpu.cpu_isa() == "none" == cpu.detected_isa()
    assert cpu.describe_isa() == ("none (no CPU kernel library: install sgl-kernels-cpu "
                                  "(plugins/kernels/sgl-kernels-cpu))")
    weight, x = torch.randn(64, 32).bfloat16(), torch.randn(3, 32).bfloat16()
    packed = pack_weight(weight)
    assert packed is None or packed.kind == "onednn"
    torch.testing.assert_close(linear(x, weight, None, packed),
                               torch.nn.functional.linear(x, weight), rtol=0.02, atol=0.05)
    with cpu.recording() as tape:
        pass
    assert len(tape) == 0 and tape.names == []
    cpu.use_plugins(None)
    assert (cpu.load() is not None) == had_kernels


def test_cli_reports_the_disabled_plugin() -> None:
    out = subprocess.run([sys.executable, "-m", "sgl", "plugins", "--disable-plugin",
                          "kernels-cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("CPU kernels: ")
    if cpu.detected_isa() in cpu.kernel_levels() and cpu.requested_isa() == "auto":
        assert line.startswith("CPU kernels: none (") and "install sgl-kernels-cpu" in line


def _op_inputs(dtype: torch.dtype) -> dict[str, tuple]:
    """Arguments of every operator, at sizes of SmolLM2's layers (small batch)."""
    torch.manual_seed(7)
    t, h = 5, 64
    x = torch.randn(t, h).to(dtype)
    weight = (torch.rand(1, h) + 0.5).to(dtype)
    tokens, hq, hk, d = 3, 6, 2, 32
    slots, width = 128, 40
    k_pool = torch.randn(slots, hk, d).to(dtype)
    v_pool = torch.randn(slots, hk, d).to(dtype)
    table = torch.randperm(slots)[:tokens * width].view(tokens, width).contiguous()
    lens = torch.tensor([7, 1, 30])
    loc = table[torch.arange(tokens), lens - 1].contiguous()
    rope = torch.randn(100, 2 * 16).to(dtype)
    args = {
        "rmsnorm": (x, weight, 1e-5),
        "add_rmsnorm": (x, torch.randn(t, h).to(dtype), weight, 1e-5),
        "rmsnorm_heads": (x, weight[:, :16].contiguous(), 1e-5, 16),
        "silu_mul": (torch.randn(t, 2 * h).to(dtype),),
        "rotary": (x, 2, 32, 16, rope, torch.tensor([3, 99, 0, 5, 5])),
        "embedding": (torch.randn(50, h).to(dtype), torch.tensor([0, 49, 3])),
        "decode_attention": (torch.randn(tokens, hq * d).to(dtype),
                             torch.randn(tokens, hk * d).to(dtype),
                             torch.randn(tokens, hk * d).to(dtype), k_pool, v_pool, table,
                             torch.tensor([2, 0, 1]), lens, loc, hq, hk, d, d ** -0.5, 0.0, 0),
    }
    args["extend_attention"] = _extend_args(dtype, hq, hk, d, softcap=0.0, window=0)
    for fmt in ("q4", "q8"):  # x of either dtype (q6 has its kernel packed only: linear_qx16)
        args[f"linear_{fmt}"] = (x, *quant.quantize(fmt, torch.randn(70, h)), torch.randn(70))
    if cpu.packs_x16():  # the levels with its kernel (elsewhere it refuses: test_quantized_linear)
        args["linear_qx16"] = (x, quant.pack_x16("q8", *quant.quantize("q8", torch.randn(80, h))),
                               8, torch.randn(80))
    q, scales = quant.quantize("w8", torch.randn(70, h))
    args["linear_w8a8"] = (x, ops.pack_int8_weight(q), scales.view(-1), torch.randn(70))
    table_fmt = "q4" if dtype == torch.float32 else "q8"  # one layout per output dtype
    args["embedding_q"] = (*quant.quantize(table_fmt, torch.randn(50, h)),
                           torch.tensor([0, 49, 3, 3]), dtype)
    if dtype == torch.float32:
        args["argmax"] = (torch.randn(4, 1000),)
        args["linear_f32"] = (x, ops.pack_f32_weight(torch.randn(70, h)), 70, torch.randn(70))
    else:
        args["linear_bf16"] = (x, ops.pack_bf16_weight(torch.randn(70, h).bfloat16()), 70,
                               torch.randn(70))
    return args


def _extend_args(dtype: torch.dtype, hq: int, hk: int, d: int, softcap: float,
                 window: int) -> tuple:
    """Three sequences: on a cached prefix, fresh and longer than a key block, and empty."""
    prefix, extend = torch.tensor([5, 0, 3]), torch.tensor([7, 70, 0])
    slots = 256
    table = torch.randperm(slots)[:3 * 80].view(3, 80).contiguous()
    starts = torch.cumsum(extend, 0) - extend
    tokens = int(extend.sum())
    return (torch.randn(tokens, hq * d).to(dtype), torch.randn(slots, hk, d).to(dtype),
            torch.randn(slots, hk, d).to(dtype), table, torch.tensor([2, 0, 1]),
            starts.contiguous(), prefix, extend, hq, hk, d, d ** -0.5, softcap, window)


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernel_isa")
def test_every_operator_matches_its_reference(dtype: torch.dtype) -> None:
    """``torch.ops.sgl.X`` on CPU runs the plugin's kernel (a recorded call); its result is the
    core's pure-torch reference to rounding, including what it writes into its arguments."""
    args = _op_inputs(dtype)
    tested = set()
    for name, op_args in args.items():
        mine, theirs = [_clone(a) for a in op_args], [_clone(a) for a in op_args]
        with cpu.recording() as tape:
            got = getattr(torch.ops.sgl, name)(*mine)
        assert len(tape) >= 1, f"{name} did not run the plugin's kernel"
        expected = ops.REFERENCES[name](*theirs)
        got_all = got if isinstance(got, tuple) else (got,)
        expected_all = expected if isinstance(expected, tuple) else (expected,)
        tol = {"rtol": 0.02, "atol": 0.05} if dtype == torch.bfloat16 else {"rtol": 1e-5,
                                                                            "atol": 1e-5}
        for g, e in zip(got_all, expected_all, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype, name
            if g.dtype == torch.int64:
                assert torch.equal(g, e), name
            else:
                torch.testing.assert_close(g.float(), e.float(), **tol, msg=name)
        for a, b in zip(mine, theirs):  # the pools decode_attention writes into
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0, msg=name)
        tested.add(name)
    assert tested == set(args)
    untested = set() if cpu.packs_x16() else {"linear_qx16"}  # refused here, and tested so
    assert set(ops.SCHEMAS) - untested == {n for d in (torch.float32, torch.bfloat16)
                                           for n in _op_inputs(d)}  # every operator is tested


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [((9, 3), 64), ((4, 4), 32), ((8, 1), 128), ((32, 2), 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 3.0), (70, 2.0)])
@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads")
def test_extend_attention_matches_its_reference(dtype: torch.dtype, heads: tuple[int, int],
                                                d: int, window: int, softcap: float) -> None:
    """Prefill attention on cached prefixes: grouped heads, windows (inside one key block and
    across two), soft-capping, on one kernel thread and on two."""
    torch.manual_seed(heads[0] + d + window)
    args = _extend_args(dtype, heads[0], heads[1], d, softcap, window)
    expected = ops.extend_attention(*args)
    tol = {"rtol": 0.02, "atol": 0.02} if dtype == torch.bfloat16 else {"rtol": 1e-5,
                                                                        "atol": 1e-5}
    for threads in (1, 2):
        cpu.set_threads(threads)
        got = torch.ops.sgl.extend_attention(*args)
        torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [((9, 3), 64), ((8, 1), 128)])
@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads")
def test_attention_with_peaked_scores(dtype: torch.dtype, heads: tuple[int, int],
                                      d: int) -> None:
    """Scores scaled up so that a few keys carry each row: then the probabilities' pairing
    with the V rows (the bfloat16 weighted sums take keys two by two) shows in the output,
    where flat attention averages a mix-up away."""
    torch.manual_seed(d)
    args = list(_extend_args(dtype, heads[0], heads[1], d, softcap=0.0, window=0))
    args[11] = 1.0  # the scale: d ** 0.5 times the usual
    tol = {"rtol": 0.02, "atol": 0.02} if dtype == torch.bfloat16 else {"rtol": 1e-5,
                                                                        "atol": 1e-5}
    decode = list(_op_inputs(dtype)["decode_attention"])
    decode[12] = 1.0
    for threads in (1, 2):
        cpu.set_threads(threads)
        got = torch.ops.sgl.extend_attention(*args)
        torch.testing.assert_close(got.float(), ops.extend_attention(*args).float(), **tol)
        mine, theirs = [_clone(a) for a in decode], [_clone(a) for a in decode]
        torch.testing.assert_close(torch.ops.sgl.decode_attention(*mine).float(),
                                   ops.decode_attention(*theirs).float(), **tol)


def _tree_bits(parents: list[int]) -> list[int]:
    """Each node's ancestors-or-self as bits, the int32 pattern ``tree_bits`` takes."""
    bits = []
    for i, parent in enumerate(parents):
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return [b - (1 << 32) if b >= 1 << 31 else b for b in bits]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [((9, 3), 64), ((8, 1), 128), ((32, 2), 16)])
@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads")
def test_extend_attention_over_token_trees(dtype: torch.dtype, heads: tuple[int, int],
                                           d: int) -> None:
    """Token trees (a speculative draft's verification): a 7-node tree on a cached prefix, a
    forest of 32 nodes (bit 31 used) and a plain 70-token causal sequence in one call; each
    tree row attends its prefix, its ancestors and itself, as the reference does, and the
    result differs from causal attention over the same rows (the mask is not ignored)."""
    torch.manual_seed(heads[0] + d)
    hq, hk = heads
    prefix, extend = torch.tensor([5, 0, 3]), torch.tensor([7, 70, 32])
    table = torch.randperm(256)[:3 * 80].view(3, 80).contiguous()
    starts = torch.cumsum(extend, 0) - extend
    small = [-1, 0, 0, 1, 3, 3, 2]
    forest = [-1] + [int(torch.randint(-1, i, ()).item()) for i in range(1, 32)]
    bits = torch.tensor(_tree_bits(small) + [-1] * 70 + _tree_bits(forest), dtype=torch.int32)
    args = (torch.randn(109, hq * d).to(dtype), torch.randn(256, hk, d).to(dtype),
            torch.randn(256, hk, d).to(dtype), table, torch.tensor([2, 0, 1]),
            starts.contiguous(), prefix, extend, hq, hk, d, d ** -0.5, 0.0, 0)
    expected = ops.extend_attention(*args, bits)
    causal = ops.extend_attention(*args)
    tree_rows = torch.cat([torch.arange(1, 7), torch.arange(78, 109)])
    assert not torch.allclose(expected[tree_rows].float(), causal[tree_rows].float(), atol=0.05)
    torch.testing.assert_close(expected[7:77], causal[7:77])  # -1: plain causal rows
    tol = {"rtol": 0.02, "atol": 0.02} if dtype == torch.bfloat16 else {"rtol": 1e-5,
                                                                        "atol": 1e-5}
    for threads in (1, 2):
        cpu.set_threads(threads)
        with cpu.recording() as tape:
            got = torch.ops.sgl.extend_attention(*args, bits)
        assert len(tape) == 1  # the kernel ran, not a fallback
        torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.usefixtures("kernel_isa")
def test_operators_refuse_bad_arguments_with_clear_errors() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="sgl::silu_mul: x must be 2-D"):
        torch.ops.sgl.silu_mul(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="sgl::rmsnorm: weight must be \\[1, 64\\]"):
        torch.ops.sgl.rmsnorm(x, torch.randn(1, 32), 1e-5)
    with pytest.raises(ValueError, match="sgl::linear_f32: packed holds"):
        torch.ops.sgl.linear_f32(x, torch.randn(10), 70, None)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        torch.ops.sgl.silu_mul(torch.randn(2, 8).half())
    with pytest.raises(IndexError, match="outside the embedding table of 50 rows"):
        torch.ops.sgl.embedding(torch.randn(50, 8), torch.tensor([50]))
    args = list(_extend_args(torch.float32, 6, 2, 32, 0.0, 0))
    args[5] = torch.tensor([0, 7, 78])  # the third sequence starts past q's 77 rows
    with pytest.raises(IndexError, match="sequence 2's tokens lie outside q's 77 rows"):
        torch.ops.sgl.extend_attention(*args)
    args = list(_extend_args(torch.float32, 6, 2, 32, 0.0, 0))
    args[8] = 5  # 5 query heads over 2 KV heads
    with pytest.raises(ValueError, match="not a shape the kernel takes"):
        torch.ops.sgl.extend_attention(*args)
    args = list(_extend_args(torch.float32, 6, 2, 32, 0.0, 0))
    bits = torch.full((77,), -1, dtype=torch.int32)
    bits[10] = 1  # a row of the 70-token second sequence: a tree the kernel cannot take
    with pytest.raises(ValueError, match="token tree of 70 new tokens; the kernel takes trees "
                                         "of at most 32"):
        torch.ops.sgl.extend_attention(*args, bits)
    with pytest.raises(ValueError, match="tree_bits must have one value per row of q"):
        torch.ops.sgl.extend_attention(*args, bits[:5])


@pytest.mark.usefixtures("kernel_isa")
def test_kernels_show_in_torch_profiler() -> None:
    x = torch.randn(8, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.sgl.silu_mul(x)
        torch.ops.sgl.rmsnorm(x, torch.ones(1, 128), 1e-6)
    names = {event.key for event in prof.key_averages()}
    assert {"sgl::silu_mul", "sgl::rmsnorm"} <= names


def test_references_run_without_the_plugin_on_another_device() -> None:
    """The reference is the dispatcher's kernel for any device without its own: here, the
    meta device (shapes only), as a GPU without a kernel plugin would run it."""
    x = torch.empty(3, 64, device="meta")
    out = torch.ops.sgl.rmsnorm(x, torch.empty(1, 64, device="meta"), 1e-6)
    assert out.device.type == "meta" and out.shape == (3, 64)
    out = torch.ops.sgl.silu_mul(torch.empty(3, 64, device="meta"))
    assert out.shape == (3, 32)


def test_installed_without_a_compiler_runs_torch_and_says_why(tmp_path) -> None:
    """The real install where no compiler works (CC=CXX=false): the package installs without
    its compiled part, and ``sgl plugins`` (run with that install first on the path) names it
    and says what to do."""
    import os
    import shutil

    had_kernels = cpu.load() is not None
    source = tmp_path / "src"
    shutil.copytree(ROOT / "plugins/kernels/sgl-kernels-cpu", source,
                    ignore=shutil.ignore_patterns("build", "_C*.so", "*.egg-info"))
    env = {**os.environ, "CC": "false", "CXX": "false"}
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                            "--no-build-isolation", "--no-deps", "--no-index", "--target",
                            str(target), str(source)], capture_output=True, text=True, env=env,
                           timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (target / "sgl_kernels_cpu" / "library.py").exists()
    assert not list((target / "sgl_kernels_cpu").glob("_C*"))
    env = {**env, "PYTHONPATH": str(target)}
    # the editable install's import hook would still find the checkout's package: drop it
    script = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if "
              "'sgl_kernels_cpu' not in getattr(f, '__module__', '') + repr(f)]; "
              "sys.argv = ['sgl', 'plugins']; runpy.run_module('sgl', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("CPU kernels: ")
    if had_kernels:  # else they are off for another reason, which the line gives instead
        assert line.startswith("CPU kernels: none (")
        assert "installed without its compiled kernels" in line and "reinstall" in line


#: what only AVX-512 code holds: its registers (zmm, the mask registers k0-k7, xmm/ymm16-31) and
#: EVEX-only instructions that take xmm/ymm operands
AVX512_ONLY = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{1to|vpternlog|vpermt2|"
                         r"vpermi2|vprol|vpror|vpmov[dqw][bwd]|vrndscale|vscalef|vcvtne|vdpbf16|"
                         r"vmovdqu(8|16|32|64)|vmovdqa(32|64)|"
                         r"vfixupimm|vgetexp|vgetmant|vrange|vreduce|vpcompress|vpexpand")


def test_the_avx2_level_holds_no_avx512_instruction(tmp_path) -> None:
    """The kernels of the avx2 level (kernels_avx2.c), the code every level runs (the
    quantized kernels, the pool, the dispatch of calls) and the emulated AVX-512 kernels must
    run on a CPU without AVX-512:
    compiled as setup.py compiles them, their object code holds no AVX-512 register or
    instruction. (The suite runs them on this CPU, which has AVX-512 and so would not fault;
    this checks what an AVX2-only CPU would be given.)"""
    import ast
    import shutil

    tools = {name: shutil.which(name) for name in ("gcc", "objdump")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (binutils) to read the object code")
    plugin = ROOT / "plugins" / "kernels" / "sgl-kernels-cpu"
    setup_py = ast.parse((plugin / "setup.py").read_text())
    flags = next(ast.literal_eval(node.value) for node in ast.walk(setup_py)
                 if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", "") == "C_FLAGS" for t in node.targets))
    # the emulated copy of the AVX-512 kernels (only where SIMDe is here, else it compiles to an
    # empty table) runs on AVX2 CPUs too; -O0 for it only to compile it in seconds, not a minute
    # (the instruction set comes from its target pragma, not from the optimisation level)
    emulated = Path("/usr/include/simde/x86/avx512.h").exists()
    sources = ["kernels_avx2.c", "kernels_quant_avx2.c", "pool.c", "run_op.c",
               "kernels_avx512_emulated.c"]
    for source in sources:
        obj = tmp_path / f"{source}.o"
        extra = ["-O0"] if source == "kernels_avx512_emulated.c" else []
        subprocess.run([tools["gcc"], *flags, *extra, "-I", str(plugin / "csrc"), "-c",
                        str(plugin / "csrc" / source), "-o", str(obj)], check=True)
        code = subprocess.run([tools["objdump"], "-d", str(obj)], check=True,
                              capture_output=True, text=True).stdout
        if source.startswith("kernels") and (emulated or "emulated" not in source):
            assert "vfmadd" in code  # the disassembly is real code
        found = sorted({m.group(0) for m in AVX512_ONLY.finditer(code)})
        assert not found, f"{source} holds AVX-512 code: {found}"


def _emulated_level() -> str:
    """The lowest level above this CPU's that the library emulates (the test is skipped, and
    so reported, where it emulates none)."""
    emulated = cpu.emulated_isa_levels()
    if not emulated:
        pytest.skip("this build of sgl-kernels-cpu emulates no level above this CPU's "
                    f"({cpu.describe_isa()}): it was built without SIMDe's headers (Debian's "
                    "libsimde-dev), or the CPU has every level")
    return emulated[-1]


def test_a_level_above_the_cpu_runs_emulated_only_when_asked() -> None:
    """A cap above the CPU's level runs the CPU's own level, unless emulation is asked for;
    then the level's kernels run in software, say so, and compute what torch computes (on a CPU
    without the level, its compiled kernel would stop the process with an illegal
    instruction)."""
    level = _emulated_level()
    torch.manual_seed(3)
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    try:
        assert cpu.set_isa(level, emulate=False) == cpu.detected_isa()
        assert not cpu.isa_emulated()
        assert cpu.set_isa(level, emulate=True) == level
        assert cpu.isa_emulated()
        assert "emulated in software" in cpu.describe_isa()
        packed = cpu.pack_bf16_weight(weight)
        with cpu.recording() as tape:
            y = torch.ops.sgl.linear_bf16(x, packed, 96, None)
        assert tape.names == ["sgl_linear_bf16_amx" if level == "amx"
                              else "sgl_linear_bf16_avx512"]
        torch.testing.assert_close(y.float(), x.float() @ weight.float().T, rtol=0.02,
                                   atol=0.05)
    finally:
        cpu.set_isa("auto", emulate=None)
    assert not cpu.isa_emulated()


def test_sgl_cpu_emulate_reaches_the_cli() -> None:
    level = _emulated_level()
    env = {"SGL_CPU_ISA": level, "SGL_CPU_EMULATE": "1"}
    out = subprocess.run([sys.executable, "-m", "sgl", "plugins"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(f"CPU kernels: {level} (") and "emulated in software" in line
    out = subprocess.run([sys.executable, "-m", "sgl", "plugins"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "SGL_CPU_ISA": level,
                                                      "SGL_CPU_EMULATE": "0"})
    assert out.stdout.strip().splitlines()[-1].startswith(f"CPU kernels: {cpu.detected_isa()} (")


@pytest.mark.parametrize("n", [16, 96, 1000, 4100])
@pytest.mark.usefixtures("kernel_isa", "restore_kernel_threads", "one_torch_thread")
def test_the_pool_runs_every_chunk_once_at_any_thread_count(n: int) -> None:
    """The pool deals a job's chunks out in one share per thread and lets a thread finish the
    others' shares: every column of a matmul, and every sequence of a decode attention, is
    computed (the outputs start as uninitialized memory), with fewer chunks than threads,
    shares of unequal size, and more threads than this machine has cores."""
    torch.manual_seed(n)
    x = torch.randn(5, 64)
    weight = torch.randn(n, 64)
    decode = _op_inputs(torch.bfloat16)["decode_attention"]
    for threads in (1, 2, 3, 5, 8):
        cpu.set_threads(threads)
        for dtype, pack, op in ((torch.bfloat16, cpu.pack_bf16_weight, torch.ops.sgl.linear_bf16),
                                (torch.float32, cpu.pack_f32_weight, torch.ops.sgl.linear_f32)):
            got = op(x.to(dtype), pack(weight.to(dtype)), n, None)
            want = x.to(dtype).float() @ weight.to(dtype).float().t()
            torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.05)
        mine, theirs = [_clone(a) for a in decode], [_clone(a) for a in decode]
        torch.testing.assert_close(torch.ops.sgl.decode_attention(*mine).float(),
                                   ops.decode_attention(*theirs).float(), rtol=0.02, atol=0.02)


def _largest_share(n: int, chunk: int, threads: int) -> int:
    """Items in the largest share when the pool deals n items out in chunks of ``chunk``
    (pool.c, sgl_parallel_for: one contiguous run of chunks per thread)."""
    chunks = -(-n // chunk)
    shares = min(chunks, threads)
    return max(min(chunks * (s + 1) // shares * chunk, n) - chunks * s // shares * chunk
               for s in range(shares))


def test_chunks_share_the_items_evenly() -> None:
    """The matmuls' chunk size deals their column panels out evenly: SmolLM2's o and down
    projections (18 panels) on two threads in claims of 2 gave shares of 8 and 10 panels, and
    ran 10% slower than the evenly shared shapes. Among the sizes from the cap down to half of
    it, the chosen one leaves the smallest largest share, and the cap itself where that is
    even."""
    from sgl_kernels_cpu.library import compiled_path

    path = compiled_path()
    if path is None:
        pytest.skip("sgl-kernels-cpu was installed without its compiled library")
    choose = ctypes.CDLL(str(path)).sgl_balanced_chunk
    choose.restype, choose.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    assert _largest_share(18, 2, 2) == 10  # what the old choice gave
    assert _largest_share(18, choose(18, 2, 2), 2) == 9
    assert choose(96, 4, 2) == 4 and choose(30, 3, 2) == 3  # already even: unchanged
    for threads in (1, 2, 3, 4, 7, 16):
        for n in (1, 5, 18, 19, 30, 48, 96, 97, 1536):
            cap = max(1, min(4, n // (4 * threads)))
            for cap in (cap, max(1, n // (4 * threads))):
                got = choose(n, cap, threads)
                assert cap // 2 <= got <= cap or got == 1
                best = min(_largest_share(n, c, threads)
                           for c in range(max(1, -(-cap // 2)), cap + 1))
                assert _largest_share(n, got, threads) == best, (n, cap, threads, got)


POOL_ON_ONE_CORE = """
import os, sys, torch
from sgl.kernels import cpu
level = sys.argv[1]
assert cpu.set_isa(level, emulate=level in cpu.emulated_isa_levels()) == level
os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[0]])
torch.set_num_threads(1)
cpu.set_threads(2)
torch.manual_seed(0)
x, w = torch.randn(32, 576).bfloat16(), torch.randn(4096, 576).bfloat16()
packed, want = cpu.pack_bf16_weight(w), x.float() @ w.float().t()
for _ in range(int(sys.argv[2])):
    torch.testing.assert_close(torch.ops.sgl.linear_bf16(x, packed, 4096, None).float(), want,
                               rtol=0.02, atol=0.1)
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_two_kernel_threads_on_one_core_finish_each_others_shares(kernel_isa: str) -> None:
    """Two kernel threads on one core: the OS runs one at a time and preempts either in the
    middle of its share, so each job is finished by whichever thread runs. The matmuls of this
    level (200; 20 where AMX is emulated) come out right and none hangs (the timeout would show
    one)."""
    reps = 20 if kernel_isa in cpu.emulated_isa_levels() else 200
    done = subprocess.run([sys.executable, "-c", POOL_ON_ONE_CORE, kernel_isa, str(reps)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
