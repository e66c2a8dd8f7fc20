#!/usr/bin/env bash
# sgl on one NVIDIA GPU, in one go: under 8 minutes on an H100/H200-class GPU (docs/gpu.md,
# "The GPU check"). From the repository root, with the folders that
# benchmarks/gpu_check_prepare.sh wrote (.whl/, .gpu-carry/) beside it:
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT, else gpu-check/)
#
# It installs nothing from the internet: sgl, its plugins and the carried wheels go into
# /tmp/sgl-site, put on PYTHONPATH ahead of the machine's own torch and triton. Each
# step logs to OUT_DIR/<step>.log; OUT_DIR/gpu_check.md sums them up:
#   install      sgl and the plugins; `sgl plugins` (is attn-triton available? flashinfer?)
#   attention    the attention plugins' parity tests on the GPU (triton's kernels compiled for
#                it; flashinfer's where it is installed)
#   families     the model families' parity tests against transformers, --device cuda, with
#                the triton and the torch attention backends
#   cuda-graph   the CUDA graph runner's tests, the capture on the GPU included
#   greedy       `sgl serve --device cuda`'s greedy tokens against transformers on the GPU
#   bench        `sgl bench serving` at concurrency 1, 32 and 128, CUDA graphs on and off,
#                on a random-weight model of SmolLM2-135M's shape
# The exit status is the number of failed steps.
#
# GPU_CHECK_DEVICE=cpu rehearses the script on a CPU with the project's .venv: the same steps,
# smaller, on the torch attention backend, with sgl's CPU replays in place of CUDA graphs.
set -uo pipefail

device=${GPU_CHECK_DEVICE:-cuda}
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
port=${GPU_CHECK_PORT:-31000}
summary="$out/gpu_check.md"
failed=0
started=$SECONDS

note() { echo "$*" | tee -a "$summary"; }

# step NAME COMMAND...: run it, log it, note pass/fail and its time
step() {
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*"
    if "$@" >"$out/$name.log" 2>&1; then
        note "| $name | passed | $((SECONDS - t0)) s | |"
    else
        failed=$((failed + 1))
        note "| $name | FAILED | $((SECONDS - t0)) s | see $name.log: $(tail -n 1 "$out/$name.log" | cut -c1-150) |"
    fi
}

install() {
    if [ "$device" = cpu ]; then
        py=.venv/bin/python
        return 0
    fi
    # into a folder on PYTHONPATH, ahead of the machine's own packages (whose python3 may
    # itself be a virtual environment, which a --system-site-packages venv would not see)
    py=python3
    rm -rf /tmp/sgl-site
    local wheels=()
    if ls .whl/*.whl >/dev/null 2>&1; then
        wheels=(.whl/*.whl)
    else
        echo "no .whl/: run benchmarks/gpu_check_prepare.sh where pip reaches the index" >&2
    fi
    local plugins
    plugins=$(ls -d plugins/*/*/ | grep -v sgl-kernels-cpu)
    # shellcheck disable=SC2086 - one folder per plugin
    $py -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --target /tmp/sgl-site "${wheels[@]}" . $plugins || return 1
    export PYTHONPATH=/tmp/sgl-site${PYTHONPATH:+:$PYTHONPATH}
    $py -c "import sgl, fastapi, zmq, gguf, xgrammar, transformers, triton, torch; \
print('sgl', sgl.__file__, 'transformers', transformers.__version__, 'triton', \
triton.__version__, 'torch', torch.__version__)"
}

# the step's command, with the environment it needs
run_py() { SGL_TEST_DEVICE=$device "$py" "$@"; }

plugin_list() {
    "$py" -m sgl plugins || return 1
    "$py" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY
}

attention_tests() {
    if [ "$device" = cpu ]; then
        run_py -m pytest -q -p no:cacheprovider tests/plugins/attention
    else
        run_py -m pytest -q -p no:cacheprovider tests/plugins/attention/test_triton_attention.py \
            tests/plugins/attention/test_flashinfer_planning.py
    fi
}

family_tests() {
    local backends="triton torch" status=0
    [ "$device" = cpu ] && backends=torch
    for backend in $backends; do
        echo "--- attention backend $backend"
        SGL_TEST_ATTENTION_BACKEND=$backend run_py -m pytest -q -p no:cacheprovider \
            tests/plugins/models/test_mistral.py tests/plugins/models/test_gemma.py \
            tests/plugins/models/test_phi.py tests/plugins/models/test_qwen.py || status=1
    done
    return $status
}

cuda_graph_tests() {
    run_py -m pytest -q -p no:cacheprovider -rs tests/core/test_cuda_graph.py
}

server_pid=""
# serve MODEL_DIR LOG ARGS...: start `sgl serve` and wait until it answers /health
serve() {
    local model=$1 log=$2; shift 2
    "$py" -m sgl serve --model-path "$model" --device "$device" --port "$port" "$@" \
        >"$log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 300); do
        if "$py" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
                >/dev/null 2>&1; then
            return 0
        fi
        kill -0 "$server_pid" 2>/dev/null || { echo "sgl serve exited: see $log"; return 1; }
        sleep 1
    done
    echo "sgl serve did not answer /health within 300 s"
    return 1
}

stop_server() {
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    server_pid=""
}
trap stop_server EXIT

models() {
    run_py benchmarks/gpu_check.py models --carry .gpu-carry --out "$out/models"
}

greedy() {
    local backend=triton status=0
    [ "$device" = cpu ] && backend=torch
    serve "$out/models/tiny" "$out/greedy-server.log" --dtype float32 \
        --attention-backend "$backend" --max-total-tokens 20000 || return 1
    run_py benchmarks/gpu_check.py greedy --model "$out/models/tiny" \
        --url "http://127.0.0.1:$port" --device "$device" || status=1
    stop_server
    return $status
}

bench() {
    local backend=triton concurrencies="1 32 128" graphs_off=--disable-cuda-graph status=0
    local args=(--max-running-requests 128)
    if [ "$device" = cpu ]; then
        backend=torch concurrencies="1 4" graphs_off=--disable-cpu-graph
        args=(--max-running-requests 8 --max-total-tokens 20000)
    else
        args+=(--cuda-graph-max-bs 128)
    fi
    for graphs in on off; do
        local extra=()
        [ "$graphs" = off ] && extra=("$graphs_off")
        serve "$out/models/smollm2-shape" "$out/bench-server-graphs-$graphs.log" \
            --dtype bfloat16 --attention-backend "$backend" "${args[@]}" "${extra[@]}" \
            || return 1
        for c in $concurrencies; do
            local n=$((c * 2)); [ $n -lt 8 ] && n=8
            local len_in=512 len_out=128
            [ "$device" = cpu ] && len_in=64 len_out=16
            echo "--- graphs $graphs, concurrency $c, $n prompts"
            "$py" -m sgl bench serving --port "$port" --num-prompts $n \
                --random-input-len $len_in --random-output-len $len_out --max-concurrency "$c" \
                --tokenizer "$out/models/smollm2-shape" --disable-tqdm \
                --output-file "$out/bench-graphs-$graphs.jsonl" || status=1
        done
        stop_server
    done
    "$py" - "$out" "$concurrencies" >"$out/bench.md" <<'PY' || status=1
import json, sys
from pathlib import Path

out, concurrencies = Path(sys.argv[1]), sys.argv[2].split()
print("\n| CUDA graphs | concurrency | output tok/s | median TTFT ms | median ITL ms |")
print("|---|---:|---:|---:|---:|")
for graphs in ("on", "off"):
    path = out / f"bench-graphs-{graphs}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for c, row in zip(concurrencies, rows):
        m = row["metrics"]
        print(f"| {graphs} | {c} | {m['output_throughput']:.1f} | "
              f"{m['ttft_ms']['median']:.1f} | {m['itl_ms']['median']:.2f} |")
print()
PY
    return $status
}

{
    echo "# sgl GPU check ($(date -u +%FT%TZ), device $device)"
    echo
    echo "| step | result | time | |"
    echo "|---|---|---:|---|"
} >"$summary"

step install install
if [ -z "${py:-}" ]; then py=python3; fi
step plugins plugin_list
step attention attention_tests
step families family_tests
step cuda-graph cuda_graph_tests
step models models
step greedy greedy
step bench bench
[ -f "$out/bench.md" ] && cat "$out/bench.md" >>"$summary"
note ""
note "total: $((SECONDS - started)) s, $failed failed step(s)"
exit $failed
