"""What `tolk worker --device cuda` runs, checked against the CPU reference, then timed: the first
step of bench/gpu.sh (issue #25, item 7).

    python3 -m bench.gpu_check --models smollm2-135m --out bench/out/gpu/check.json
    python -m bench.gpu_check --device cpu --quick        # CPU dry run: the script runs

Per model:
1. **Selection**, as the worker makes it (`workers.engine.device_select.select_engine_config`,
   `--device cuda`, both fast parts asked): what it chose, each fallback and why, how long the
   start-up check took; for the worker's dtype (bfloat16 on CUDA) and for float32.
2. **Correctness against the CPU reference**: greedy translations (en->de, `--tokens` tokens,
   EOS ignored) of `--prompts` Tatoeba sentences by the CPU engine in float32 (the reference,
   its logits recorded) and by the selected GPU engines. float32 on the GPU must give the CPU's
   tokens, or first differ at a near-tie of the CPU logits (the float32 tolerance of
   device_select.TOLERANCES): `pass` is that verdict. bfloat16 is reported (equal sequences,
   the verdict under the bfloat16 tolerance), not gated: it computes in another precision.
3. **Timing** of the worker's engine (bfloat16, the selected path, graphs captured): single
   32-token translations one after another (P50/P95/P99; target P99 <= 100 ms), then open
   loop at each of `--rates` per second from scheduled send times (bench.gpu_engine.latency;
   the seed's figure under load was a P99 of ~112 ms).

JSON to `--out`; the last lines printed are the table bench/gpu.sh shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SINGLE_P99_TARGET_MS = 100.0
LOAD_P99_SEED_MS = 112.0


def translations(engine: Any, texts: Sequence[str], tokens: int) -> list[Any]:
    return [
        engine.translation_request(t, "en", "de", max_new_tokens=tokens, ignore_eos=True,
                                   request_id=f"check-{i}")
        for i, t in enumerate(texts)
    ]  # fmt: skip


def cpu_reference(model: str, texts: Sequence[str], tokens: int) -> dict[str, Any]:
    import torch

    from workers.engine import device_select as ds
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import load_model

    loaded = load_model(model, dtype=torch.float32, device="cpu")
    engine = Engine(loaded, EngineConfig(model=model, device="cpu", kv_cache_tokens=8192))
    recorder = ds._LogitRecorder(engine.model)
    engine.use_sampler(recorder)
    t0 = time.perf_counter()
    results = engine.generate(translations(engine, texts, tokens))
    return {
        "tokens": [r.token_ids for r in results],
        "logits": [recorder.logits[f"check-{i}"] for i in range(len(texts))],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def selected(model: str, device: str, dtype: str) -> tuple[Any, Any, dict[str, Any]]:
    from workers.engine.device_select import GpuOptions, select_engine_config
    from workers.engine.engine import EngineConfig

    base = EngineConfig(model=model, dtype=dtype, warm_languages=("de",), max_new_tokens=64)
    t0 = time.perf_counter()
    selection, loaded = select_engine_config(base, GpuOptions(device))
    c = selection.config
    info = {
        "dtype": dtype, "device": c.device, "triton_kernels": c.triton_kernels,
        "cuda_graphs": c.cuda_graphs, "notes": list(selection.notes),
        "fallbacks": list(selection.fallbacks),
        "select_s": round(time.perf_counter() - t0, 2),
    }  # fmt: skip
    return selection.config, loaded, info


def agreement(ref: dict[str, Any], got: list[list[int]], dtype: str) -> dict[str, Any]:
    import torch

    from workers.engine.device_select import TOLERANCES, compare

    equal = sum(a == b for a, b in zip(ref["tokens"], got, strict=True))
    why, ties = compare(ref["tokens"], ref["logits"], got, TOLERANCES[getattr(torch, dtype)])
    return {"equal": equal, "of": len(got), "near_ties": ties, "pass": why is None, "why": why}


def run_model(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import torch

    from bench.gpu_engine import latency, texts
    from workers.engine.engine import Engine

    prompts = texts(args.prompts)
    ref = cpu_reference(model, prompts, args.tokens)
    out: dict[str, Any] = {"model": model, "cpu_reference_s": ref["seconds"], "runs": {}}
    for dtype in args.dtypes:
        config, loaded, info = selected(model, args.device, dtype)
        engine = Engine.from_config(dataclasses.replace(config, warm_languages=()), loaded)
        got = [r.token_ids for r in engine.generate(translations(engine, prompts, args.tokens))]
        info["vs_cpu_float32"] = agreement(ref, got, dtype)
        info["graph_steps"] = engine.stats.graph_steps
        print(f"bench.gpu_check {model} {dtype} {json.dumps(info)}", flush=True)
        if dtype == args.dtypes[-1]:  # the worker's engine (bfloat16 on CUDA): timed
            engine.warm(["de"])
            if engine.graphs is not None:
                with engine.prepared.bound(engine.kv_pools):
                    info["capture_s"] = engine.graphs.warm_up()
            runs = [latency(engine, args.latency_requests, 32, rate) for rate in args.rates]
            info["latency"] = {
                "single_32_tokens_ms": runs[0]["sequential_ms"],
                "open_loop": [{"rate_per_s": r["open_loop_rate_per_s"], **r["open_loop_ms"],
                               "mean_batch": r["open_loop_mean_batch"]} for r in runs],
            }  # fmt: skip
        out["runs"][dtype] = info
        del engine, loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def table(results: dict[str, Any]) -> list[str]:
    lines = []
    for m in results["models"]:
        for dtype, r in m["runs"].items():
            a = r["vs_cpu_float32"]
            path = "+".join(p for p in ("triton_kernels", "cuda_graphs") if r[p]) or "eager"
            gate = ("PASS" if a["pass"] else "FAIL") if dtype == "float32" else "(info)"
            lines.append(
                f"check {m['model']} {dtype} on {r['device']} [{path}]: vs CPU float32 "
                f"{a['equal']}/{a['of']} equal, near-ties {a['near_ties']} {gate}"
                + (f" ({a['why']})" if a["why"] else "")
            )
            for f in r["fallbacks"]:
                lines.append(f"check {m['model']} {dtype} FALLBACK: {f}")
            lat = r.get("latency")
            if lat:
                p99 = lat["single_32_tokens_ms"]["p99"]
                ok = p99 is not None and p99 <= SINGLE_P99_TARGET_MS
                lines.append(
                    f"check {m['model']} single 32-token translation P50/P95/P99 "
                    f"{lat['single_32_tokens_ms']['p50']}/{lat['single_32_tokens_ms']['p95']}/"
                    f"{p99} ms: target P99 <= {SINGLE_P99_TARGET_MS:.0f} ms "
                    + ("MET" if ok else "MISSED")
                )
                for o in lat["open_loop"]:
                    lines.append(
                        f"check {m['model']} open loop {o['rate_per_s']}/s P50/P95/P99 "
                        f"{o['p50']}/{o['p95']}/{o['p99']} ms, mean batch {o['mean_batch']} "
                        f"(seed under load: P99 ~{LOAD_P99_SEED_MS:.0f} ms)"
                    )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--device", default="cuda", help="cuda; cpu: the dry run")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dtypes", default="float32,bfloat16", help="checked; the last one timed")
    p.add_argument("--latency-requests", type=int, default=60)
    p.add_argument("--rates", default="10,40", help="open-loop requests per second")
    p.add_argument("--quick", action="store_true", help="tiny run (the CPU dry run)")
    p.add_argument("--out", default="bench/out/gpu/check.json")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if args.quick:
        args.prompts, args.tokens, args.latency_requests, args.rates = 2, 4, 2, [2.0]
    import torch

    results = {
        "bench": "gpu_check", "device": args.device, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "models": [run_model(args, m) for m in args.models.split(",") if m],
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for line in table(results):
        print(line, flush=True)
    print(f"bench.gpu_check -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
