"""The Python half of ``benchmarks/gpu_check.sh``: the models it serves, and its greedy check.

``python benchmarks/gpu_check.py models --carry .gpu-carry --out DIR`` writes two
random-weight models with the bundled SmolLM2's tokenizer (carried in ``.gpu-carry``, written
by ``benchmarks/gpu_check_prepare.sh``, since the GPU machine has neither the model nor a
network):

* ``DIR/tiny``: a 4-layer Llama whose logits are peaked (large initial weights), so that
  greedy decoding is decided by wide margins and sgl's and transformers' tokens can be compared
  exactly across devices and kernels;
* ``DIR/smollm2-shape``: SmolLM2-135M's exact configuration (30 layers, 576 wide, 9 heads,
  3 key/value heads, a 49152-token vocabulary) with random bfloat16 weights: what the serving
  benchmark runs (the speed of a model does not depend on its weights' values).

``python benchmarks/gpu_check.py greedy --model DIR/tiny --url http://127.0.0.1:PORT --device
cuda`` sends prompts to a running ``sgl serve`` through ``/generate`` (greedy, fixed lengths)
and compares the tokens with transformers' ``generate`` on the same weights in float32; it
exits 1 when any prompt's tokens differ where transformers' choice is not a tie (its top two
logits within :data:`TIE`), printing the first difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "1, 2, 3, 4,", "The quick brown fox", "import torch\n", "Hello, my name is",
           "In 1492, Columbus"]
NEW_TOKENS = 24
#: two float32 forwards differ by about 1e-5 in a logit; where the top two tokens are closer
#: than this, either is greedy's choice (the random model's vocabulary of 49152 makes such
#: ties happen: the CPU rehearsal met one, at 7e-6, in its 192 tokens)
TIE = 1e-3


def make_models(carry: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(carry / "smollm2-tokenizer")
    shape = AutoConfig.from_pretrained(carry / "smollm2-config")
    torch.manual_seed(0)
    tiny = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, initializer_range=0.2,
                       bos_token_id=shape.bos_token_id, eos_token_id=shape.eos_token_id,
                       tie_word_embeddings=False)
    for name, config, dtype in (("tiny", tiny, torch.float32),
                                ("smollm2-shape", shape, torch.bfloat16)):
        model = LlamaForCausalLM(config).to(dtype)
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        print(f"{out / name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
              f"parameters, {dtype}")


def greedy(model_dir: Path, url: str, device: str) -> int:
    import httpx
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    failures = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        reply = httpx.post(f"{url}/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
        reply.raise_for_status()
        got = reply.json()["output_ids"]
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids], device=device), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     eos_token_id=None, pad_token_id=0)
        want = out[0, len(ids):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if same is None and len(got) == len(want):
            print(f"same {len(want)} tokens: {prompt!r}")
            continue
        if same is not None:
            with torch.no_grad():
                logits = reference(torch.tensor([ids + want[:same]], device=device)).logits[0, -1]
            gap = float(logits[want[same]] - logits[got[same]])
            if gap <= TIE:
                print(f"same {same} tokens, then a tie (sgl's token {gap:.1e} below "
                      f"transformers'): {prompt!r}")
                continue
        failures += 1
        print(f"DIFFERENT at token {same}: {prompt!r}\n  sgl:          {got}\n"
              f"  transformers: {want}")
    print(json.dumps({"prompts": len(PROMPTS), "different": failures}))
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    models = commands.add_parser("models", help="write the tiny and the SmolLM2-shaped model")
    models.add_argument("--carry", type=Path, default=Path(".gpu-carry"))
    models.add_argument("--out", type=Path, required=True)
    check = commands.add_parser("greedy", help="sgl serve's greedy tokens against transformers")
    check.add_argument("--model", type=Path, required=True)
    check.add_argument("--url", required=True)
    check.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.command == "models":
        make_models(args.carry, args.out)
        return 0
    return greedy(args.model, args.url, args.device)


if __name__ == "__main__":
    sys.exit(main())
