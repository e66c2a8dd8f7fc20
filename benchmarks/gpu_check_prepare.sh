#!/usr/bin/env bash
# Prepares benchmarks/gpu_check.sh on a machine where pip reaches the package index (the GPU
# machine reaches nothing). Run from the repository root, after `make install`:
#
#   bash benchmarks/gpu_check_prepare.sh
#
# It writes two git-ignored folders that travel to the GPU machine with the working tree:
#   .whl/        the wheels of benchmarks/gpu_wheels.txt, for CPython 3.12 on x86-64 Linux
#   .gpu-carry/  the bundled SmolLM2's tokenizer and configuration (the 94 MB model itself
#                stays here: the GPU check serves random-weight models of its shape)
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
rm -rf .whl .gpu-carry
mkdir -p .whl .gpu-carry
grep -v '^#' benchmarks/gpu_wheels.txt | grep -v '^$' | xargs "$python" -m pip download -q \
    --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl
"$python" - <<'PY'
from sgl.model_loader import load_hf_config, load_tokenizer

load_tokenizer(None).save_pretrained(".gpu-carry/smollm2-tokenizer")
config = load_hf_config(None)
config.architectures = ["LlamaForCausalLM"]
config.save_pretrained(".gpu-carry/smollm2-config")
PY
du -sh .whl .gpu-carry
