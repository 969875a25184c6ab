"""The engine on a GPU, eager vs CUDA graphs + Triton kernels: decode speed per batch size, token
parity between the two, and the latency of single translations one after another and under a
steady open-loop load.

    python -m bench.gpu_engine --models smollm2-135m,gemma3-270m --out bench/out/gpu/engine.json
    python -m bench.gpu_engine --device cpu --models smollm2-135m --quick   # CPU dry run

Variants (one loaded model per model, engines built one after another on it):
- `eager`: `EngineConfig(device="cuda")`, today's path (torch reference ops, no graphs);
- `graphs+kernels`: `triton_kernels=True, cuda_graphs=True` (workers/engine/triton_swaps.py,
  workers/engine/cuda_graphs.py; every bucket captured before timing). The swap changes the
  model's modules in place, so `eager` always runs first.

Per variant and batch size B (`--batches`): B distinct en->de translation prompts (Tatoeba,
the engine's own prompt), prefix cache on and the language prefix warmed, `--new-tokens` each
(EOS ignored); decode tok/s over the steps in which all B sequences decode (the engine's step
trace), median of `--repeats` after a warm-up run. Parity: the greedy tokens of the two
variants for the batch of 8 (equal sequences, first divergence).

Latency (`--latency-new-tokens`, 32): the engine's loop thread running as the worker runs it;
`sequential`: `--latency-requests` translations one after another (submit -> result);
`open_loop`: the same number submitted on a fixed schedule at `--rate` per second, latency
measured from each request's scheduled time (no coordinated omission). P50/P95/P99 in ms.

On the CPU (`--device cpu`) the CUDA options are ignored by the engine, so both variants are
the CPU engine: the dry run only shows the script starts and its JSON is complete.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VARIANTS = {  # name -> (EngineConfig.triton_kernels, EngineConfig.cuda_graphs)
    "eager": (False, False),
    "graphs+kernels": (True, True),
}
SOURCE_LANG, TARGET_LANG = "en", "de"


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "n": len(ordered)}


def texts(n: int) -> list[str]:
    from bench.engine import sentences

    return sentences(n)


def throughput(engine: Any, batch: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    prompts = texts(batch)

    def once() -> tuple[float, float, list[list[int]]]:
        reqs = [engine.translation_request(t, SOURCE_LANG, TARGET_LANG,
                                           max_new_tokens=new_tokens, ignore_eos=True)
                for t in prompts]  # fmt: skip
        engine.step_trace = []
        start = time.monotonic()
        for r in reqs:
            r.arrival = start
        results = engine.generate(reqs)
        trace, engine.step_trace = engine.step_trace, None
        ttft = max(r.timings.queue_s + r.timings.prefill_s for r in results)
        full = [s for s in trace if s.kind == "decode" and s.num_seqs == batch]
        tok_s = batch * len(full) / sum(s.seconds for s in full) if full else float("nan")
        return tok_s, ttft, [r.token_ids for r in results]

    once()  # warm-up (and, for graphs, any bucket not captured yet)
    runs = [once() for _ in range(repeats)]
    return {
        "batch": batch,
        "decode_tok_s": round(statistics.median(r[0] for r in runs), 1),
        "ttft_ms": round(statistics.median(r[1] for r in runs) * 1e3, 2),
        "raw_decode_tok_s": [round(r[0], 1) for r in runs],
        "tokens": runs[-1][2],
    }


def latency(engine: Any, n: int, new_tokens: int, rate: float) -> dict[str, Any]:
    """Single translations through the running engine loop: one after another, then open
    loop at `rate` per second from scheduled send times."""
    prompts = texts(n)

    def request(text: str) -> Any:
        return engine.translation_request(text, SOURCE_LANG, TARGET_LANG,
                                          max_new_tokens=new_tokens, ignore_eos=True)  # fmt: skip

    engine.start()
    try:
        engine.submit(request(prompts[0])).result(120)  # warm the loop
        sequential = []
        for t in prompts:
            t0 = time.perf_counter()
            engine.submit(request(t)).result(120)
            sequential.append(time.perf_counter() - t0)
        done: dict[int, float] = {}
        lock = threading.Lock()
        handles = []
        start = time.perf_counter() + 0.05
        batch_sizes_before = len(engine.stats.batch_sizes)
        for i, t in enumerate(prompts):
            due = start + i / rate
            time.sleep(max(0.0, due - time.perf_counter()))
            handle = engine.submit(request(t))

            def finished(_: Any, i: int = i) -> None:
                with lock:
                    done[i] = time.perf_counter()

            handle.add_done_callback(finished)
            handles.append(handle)
        for h in handles:
            h.result(300)
        open_loop = [done[i] - (start + i / rate) for i in range(len(prompts))]
        sizes = engine.stats.batch_sizes[batch_sizes_before:]
    finally:
        engine.stop(drain=True, timeout=60)
    return {
        "new_tokens": new_tokens,
        "sequential_ms": percentiles(sequential),
        "open_loop_ms": percentiles(open_loop),
        "open_loop_rate_per_s": rate,
        "open_loop_mean_batch": round(statistics.mean(sizes), 2) if sizes else None,
    }


def run_model(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import torch

    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import load_model

    dtype = getattr(torch, args.dtype)
    loaded = load_model(model, dtype=dtype, device=args.device)
    out: dict[str, Any] = {"model": model, "dtype": args.dtype, "variants": {}}
    for name in args.variants:
        cfg = EngineConfig(
            model=model, dtype=args.dtype, device=args.device,
            kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=max(args.batches),
            max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
            triton_kernels=VARIANTS[name][0], cuda_graphs=VARIANTS[name][1],
        )  # fmt: skip
        t0 = time.perf_counter()
        engine = Engine(loaded, cfg)
        engine.warm([TARGET_LANG])
        capture_s = None
        if engine.graphs is not None:
            with engine.prepared.bound(engine.kv_pools):
                capture_s = engine.graphs.warm_up()
        row: dict[str, Any] = {"start_s": round(time.perf_counter() - t0, 2),
                               "capture_s": capture_s, "throughput": []}  # fmt: skip
        for b in args.batches:
            r = throughput(engine, b, args.new_tokens, args.repeats)
            row["throughput"].append(r)
            print(f"bench.gpu_engine {model} {name} B={b} decode {r['decode_tok_s']} tok/s "
                  f"TTFT {r['ttft_ms']} ms", flush=True)  # fmt: skip
        row["latency"] = (
            latency(engine, args.latency_requests, args.latency_new_tokens, args.rate)
            if args.latency_requests > 0
            else None
        )
        row["graph_steps"] = engine.stats.graph_steps
        print(f"bench.gpu_engine {model} {name} latency {json.dumps(row['latency'])}", flush=True)
        out["variants"][name] = row
        del engine
        gc.collect()
        if args.device == "cuda":
            row["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    variants = out["variants"]
    if "eager" in variants and "graphs+kernels" in variants:
        parity = []
        for a, b in zip(variants["eager"]["throughput"], variants["graphs+kernels"]["throughput"],
                        strict=True):  # fmt: skip
            equal = sum(x == y for x, y in zip(a["tokens"], b["tokens"], strict=True))
            firsts = [next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
                      for x, y in zip(a["tokens"], b["tokens"], strict=True)]  # fmt: skip
            parity.append({"batch": a["batch"], "equal": equal, "of": len(a["tokens"]),
                           "first_divergence": [f for f in firsts if f is not None]})  # fmt: skip
            sa, sb = a["decode_tok_s"], b["decode_tok_s"]
            print(f"bench.gpu_engine {model} B={a['batch']} graphs+kernels / eager "
                  f"{sb / sa if sa else float('nan'):.2f}x, "
                  f"tokens equal {equal}/{len(a['tokens'])}",
                  flush=True)  # fmt: skip
        out["parity"] = parity
    for row in variants.values():
        for r in row["throughput"]:
            r.pop("tokens")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-tokens", type=int, default=131072)
    p.add_argument("--max-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--latency-requests", type=int, default=40, help="0: no latency runs")
    p.add_argument("--latency-new-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=20.0, help="open-loop requests per second")
    p.add_argument("--quick", action="store_true", help="tiny run (the CPU dry run)")
    p.add_argument("--out", default="bench/out/gpu/engine.json")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.quick:
        args.batches, args.new_tokens, args.repeats = [1, 2], 4, 1
        args.latency_requests, args.latency_new_tokens, args.rate = 2, 3, 2.0
        args.kv_cache_tokens, args.max_batched_tokens = 4096, 512
    import torch

    results = {"bench": "gpu_engine", "device": args.device, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
               "models": [run_model(args, m) for m in args.models.split(",") if m]}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"bench.gpu_engine -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
