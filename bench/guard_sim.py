"""The canary guard's two decision rules on the same simulated traffic (issue #29, Done-when 1).

    python -m bench.guard_sim [--traces 1000] [--harm-traces 300] [--hours 1] [--out x.json]

A rollout of one language for `--hours`, judged every 30 s window by `workers.guard.policy.
decide` exactly as `tolk guard` judges it, once with `decision="sequential"` (the default) and
once with `decision="windows"`, on the same traces. Traffic: `--rate` replies a second for the
language (1), split between the arms by the rollout's share at the time (5 % at the start, then
the default steps 25, 50, 100 as the rule promotes); each reply is *bad* (error) with the arm's
probability and has a log-normal latency (median `--median-ms`, sigma 0.5), over the
language's 2 s SLO or not. The windows rule sees each window's P95 / P99 from the replies'
latencies; the sequential rule sees the counts. The level is split over `--languages` (2), as
a guard of two languages splits it.

Scenarios (canary vs stable at 2 % bad replies, median 400 ms):
- `aa`: the canary is the stable arm (A/A): every rollback is a false one;
- `errors_x2`: the canary's bad replies at 4 %;
- `latency_x1.5`: the canary's latencies 1.5x;
- `withholds_10pct`: the canary withholds 10 % of its answers (bad: withheld is what the
  customer does not get).

Per scenario and rule: rolled back (share of traces), time to rollback (P10 / P50 / P90 over
the traces that rolled back, from the start), completed (100 %), and still in rollout at the
end. JSON on stdout (and `--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench._common import machine_info
from workers.fairness.policy import LanguagePolicy
from workers.guard.policy import GuardPolicy, RolloutState, decide
from workers.guard.windows import WindowStats

SLO = LanguagePolicy(weight=1.0, slo_p99_s=2.0, max_queue=64, max_new_tokens=64)
WINDOW_MS = 30_000


@dataclass(frozen=True)
class Arm:
    bad: float = 0.02  # probability a reply is bad (error / expired / withheld)
    median_ms: float = 400.0
    sigma: float = 0.5  # log-normal latency


SCENARIOS: dict[str, tuple[Arm, Arm]] = {  # (stable, canary)
    "aa": (Arm(), Arm()),
    "errors_x2": (Arm(), Arm(bad=0.04)),
    "latency_x1.5": (Arm(), Arm(median_ms=600.0)),
    "withholds_10pct": (Arm(), Arm(bad=0.02 + 0.98 * 0.10)),
}


def _window(rng: np.random.Generator, arm: Arm, name: str, n: int, start: int) -> WindowStats:
    lat = arm.median_ms * np.exp(arm.sigma * rng.standard_normal(n))
    bad = int(rng.binomial(n, arm.bad)) if n else 0
    return WindowStats(
        "de",
        name,
        start,
        start + WINDOW_MS,
        n,
        bad,
        0,
        0,
        float(np.percentile(lat, 95)) if n else math.nan,
        float(np.percentile(lat, 99)) if n else math.nan,
        over_slo=int((lat > SLO.slo_p99_s * 1000).sum()),
    )


def run_trace(
    seed: int, stable: Arm, canary: Arm, policy: GuardPolicy, hours: float, rate: float
) -> dict[str, Any]:
    """One rollout under one rule: what happened and when (seconds from the start)."""
    rng = np.random.default_rng(seed)
    state = RolloutState("r", "de", "stable", "v2", 5.0, judge_from_ms=0)
    for w in range(int(hours * 3600 * 1000 // WINDOW_MS)):
        start = w * WINDOW_MS
        total = int(rng.poisson(rate * WINDOW_MS / 1000))
        n_c = int(rng.binomial(total, state.share / 100))
        d = decide(
            state,
            _window(rng, canary, "v2", n_c, start),
            _window(rng, stable, "stable", total - n_c, start),
            SLO,
            policy,
        )
        if d is None:
            continue
        state = d.state
        if d.action == "ROLLBACK":
            return {"outcome": "rolled_back", "at_s": d.window_end_ms / 1000}
        if d.action == "COMPLETE":
            return {"outcome": "complete", "at_s": d.window_end_ms / 1000}
    return {"outcome": "in_rollout", "share": state.share}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(results)
    back = sorted(r["at_s"] for r in results if r["outcome"] == "rolled_back")
    done = sorted(r["at_s"] for r in results if r["outcome"] == "complete")

    def q(values: list[float], p: float) -> float | None:
        return round(float(np.percentile(values, p)), 1) if values else None

    return {
        "traces": n,
        "rolled_back": round(len(back) / n, 4),
        "rollback_s_p10_p50_p90": [q(back, 10), q(back, 50), q(back, 90)],
        "completed": round(len(done) / n, 4),
        "complete_s_p50": q(done, 50),
        "in_rollout_at_end": round(sum(r["outcome"] == "in_rollout" for r in results) / n, 4),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", type=int, default=1000, help="A/A traces")
    p.add_argument("--harm-traces", type=int, default=300, help="traces per harm scenario")
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=1.0, help="replies per second, both arms")
    p.add_argument("--languages", type=int, default=2, help="the level is split over them")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rules = {
        "sequential": GuardPolicy(languages=args.languages),
        "windows": GuardPolicy(decision="windows", languages=args.languages),
    }
    out: dict[str, Any] = {
        "bench": "guard_sim",
        "machine": machine_info(),
        "settings": {**vars(args), "window_s": WINDOW_MS / 1000, "slo_s": SLO.slo_p99_s},
        "policies": {k: asdict(v) for k, v in rules.items()},
        "scenarios": {},
    }
    for name, (stable, canary) in SCENARIOS.items():
        traces = args.traces if name == "aa" else args.harm_traces
        out["scenarios"][name] = {
            rule: summarize(
                [
                    run_trace(seed, stable, canary, policy, args.hours, args.rate)
                    for seed in range(traces)
                ]
            )
            for rule, policy in rules.items()
        }
        print(f"[guard_sim] {name}: {json.dumps(out['scenarios'][name])}", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
