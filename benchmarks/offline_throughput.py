"""Offline throughput: sgl.Engine versus transformers' batched generate on the same prompts.

The workload follows SGLang's "random" dataset: prompts of random token ids with input lengths
drawn uniformly from [--min-input, --max-input] and output lengths from [--min-output,
--max-output], generated with ignore_eos so every request produces exactly its output length.
sgl gets all prompts at once (continuous batching decides the rest); transformers runs them in
static batches of --hf-batch-size, sorted by length to limit padding, each batch generating up
to its longest requested output. Only requested tokens are counted for both.

    .venv/bin/python benchmarks/offline_throughput.py                 # 200 prompts, float32
    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 40 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, outputs = [], []
    for _ in range(args.num_prompts):
        n_in = rng.randint(args.min_input, args.max_input)
        prompts.append([rng.randrange(100, vocab_size - 100) for _ in range(n_in)])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, outputs)


def run_sgl(args: argparse.Namespace, work: Workload) -> float:
    import sgl

    engine = sgl.Engine(dtype=args.dtype, num_threads=args.threads, log_level="warning",
                        max_running_requests=args.max_running_requests,
                        quantization="none")  # dense, as transformers runs it
    try:
        engine.generate(input_ids=work.prompts[0][:16], sampling_params={"max_new_tokens": 2})
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                  for n in work.output_lens]
        start = time.perf_counter()
        results = engine.generate(input_ids=work.prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    got = sum(r["meta_info"]["completion_tokens"] for r in results)
    if got != work.output_tokens:
        raise SystemExit(f"sgl produced {got} tokens, expected {work.output_tokens}")
    return elapsed


def run_transformers(args: argparse.Namespace, work: Workload) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sgl.model_loader import bundled_model_path, load_hf_config

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = bundled_model_path()
    model = AutoModelForCausalLM.from_config(load_hf_config(path), torch_dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    model = model.to(dtype).eval()
    order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
    batches = [order[i:i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in tqdm(batches, desc="transformers", unit="batch"):
            longest = max(len(work.prompts[i]) for i in batch)
            ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):  # left padding, as generate expects
                p = work.prompts[i]
                ids[row, longest - len(p):] = torch.tensor(p)
                mask[row, longest - len(p):] = 1
            new = max(work.output_lens[i] for i in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    work = make_workload(args, vocab_size=49152)
    print(f"{args.num_prompts} prompts, {work.input_tokens} input and {work.output_tokens} "
          f"output tokens, {args.dtype}, {args.threads} thread(s), {platform.processor() or platform.machine()}")
    sgl_s = run_sgl(args, work)
    rows = [("sgl", sgl_s)]
    if not args.skip_transformers:
        rows.append(("transformers", run_transformers(args, work)))
    print()
    print("| system | seconds | output tok/s | total tok/s | vs transformers |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = rows[-1][1] if len(rows) > 1 else None
    for name, secs in rows:
        ratio = f"{base / secs:.2f}x" if base else "-"
        print(f"| {name} | {secs:.1f} | {work.output_tokens / secs:.1f} | "
              f"{(work.input_tokens + work.output_tokens) / secs:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
