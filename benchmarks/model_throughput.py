"""Prefill and decode throughput of sgl's model runner next to transformers' ``generate``.

Runs the bundled SmolLM2-135M-Instruct GGUF (dequantized to the dtype under test) in both, in
one process, with the same prompts, dtype and number of threads::

    .venv/bin/python benchmarks/model_throughput.py                 # the table in docs/benchmarks.md
    .venv/bin/python benchmarks/model_throughput.py --threads 1,2 --busy   # threads, other core busy
    SGL_CPU_ISA=avx512_bf16 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 \
        .venv/bin/python benchmarks/model_throughput.py           # both engines as without AMX

What is measured (every case ``--reps`` times, sgl and transformers alternating; the median):

* **prefill**: one ``--prefill-len``-token prompt (batch 1) up to the logits of its last token.
  sgl: building the batch, the forward pass and the last token's logits. transformers:
  ``generate(max_new_tokens=1)`` from the call to the first logits-processor call.
* **decode**: ``batch`` prompts of ``--decode-prompt-len`` tokens (equal lengths, so transformers
  needs no padding), then ``--decode-tokens`` greedy tokens each, EOS ignored. Only the steps
  after the first token count: tokens/s = ``batch * (decode_tokens - 1)`` / the time from the
  first token's logits to the last one's. sgl: per step, building the decode batch, the forward
  pass, the logits and the greedy pick. transformers: the time between the first and the last
  call of a logits processor inside ``generate``.

``match`` is the share of sequences whose greedy tokens are identical in both.

Threads: with ``--threads N`` each engine runs on N threads the way it runs by default.
transformers: ``torch.set_num_threads(N)``. sgl: as ``sgl serve --kernel-threads N`` does,
torch on one thread (its OpenMP threads spin at barriers, see docs/benchmarks.md) and sgl's CPU
kernels (the bfloat16 matmul, decode attention) on N threads of their own.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

TEXT = (
    "The river town woke slowly. Fishermen pushed their boats into the grey water while the "
    "baker stacked warm loaves on the counter and argued with the miller about the price of "
    "flour. Children ran along the harbour wall, counting gulls and shouting at the ferry as it "
    "turned towards the far bank. In the library the old clock ticked above shelves of maps, "
    "letters and ledgers that nobody had opened for years, and the librarian, who had read most "
    "of them anyway, made tea and watched the fog lift from the hills. By noon the market was "
    "full: cheese from the valley farms, apples, copper pans, wool, and a man selling maps of "
    "places that did not exist. "
)
DOCS_BEGIN = "<!-- model_throughput:begin -->"
DOCS_END = "<!-- model_throughput:end -->"


@dataclass
class Case:
    kind: str  # "prefill" or "decode"
    batch: int
    sgl: list[float] = field(default_factory=list)  # tokens/s per repetition
    hf: list[float] = field(default_factory=list)
    match: list[float] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--threads", default="1",
                   help="comma-separated thread counts: transformers' torch threads, sgl's "
                        "kernel threads (sgl's torch stays on 1)")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--busy", action="store_true",
                   help="keep one other core busy (a Python spin loop) while measuring")
    p.add_argument("--no-transformers", action="store_true", help="measure sgl only")
    p.add_argument("--disable-cpu-graph", action="store_true",
                   help="sgl: run every decode forward through the model code (no replays)")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--update-docs", metavar="PATH", default=None,
                   help=f"replace the text between {DOCS_BEGIN} and {DOCS_END} in PATH")
    return p.parse_args(argv)


# -- prompts --------------------------------------------------------------------------------

def token_stream(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += list(tokenizer(TEXT)["input_ids"])
    return ids[:n]


def decode_prompts(tokenizer: Any, batch: int, length: int) -> list[list[int]]:
    """``batch`` different windows of the text, ``length`` tokens each."""
    stream = token_stream(tokenizer, length + 3 * batch)
    return [stream[3 * i:3 * i + length] for i in range(batch)]


# -- sgl --------------------------------------------------------------------------------------

def load_sgl(dtype: str, max_batch: int, max_tokens: int, cpu_graphs: bool = True) -> Any:
    """The bundled GGUF dequantized to ``dtype`` (``--quantization none``), as transformers
    runs it: sgl's default serves its blocks quantized, which ``quantized_weights.py`` measures."""
    from sgl.engine.model_runner import ModelRunner
    from sgl.plugins import create_plugin_manager

    pm = create_plugin_manager()
    return ModelRunner(model_path=None, dtype=dtype, registries=pm.registries, plugin_manager=pm,
                       max_total_tokens=max_tokens, max_running_requests=max_batch,
                       context_length=2048, show_progress=False, cpu_graphs=cpu_graphs,
                       quantization="none")


def sgl_generate(runner: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float,
                                                                                      list[list[int]]]:
    """Greedy generation; returns (prefill seconds, decode seconds after the first token,
    tokens)."""
    from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
    from sgl.forward_batch import ForwardMode

    try:
        from sgl.kernels.cpu import argmax_rows  # what the scheduler's greedy sampler uses
    except ImportError:  # an sgl from before the CPU kernels, for comparisons

        def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
            return logits.argmax(dim=-1)

    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    start = time.perf_counter()
    batch = make_forward_batch(runner, ForwardMode.EXTEND,
                               [BatchSeq(r, 0, p) for r, p in zip(rows, prompts)])
    ids = argmax_rows(runner.forward_logits(batch)).tolist()
    first = time.perf_counter()
    out = [[t] for t in ids]
    lengths = [len(p) for p in prompts]
    for _ in range(new_tokens - 1):
        batch = make_forward_batch(runner, ForwardMode.DECODE,
                                   [BatchSeq(r, n, [t]) for r, n, t in zip(rows, lengths, ids)])
        ids = argmax_rows(runner.forward_logits(batch)).tolist()
        lengths = [n + 1 for n in lengths]
        for seq, t in zip(out, ids):
            seq.append(t)
    end = time.perf_counter()
    for row, n in zip(rows, lengths):
        release_sequence(runner, row, n)
    return first - start, end - first, out


# -- transformers -----------------------------------------------------------------------------

def load_reference(runner: Any) -> Any:
    """transformers' Llama with the GGUF as transformers itself dequantizes it (float32)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sgl.model_loader import bundled_model_path

    model = AutoModelForCausalLM.from_config(copy.deepcopy(runner.hf_config))
    state = load_gguf_checkpoint(str(bundled_model_path()), return_tensors=True,
                                 model_to_load=model)
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    return model.eval()


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float,
                                                                                  list[list[int]]]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    clock = Clock()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    times = clock.times
    return times[0] - start, times[-1] - times[0], out[:, ids.shape[1]:].tolist()


# -- running ----------------------------------------------------------------------------------

def machine() -> dict[str, str]:
    import transformers

    from machine_info import cpu_model

    from sgl.kernels import cpu as kernels

    cpu = cpu_model()
    caps = getattr(torch._C._cpu, "_get_cpu_capability", lambda: {})()
    isa = ", ".join(k for k in ("avx512_f", "avx512_bf16", "amx_bf16") if caps.get(k))
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical cores ({isa or 'no AVX-512'})",
        "sgl CPU kernels": kernels.describe_isa(),
        # transformers' bfloat16 matmuls are oneDNN's: ONEDNN_MAX_CPU_ISA caps them likewise
        "oneDNN max ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "not capped"),
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()})",
        "transformers": transformers.__version__,
        "os": platform.platform(),
    }


def start_busy_loop() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def use_threads(engine: str, n: int) -> None:
    """n threads the way ``engine`` uses them by default (see the module docstring)."""
    from sgl.kernels import cpu

    if engine == "sgl":
        torch.set_num_threads(1)
        cpu.set_threads(n)
    else:
        torch.set_num_threads(n)
        cpu.set_threads(1)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(args: argparse.Namespace) -> dict[tuple[int, str], list[Case]]:
    from sgl.model_loader import bundled_model_path, load_tokenizer

    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    tokenizer = load_tokenizer(bundled_model_path())
    prefill_prompt = token_stream(tokenizer, args.prefill_len)
    prompts = {b: decode_prompts(tokenizer, b, args.decode_prompt_len) for b in batches}
    max_batch = max(batches)
    pool = max(max_batch * (args.decode_prompt_len + args.decode_tokens), args.prefill_len) + 64

    results: dict[tuple[int, str], list[Case]] = {}
    reference32 = None
    for dtype in dtypes:
        runner = load_sgl(dtype, max_batch, pool, cpu_graphs=not args.disable_cpu_graph)
        reference = None
        if not args.no_transformers:
            if reference32 is None:
                reference32 = load_reference(runner)
            reference = copy.deepcopy(reference32).to(getattr(torch, dtype))
        for n_threads in threads:
            cases = ([] if args.no_prefill else [Case("prefill", 1)]) + [
                Case("decode", b) for b in batches]
            # warm-up: one-off allocations and oneDNN primitives for every shape used
            use_threads("sgl", n_threads)
            sgl_generate(runner, [prefill_prompt], 2)
            sgl_generate(runner, prompts[batches[0]], 3)
            if reference is not None:
                use_threads("hf", n_threads)
                hf_generate(reference, [prefill_prompt], 2)
                hf_generate(reference, prompts[batches[0]], 3)
            steps = [(case, rep) for rep in range(args.reps) for case in cases]
            bar = tqdm(steps, desc=f"{dtype}, {n_threads} thread(s)", unit="case")
            for case, rep in bar:
                bar.set_postfix_str(f"{case.kind} batch {case.batch}")
                engines = ["sgl", "hf"] if reference is not None else ["sgl"]
                if rep % 2:
                    engines.reverse()  # alternate who goes first, against drift
                tokens: dict[str, list[list[int]]] = {}
                for engine in engines:
                    use_threads(engine, n_threads)
                    if case.kind == "prefill":
                        fn = sgl_generate if engine == "sgl" else hf_generate
                        model = runner if engine == "sgl" else reference
                        prefill, _, tokens[engine] = fn(model, [prefill_prompt], 1)
                        rate = args.prefill_len / prefill
                    else:
                        fn = sgl_generate if engine == "sgl" else hf_generate
                        model = runner if engine == "sgl" else reference
                        _, decode, tokens[engine] = fn(model, prompts[case.batch],
                                                       args.decode_tokens)
                        rate = case.batch * (args.decode_tokens - 1) / decode
                    getattr(case, engine).append(rate)
                if "hf" in tokens:
                    same = [a == b for a, b in zip(tokens["sgl"], tokens["hf"])]
                    case.match.append(sum(same) / len(same))
            results[(n_threads, dtype)] = cases
        del runner, reference
    return results


def table(results: dict[tuple[int, str], list[Case]], args: argparse.Namespace) -> str:
    lines = ["| threads | dtype | measurement | sgl tok/s | transformers tok/s | sgl / transformers "
             "| greedy match |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for (n_threads, dtype), cases in results.items():
        for case in cases:
            what = (f"prefill {args.prefill_len} tokens" if case.kind == "prefill" else
                    f"decode, batch {case.batch}")
            sgl, hf = median(case.sgl), median(case.hf)
            ratio = f"**{sgl / hf:.2f}x**" if case.hf else "-"
            match = f"{100 * min(case.match):.0f}%" if case.match else "-"
            hf_text = f"{hf:.1f}" if case.hf else "-"
            lines.append(f"| {n_threads} | {dtype} | {what} | {sgl:.1f} | {hf_text} | {ratio} "
                         f"| {match} |")
    return "\n".join(lines)


def report(results: dict[tuple[int, str], list[Case]], args: argparse.Namespace,
           argv: Sequence[str]) -> str:
    info = machine()
    command = " ".join([".venv/bin/python", "benchmarks/model_throughput.py", *argv])
    parts = [
        f"Command: `{command}`" + (" (one other core kept busy)" if args.busy else ""),
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- decode: prompts of {args.decode_prompt_len} tokens, {args.decode_tokens} new tokens "
        f"each; median of {args.reps} runs; match = share of sequences with identical greedy "
        "tokens (worst run)",
        "",
        table(results, args),
    ]
    return "\n".join(parts)


def update_docs(path: Path, text: str, begin: str = DOCS_BEGIN, end: str = DOCS_END) -> None:
    """Replace the text between the markers ``begin`` and ``end`` in ``path``."""
    content = path.read_text()
    if begin not in content or end not in content:
        raise SystemExit(f"{path} has no {begin} ... {end} section to replace")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    busy = start_busy_loop() if args.busy else None
    try:
        results = run(args)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    shown = [a for i, a in enumerate(argv) if not a.startswith("--update-docs")
             and not (i and argv[i - 1] == "--update-docs")]
    text = report(results, args, shown)
    print(text)
    if args.update_docs:
        update_docs(Path(args.update_docs), text)


if __name__ == "__main__":
    main()
