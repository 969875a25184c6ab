#!/usr/bin/env bash
# The engine's GPU checks in one go, for a CUDA machine with the model weights in reach:
# token parity against transformers (bfloat16 and float32) and the engine benchmark in
# bfloat16 (tolk vs transformers `generate`, same weights, same device).
#
#   bash bench/gpu.sh [OUT_DIR]      # default bench/out/gpu
#
# Every step writes its JSON and log under OUT_DIR as soon as it ends, so a run cut short still
# leaves the steps that finished. Figures go to docs/BENCHMARKS.md ("GPU").
set -uo pipefail
out=${1:-bench/out/gpu}
models=${TOLK_GPU_MODELS:-smollm2-135m}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"

step() {  # step NAME COMMAND...: run, keep the log, print the lines that matter
    local name=$1; shift
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    grep -E "bench\.(parity|engine) |Error|error|Traceback" "$out/$name.log" | tail -20
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
}

step parity_bf16 python3 -m bench.parity --models "$models" --device cuda --dtype bfloat16 \
    --out "$out/parity_bf16.json"
step parity_fp32 python3 -m bench.parity --models "$models" --device cuda --dtype float32 \
    --out "$out/parity_fp32.json"
step engine_bf16 python3 -m bench.engine --models "$models" --batches 1,8,32,128 --repeats 3 \
    --systems tolk,hf --device cuda --dtype bfloat16 --kv-cache-tokens 131072 --max-batched-tokens 4096 \
    --out "$out/engine_bf16.json"
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("parity_bf16", "parity_fp32"):
    p = out / f"{name}.json"
    if p.exists():
        for m in json.loads(p.read_text())["models"]:
            for r in m["runs"]:
                print(name, m["model"], r["run"], f'{r["equal"]}/{r["of"]}', r["diverged"])
p = out / "engine_bf16.json"
if p.exists():
    d = json.loads(p.read_text())
    for r in d.get("results", []):
        print("engine", r.get("system"), r.get("model"), r.get("batch"),
              {k: (r.get(k) or {}).get("median") for k in ("ttft_s", "decode_tok_s", "prefill_tok_s")})
    print("prefix_ttft", json.dumps(d.get("prefix_ttft")))
PY
