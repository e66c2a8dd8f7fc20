"""GPTQ and AWQ checkpoints served by sgl next to vLLM, which serves both formats.

    .venv/bin/python benchmarks/gptq_awq_vs_vllm.py
    .venv/bin/python benchmarks/gptq_awq_vs_vllm.py --formats gptq --group-size 32 --keep /tmp/q

A tiny random Llama (transformers, bfloat16; ``--hidden``, ``--intermediate``, ``--layers``) is
written dense, then quantized and packed inside vLLM's venv by vLLM's own helpers
(``quantize_weights``, ``gptq_pack``, ``awq_pack``, ``pack_cols`` of
``vllm.model_executor.layers.quantization.utils.quant_utils``), so the writer is not sgl's:

* ``gptq``: 4-bit symmetric (``uint4b8``, the GPTQ scheme vLLM runs), groups of
  ``--group-size``, the zeros stored as AutoGPTQ's v1 format does (``8 - 1``), the trivial
  ``g_idx``;
* ``awq``: 4-bit with zero points (``uint4``), AutoAWQ's GEMM layout (``version: gemm``);
* ``dense``: the bfloat16 folder itself, the baseline: how far the two engines are apart with no
  quantization at all.

The writer also keeps each format's values before packing, ``(q - z) * scale`` in float32
(``reference-<format>.safetensors``): transformers' Llama on them in float32 is the reference
both engines are measured against. As a control, ``misread-<format>.safetensors`` holds the
values a reader that gets the format wrong would find (GPTQ: the v1 zeros taken as stored, one
less; AWQ: the columns left in AutoAWQ's interleaved order), and vLLM's distance to that is
reported too: what a misreading looks like next to an engine's rounding.

vLLM runs each folder offline in its own process (``LLM(model=..., skip_tokenizer_init=True,
dtype=--vllm-dtype, enforce_eager=True)``; on CPU its GPTQ and AWQ layers run
``CPUWNA16LinearKernel``), greedy, with the ``--top`` logprobs of each new token; float16 by
default, which keeps the checkpoint's float16 scales as they are. sgl.Engine runs the same
folder on the same prompts (token ids), in each of ``--sgl-dtypes``, with
``--int8-activations off``. Reported per format and engine: how many prompts decode the
reference's greedy tokens (and vLLM's, for sgl), and the largest difference between the
engine's logprobs and the reference's (and vLLM's) for the same token after the same prefix
(the reference is run on each engine's own tokens; against vLLM, up to a prompt's first
differing token). vLLM takes 1-2 minutes to start on a small CPU.

vLLM's venv is ``--vllm-python`` (default: ``~/.cache/sgl/bench-peers/vllm/bin/python``, what
``benchmarks/compare`` installs). This file runs there too (``--peer write|run``, with no sgl
import).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FORMATS = ("dense", "gptq", "awq")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the misreading each format's control reference makes
MISREADING = {"gptq": "v1 zeros taken as stored", "awq": "columns left interleaved"}
DEFAULT_VLLM = Path.home() / ".cache" / "sgl" / "bench-peers" / "vllm" / "bin" / "python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma-separated, of {', '.join(FORMATS)} (default: all)")
    p.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale (a multiple of 32; -1: per output channel)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--init-range", type=float, default=0.1,
                   help="the random weights' standard deviation (larger: sharper logits, fewer "
                        "near-ties for greedy decoding)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    p.add_argument("--top", type=int, default=5, help="logprobs reported per step")
    p.add_argument("--vllm-dtype", choices=("float16", "bfloat16"), default="float16",
                   help="vLLM's dtype (its GPTQ and AWQ paths take half types only; in "
                        "bfloat16 it rounds the float16 scales to bfloat16, and its logprobs "
                        "move by about 0.1 on the tiny model)")
    p.add_argument("--sgl-dtypes", default="bfloat16,float32",
                   help="comma-separated dtypes sgl runs in")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    p.add_argument("--keep", type=Path, default=None,
                   help="write the folders, logs and results.json here (default: a temporary "
                        "folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", choices=("write", "run"), help=argparse.SUPPRESS)
    p.add_argument("--peer-args", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return args
    args.formats = [f for f in args.formats.split(",") if f]
    args.sgl_dtypes = [d for d in args.sgl_dtypes.split(",") if d]
    if not args.formats or set(args.formats) - set(FORMATS):
        p.error(f"--formats takes {', '.join(FORMATS)}")
    if set(args.sgl_dtypes) - {"float32", "bfloat16"}:
        p.error("--sgl-dtypes takes float32 and bfloat16")
    if args.group_size != -1 and (args.group_size < 32 or args.group_size % 32):
        p.error("--group-size must be -1 or a multiple of 32")
    if args.hidden % 128 or args.intermediate % 32:
        p.error("--hidden must be a multiple of 128 (heads of 64) and --intermediate of 32")
    if not args.vllm_python.exists():
        p.error(f"no vLLM python at {args.vllm_python} (benchmarks/compare --setup-only "
                "installs one)")
    return args


# -- inside vLLM's venv ------------------------------------------------------------------------

def peer_write(dense: str, out: str, fmt: str, group: int) -> None:
    """Quantize the dense folder's projections with vLLM's helpers and write ``fmt`` to
    ``out``."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        awq_pack,
        gptq_pack,
        pack_cols,
        quantize_weights,
    )
    from vllm.scalar_type import scalar_types

    tensors = load_file(str(Path(dense) / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    reference = {name: tensor.float() for name, tensor in tensors.items()}
    misread = dict(reference)
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS):
            stored[name] = tensor
            continue
        w = tensor.t().half()  # [K, N], float16 so the scales come out float16
        size_k, size_n = w.shape
        groups = 1 if group == -1 else size_k // group
        if fmt == "gptq":
            _, w_q, w_s, _ = quantize_weights(w, scalar_types.uint4b8, group)
            w_zp = torch.full((groups, size_n), 8, dtype=torch.int32)
            stored[f"{prefix}.qweight"] = gptq_pack(w_q, 4, size_k, size_n)
            stored[f"{prefix}.qzeros"] = pack_cols(w_zp - 1, 4, groups, size_n)  # v1: z - 1
            stored[f"{prefix}.g_idx"] = (torch.arange(size_k) // (size_k // groups)).int()
        else:
            _, w_q, w_s, w_zp = quantize_weights(w, scalar_types.uint4, group, zero_points=True)
            stored[f"{prefix}.qweight"] = awq_pack(w_q, 4, size_k, size_n)
            stored[f"{prefix}.qzeros"] = awq_pack(w_zp, 4, groups, size_n)
        w_s = w_s.half().reshape(groups, size_n).contiguous()
        stored[f"{prefix}.scales"] = w_s
        # the checkpoint's values from the integers before packing, exact in float32
        per_group = size_k // groups
        values = ((w_q - w_zp.repeat_interleave(per_group, 0)).float()
                  * w_s.float().repeat_interleave(per_group, 0)).t().contiguous()
        reference[name] = values
        # a misreading: GPTQ's v1 zeros taken as stored (z - 1), AWQ's columns left interleaved
        misread[name] = (values + w_s.float().repeat_interleave(per_group, 0).t()
                         if fmt == "gptq" else
                         values.view(-1, 8, size_k)[:, [0, 2, 4, 6, 1, 3, 5, 7]]
                         .reshape(size_n, size_k))
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(out_path / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(out_path.parent / f"reference-{fmt}.safetensors"))
    save_file({k: v.contiguous() for k, v in misread.items()},
              str(out_path.parent / f"misread-{fmt}.safetensors"))
    config = json.loads((Path(dense) / "config.json").read_text())
    if fmt == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": True, "checkpoint_format": "gptq", "static_groups": False}
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": None}
    config["quantization_config"] = quant
    (out_path / "config.json").write_text(json.dumps(config, indent=2))


def peer_run(folder: str, prompts: list[list[int]], tokens: int, top: int,
             dtype: str) -> dict[str, Any]:
    """vLLM's greedy tokens and top logprobs for each prompt."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
              max_model_len=256, seed=0)
    loaded = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=top, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append({"tokens": list(completion.token_ids),
                        "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                                     for step in completion.logprobs]})
    return {"start_s": loaded, "results": results}


# -- in sgl's venv -----------------------------------------------------------------------------

def write_dense(path: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl.model_loader import load_tokenizer

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 128, max_position_embeddings=256,
                         tie_word_embeddings=False, initializer_range=args.init_range,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)  # sgl's scheduler loads one (stop strings)


def run_peer(args: argparse.Namespace, mode: str, payload: dict[str, Any], log: Path) -> Any:
    """This file's ``--peer mode`` in vLLM's python; its JSON answer."""
    answer = log.with_suffix(".json")
    payload = {**payload, "answer": str(answer)}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("PYTHONPATH", None)
    with log.open("w") as out:
        code = subprocess.call([str(args.vllm_python), __file__, "--peer", mode,
                                "--peer-args", json.dumps(payload)],
                               stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"vLLM's {mode} failed (exit {code}); the end of {log}:\n{tail}")
    return json.loads(answer.read_text())


def vllm_kernel(log: Path) -> str:
    """The linear kernel vLLM's log says it picked, or ``?``."""
    for line in log.read_text(errors="replace").splitlines():
        if "Using " in line and "LinearMethod" in line:
            return line.split("Using ", 1)[1].split(" for ")[0].strip()
    return "unquantized" if "dense" in log.name else "?"


def run_sgl(folder: Path, prompts: list[list[int]], tokens: int, top: int,
            dtype: str) -> tuple[str, list[dict[str, Any]]]:
    """sgl's quantization mode, and its greedy tokens and top logprobs for each prompt."""
    import sgl

    engine = sgl.Engine(model_path=str(folder), dtype=dtype, int8_activations="off",
                        max_total_tokens=2048, context_length=256, log_level="warning")
    try:
        mode = engine.info.quantization
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
            return_logprob=True, top_logprobs_num=top)
    finally:
        engine.shutdown()
    return mode, [{"tokens": out["output_ids"],
                   "logprobs": [{str(t): lp for lp, t, _ in step}
                                for step in out["meta_info"]["output_top_logprobs"]]}
                  for out in outs]


class Reference:
    """transformers' Llama in float32 on a format's values before packing."""

    def __init__(self, dense: Path, weights: Path) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        self.model = LlamaForCausalLM(LlamaConfig.from_pretrained(dense)).float().eval()
        self.model.load_state_dict(load_file(str(weights)))

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        """The argmax at each step, EOS included (the engines ignore it too; transformers'
        ``generate`` with ``min_new_tokens`` would mask it)."""
        out: list[int] = []
        with self.torch.no_grad():
            for _ in range(tokens):
                logits = self.model(self.torch.tensor([prompt + out])).logits[0, -1]
                out.append(int(logits.argmax()))
        return out

    def logprobs(self, prompt: list[int], generated: list[int]) -> Any:
        """log-softmax ``[len(generated), vocab]`` of each new token's step."""
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([prompt + generated])).logits[0]
        return self.torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)


def divergence_gap(reference: Reference, prompt: list[int], ours: list[int],
                   theirs: list[int]) -> float | None:
    """Where two greedy decodings of ``prompt`` first part: how far apart the reference puts
    the two tokens (a near-tie when small); None when they do not part."""
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if step is None:
        return None
    exact = reference.logprobs(prompt, ours[:step + 1])[step]
    return abs(exact[ours[step]].item() - exact[theirs[step]].item())


def against_reference(reference: Reference, prompts: list[list[int]],
                      results: list[dict[str, Any]], want: list[list[int]]) -> dict[str, Any]:
    """Prompts whose greedy tokens are the reference's (and the widest reference gap between
    the two tokens where one parts), and the largest difference between the engine's logprobs
    and the reference's on the engine's own tokens."""
    largest, gaps = 0.0, []
    for prompt, result, tokens in zip(prompts, results, want):
        exact = reference.logprobs(prompt, result["tokens"])
        for step, logprobs in enumerate(result["logprobs"]):
            for token, value in logprobs.items():
                largest = max(largest, abs(value - exact[step, int(token)].item()))
        gap = divergence_gap(reference, prompt, result["tokens"], tokens)
        gaps += [gap] if gap is not None else []
    same = sum(r["tokens"] == w for r, w in zip(results, want))
    return {"same_tokens_as_reference": same, "max_logprob_diff_to_reference": largest,
            "max_gap_where_parting_from_reference": max(gaps, default=None)}


def against_vllm(reference: Reference, prompts: list[list[int]], vllm: list[dict[str, Any]],
                 ours: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompts with vLLM's greedy tokens (and the widest reference gap where they part), and
    the largest logprob difference of a token both report after the same prefix."""
    same, largest, gaps = 0, 0.0, []
    for prompt, theirs, mine in zip(prompts, vllm, ours):
        same += theirs["tokens"] == mine["tokens"]
        for step, (a, b) in enumerate(zip(theirs["tokens"], mine["tokens"])):
            for token in theirs["logprobs"][step].keys() & mine["logprobs"][step].keys():
                largest = max(largest, abs(theirs["logprobs"][step][token]
                                           - mine["logprobs"][step][token]))
            if a != b:
                break
        gap = divergence_gap(reference, prompt, mine["tokens"], theirs["tokens"])
        gaps += [gap] if gap is not None else []
    return {"same_tokens_as_vllm": same, "max_logprob_diff_to_vllm": largest,
            "max_gap_where_parting_from_vllm": max(gaps, default=None)}


def parting(gap: float | None) -> str:
    return "" if gap is None else f" (where one parts, the reference's two tokens {gap:.2g} apart)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer:
        payload = json.loads(args.peer_args)
        if args.peer == "write":
            peer_write(payload["dense"], payload["out"], payload["format"], payload["group"])
            answer: Any = {}
        else:
            answer = peer_run(payload["folder"], payload["prompts"], payload["tokens"],
                              payload["top"], payload["dtype"])
        Path(payload["answer"]).write_text(json.dumps(answer))
        return 0

    import random

    root = args.keep or Path(tempfile.mkdtemp(prefix="gptq-awq-vs-vllm-"))
    root.mkdir(parents=True, exist_ok=True)
    dense = root / "dense"
    write_dense(dense, args)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    report: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()
                                           if not k.startswith("peer")}, "formats": {}}
    n = len(prompts)
    for fmt in args.formats:
        folder = dense if fmt == "dense" else root / fmt
        if fmt == "dense":
            from safetensors.torch import load_file, save_file

            save_file({k: v.float() for k, v in load_file(str(dense / "model.safetensors"))
                       .items()}, str(root / "reference-dense.safetensors"))
        else:
            run_peer(args, "write", {"dense": str(dense), "out": str(folder), "format": fmt,
                                     "group": args.group_size}, root / f"write-{fmt}.log")
            for file in dense.iterdir():
                if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                    (folder / file.name).write_bytes(file.read_bytes())
        reference = Reference(dense, root / f"reference-{fmt}.safetensors")
        want = [reference.greedy(p, args.tokens) for p in prompts]
        log = root / f"vllm-{fmt}.log"
        vllm = run_peer(args, "run", {"folder": str(folder), "prompts": prompts,
                                      "tokens": args.tokens, "top": args.top,
                                      "dtype": args.vllm_dtype}, log)
        entry: dict[str, Any] = {"vllm": {
            "dtype": args.vllm_dtype, "kernel": vllm_kernel(log),
            "start_s": round(vllm["start_s"], 1),
            **against_reference(reference, prompts, vllm["results"], want)}}
        lines = [f"{fmt}, vLLM {args.vllm_dtype} ({entry['vllm']['kernel']}): "
                 f"{entry['vllm']['same_tokens_as_reference']}/{n} prompts with the "
                 f"reference's greedy tokens"
                 f"{parting(entry['vllm']['max_gap_where_parting_from_reference'])}; "
                 f"logprobs within {entry['vllm']['max_logprob_diff_to_reference']:.2g} of "
                 "the reference's"]
        if fmt != "dense":  # how far a misreading of the format would put an engine
            misread = Reference(dense, root / f"misread-{fmt}.safetensors")
            far = against_reference(misread, prompts, vllm["results"], want)
            entry["vllm"]["max_logprob_diff_to_misread"] = far["max_logprob_diff_to_reference"]
            lines[-1] += (f" (and {far['max_logprob_diff_to_reference']:.2g} of a misreading's: "
                          f"{MISREADING[fmt]})")
        for dtype in args.sgl_dtypes:
            mode, ours = run_sgl(folder, prompts, args.tokens, args.top, dtype)
            result = entry[f"sgl {dtype}"] = {
                "quantization": mode, **against_reference(reference, prompts, ours, want),
                **against_vllm(reference, prompts, vllm["results"], ours)}
            lines.append(f"{fmt}, sgl {dtype} (quantization {mode}): "
                         f"{result['same_tokens_as_reference']}/{n} prompts with the "
                         f"reference's greedy tokens"
                         f"{parting(result['max_gap_where_parting_from_reference'])}, "
                         f"{result['same_tokens_as_vllm']}/{n} with vLLM's"
                         f"{parting(result['max_gap_where_parting_from_vllm'])}; logprobs "
                         f"within {result['max_logprob_diff_to_reference']:.2g} of the "
                         f"reference's, {result['max_logprob_diff_to_vllm']:.2g} of vLLM's")
        print("\n".join(lines), flush=True)
        report["formats"][fmt] = entry
    (root / "results.json").write_text(json.dumps(report, indent=2))
    print(f"{args.tokens} greedy tokens after each of {n} prompts of {args.prompt_len}; "
          f"folders, logs and results.json in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
