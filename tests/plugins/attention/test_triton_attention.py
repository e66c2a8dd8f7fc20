"""The ``triton`` attention backend on the CPU, its kernels run by triton's interpreter, against
a float64 reference: ragged extend batches on cached prefixes, then decode; KV slots scattered
one by one (page size 1) or handed out in aligned runs of 16; grouped-query ratios 1, 4 and 8;
float32, float16 and bfloat16; sliding window, soft-capping and token trees. Then: a broken mask
is caught, a replayed decode reads only its tensors, the kernels compile for a CUDA GPU, the
plugin is registered, and a tiny Llama gives the torch backend's logits, also when sgl's CUDA-graph
runner replays its decode.

How the interpreter is switched on, and why in a child process: ``triton.jit`` decides whether it
compiles a function or hands it to the interpreter when it wraps the function, reading
``triton.knobs.runtime.interpret``, which reads ``TRITON_INTERPRET`` from the environment. The
plugin's kernels are wrapped when :mod:`sgl_attn_triton.kernels` is imported, but triton's own
library functions that they call (``tl.sum``, ``tl.max``, ``tl.cdiv``) are wrapped when triton
itself is first imported, and an interpreted kernel cannot call a compiled one. In one pytest
process for the whole suite, something may import triton before this module (this module does,
for the compile check), so setting the variable here would be too late, and setting it for the
whole process would change what every later import of triton gets. Instead the ``interpreter``
fixture starts one child process (``spawn``: a fresh interpreter) with the variable set, and
the checks in ``_triton_checks.py`` run there, each raising on a failure; the parent's
environment is restored as soon as the child has started.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from multiprocessing.pool import Pool
from pathlib import Path

import _triton_checks as checks
import pytest
import torch

from sgl.kvcache import KVPool, ReqToTokenPool
from sgl.plugins import create_plugin_manager
from sgl_attn_triton import kernels
from sgl_attn_triton.backend import TritonAttentionBackend
from sgl_testing import run_cli

@pytest.fixture(scope="module")
def interpreter() -> Iterator[Pool]:
    """A child process whose triton was imported under ``TRITON_INTERPRET=1`` (see the module
    doc): the environment variable is set only while the child starts."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = multiprocessing.get_context("spawn").Pool(1)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    with pool:
        yield pool


CASES = [  # query/KV heads (GQA ratio), dtype, page size, window, softcap, head_dim
    pytest.param((2, 2), torch.float32, 1, None, None, 16, id="ratio1-f32-page1"),
    pytest.param((8, 2), torch.float16, 16, 5, None, 64, id="ratio4-f16-page16-window-d64"),
    pytest.param((8, 1), torch.bfloat16, 1, None, 3.0, 16, id="ratio8-bf16-page1-softcap"),
    pytest.param((8, 1), torch.float32, 16, 4, 2.0, 16, id="ratio8-f32-page16-window-softcap"),
    pytest.param((4, 1), torch.float16, 16, None, None, 24, id="ratio4-f16-page16-d24"),
]


@pytest.mark.parametrize("heads,dtype,page,window,softcap,head_dim", CASES)
def test_extend_prefix_then_decode(interpreter: Pool, heads: tuple[int, int],
                                   dtype: torch.dtype, page: int, window: int | None,
                                   softcap: float | None, head_dim: int) -> None:
    """Ragged extend (prefixes 0..35, a sequence of one token), extend on the cached prefixes,
    then decode with 8 key splits (some empty), against float64; head sizes 16, 24 (padded to
    32) and 64."""
    interpreter.apply(checks.extend_prefix_then_decode,
                      (heads, dtype, page, window, softcap, head_dim))


def test_token_trees(interpreter: Pool) -> None:
    """A tree on a cached prefix, a forest without one and a plain chain in one batch; trees
    with a sliding window are refused."""
    interpreter.apply(checks.token_trees)


def test_a_broken_mask_is_caught(interpreter: Pool) -> None:
    interpreter.apply(checks.a_broken_mask_is_caught)


def test_decode_reads_only_its_graph_inputs(interpreter: Pool) -> None:
    interpreter.apply(checks.decode_reads_only_its_graph_inputs)


def test_tiny_llama_matches_the_torch_backend(interpreter: Pool, tmp_path: Path) -> None:
    interpreter.apply(checks.tiny_llama_matches_torch, (str(tmp_path),))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_gpu(tmp_path: Path) -> None:
    """The same checks with the kernels compiled, in this process: every case against float64,
    the trees, and the tiny Llama against the torch backend, its decode captured into real CUDA
    graphs."""
    for case in CASES:
        checks.extend_prefix_then_decode(*case.values, device="cuda")
    checks.token_trees(device="cuda")
    checks.tiny_llama_matches_torch(str(tmp_path), device="cuda")


def test_kernels_compile_for_a_cuda_gpu(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """Without a GPU: triton's code generator turns every kernel into sm_90 PTX and machine
    code (the interpreter does not check what the compiler refuses, such as small dots or
    non-constexpr globals)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset
    assert not kernels.interpreting()  # this process imported triton without the interpreter
    blocks = {"HEAD_DIM": 64, "V_DIM": 64, "BLOCK_D": 64, "BLOCK_DV": 64, "BLOCK_N": 32,
              "SOFTCAP": True, "WINDOW": True, "PRECISION": "tf32",
              "DOT_F32": False}
    constants = {
        kernels._decode_split: {**blocks, "GROUP": 4, "BLOCK_H": 16, "SPLITS": 8},
        kernels._decode_merge: {"V_DIM": 64, "BLOCK_DV": 64, "SPLITS": 8},
        kernels._extend: {**blocks, "GROUP": 4, "BLOCK_M": 32, "TREE": True},
    }
    pointers = {"Table": "*i64", "Rows": "*i64", "SeqLens": "*i64", "QStarts": "*i64",
                "PrefixLens": "*i64", "ExtendLens": "*i64", "TreeStarts": "*i64",
                "Tree": "*u8", "MidAcc": "*fp32", "MidStats": "*fp32"}


    def kind(name: str, consts: dict[str, object]) -> str:
        if name in consts:
            return "constexpr"
        if name[0].isupper():  # a tensor: q, k, v and the output in bfloat16
            return pointers.get(name, "*bf16")
        return "fp32" if name in ("scale", "softcap") else "i32"  # strides, window

    for fn, consts in constants.items():
        signature = {name: kind(name, consts) for name in fn.arg_names}
        binary = triton.compile(ASTSource(fn, signature, consts),
                                target=GPUTarget("cuda", 90, 32))
        assert binary.asm["cubin"]


def test_unsupported_setups_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import sgl_attn_triton.backend

    monkeypatch.setattr(sgl_attn_triton.backend, "interpreting", lambda: False)
    pools = {"kv_pool": KVPool(size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                               dtype=torch.float32, device=torch.device("cpu")),
             "req_to_token_pool": ReqToTokenPool(max_requests=1, max_context_len=4,
                                                 device=torch.device("cpu"))}
    with pytest.raises(RuntimeError, match=r"CUDA GPUs.*--attention-backend torch.*"
                                           r"TRITON_INTERPRET=1"):
        TritonAttentionBackend(**pools, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not on 'mps'"):
        TritonAttentionBackend(**pools, device=torch.device("mps"))
    pools["kv_pool"] = KVPool(size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                              dtype=torch.float64, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="float32, float16, bfloat16, not float64"):
        TritonAttentionBackend(**pools, device=torch.device("cuda"))


def test_plugin_is_installed() -> None:
    pm = create_plugin_manager()
    record = pm.records["attn-triton"]
    assert record.available and record.distribution == "sgl-attn-triton"
    assert "sgl_register_attention_backends" in record.hooks
    entry = pm.registries.attention.entry("triton")
    assert entry.owner == "attn-triton" and entry.load() is TritonAttentionBackend
    listed = {p["name"]: p for p in json.loads(run_cli(["plugins", "--json"]).stdout)}
    assert listed["attn-triton"]["available"]
    from sgl_attn_triton import plugin

    assert "CUDA GPUs" in plugin.SGL_NOTE and "TRITON_INTERPRET=1" in plugin.SGL_NOTE
    # sgl plugins says where it runs
    assert record.note == plugin.SGL_NOTE == listed["attn-triton"]["note"]
    assert f"    note: {plugin.SGL_NOTE}" in run_cli(["plugins"]).stdout
