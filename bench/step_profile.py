"""Where one batch-1 decode step goes, and what bounds it (issue #25's P50).

A request's latency at low load is mostly batch-1 decode steps. On a CPU such a step reads every
weight once, so its floor is (bytes of weights) / (memory bandwidth). This benchmark prints, as
one JSON object, the three numbers that say how far a step is from that floor:

- `bandwidth_gbs`: a streaming read of a buffer the size of the LM head (`torch.sum` over float32,
  the process's threads): what this machine's memory gives one process;
- `head_ms` / `head_gbs`: the LM head alone as the step's greedy rows run it, one row (with
  `--quantize int8` its int4 screen, kernels/int8_head_screen.py; float32: its int8 screen);
- `step_ms`: real decode steps of one request (median and min over `--steps`), and `ops`: the
  `torch.profiler` self time per step of the costliest ops over 30 of them.

The anchor is llama.cpp's step on the same machine (`python -m bench.engine --systems
tolk,llamacpp --batches 1`): it reads a Q6_K head and Q4_K layers, fewer bytes than int8.

    python -m bench.step_profile --model gemma3-270m --quantize int8 --compile-decode
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from bench._common import JSON, machine_info


def _bandwidth_gbs(nbytes: int, repeats: int = 10) -> float:
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    t0 = time.perf_counter()
    for _ in range(repeats):
        buf.sum()
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def _head_ms(engine: Any, repeats: int = 20) -> tuple[float, int]:
    """One row through the LM head as the step's greedy rows run it: (ms, bytes it reads). With
    a screen (`EngineConfig.screen_lm_head`), the screen's copy and its candidates' rescoring;
    else the head module (int8 / int4: codes and scales; float32: the parameter)."""
    import torch

    from kernels.greedy_head import Int8Screen

    head, screen = engine.model.lm_head, engine.lm_screen
    x = torch.randn(1, head.in_features)

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    if screen is not None:  # the sampler's greedy path: the screen's copy and candidates
        run = lambda: engine.sampler.greedy(x)  # noqa: E731
        copy = (
            [screen.q] if isinstance(screen, Int8Screen) else [screen.w, screen.scales, screen.mins]
        )
        size = nbytes(copy)
    else:
        run = lambda: head(x)  # noqa: E731
        size = nbytes(head.buffers()) or nbytes([head.weight])
    with torch.inference_mode():
        run()
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
    seconds = (time.perf_counter() - t0) / repeats
    return seconds * 1e3, size


def profile_steps(args: argparse.Namespace) -> JSON:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import load_model

    torch.set_num_threads(args.threads)
    engine = Engine(
        load_model(args.model),
        EngineConfig(
            kv_cache_tokens=8192, quantize=args.quantize, compile_decode=args.compile_decode
        ),
    )
    text = "Your order has shipped and will arrive on Monday; the tracking link is in the e-mail."

    def request(i: int, tokens: int) -> Any:
        return engine.translation_request(
            text, "en", "de", request_id=f"p{i}", max_new_tokens=tokens, ignore_eos=True
        )

    t0 = time.perf_counter()
    engine.generate([request(0, 8)])  # compiles the graphs where asked
    first_s = time.perf_counter() - t0
    engine.submit(request(1, args.steps + 1))
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    engine.submit(request(2, 40))
    for _ in range(5):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(30):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
    head_ms, head_bytes = _head_ms(engine)
    steps.sort()
    bandwidth = _bandwidth_gbs(head_bytes)
    return {
        "benchmark": "step_profile",
        "machine": machine_info(),
        "model": args.model,
        "quantize": args.quantize,
        "compile_decode": args.compile_decode,
        "threads": args.threads,
        "first_request_s": round(first_s, 2),
        "step_ms": {
            "median": round(steps[len(steps) // 2] * 1e3, 2),
            "min": round(steps[0] * 1e3, 2),
            "n": len(steps),
        },
        "head_ms": round(head_ms, 2),
        "head_mb": round(head_bytes / 1e6, 1),
        "head_gbs": round(head_bytes / head_ms / 1e6, 1),
        "bandwidth_gbs": round(bandwidth, 1),
        "head_floor_ms": round(head_bytes / bandwidth / 1e6, 2),
        "ops": [
            {
                "op": e.key[:80],
                "ms_per_step": round(e.self_cpu_time_total / 30 / 1e3, 3),
                "calls_per_step": round(e.count / 30, 1),
            }  # fmt: skip
            for e in ops
        ],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    p.add_argument("--compile-decode", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=150, help="timed decode steps")
    p.add_argument("--top", type=int, default=12, help="ops listed")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    print(json.dumps(profile_steps(parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
