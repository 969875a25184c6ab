"""Deadline admission under one language's overload, in simulation (issue 25, item 5).

    python -m bench.admission [--duration 300] [--seeds 0,1,2] [--lights it,en] [--out x.json]

The worker's admission path (`EngineAdmission`: precheck at submission, the scheduler's hook,
learning on finish) on the engine's real scheduler and a simulated clock
(`workers.serving.sim_admission.overload_scenario`, `simulate`): a heavy language (de) offers
`--overload` x the engine's capacity, a light one (`--lights`: it, weight 1 and a 6 s SLO, or
en, weight 3 and 3 s) `--light-fraction` of its weighted share, deadlines = arrival + the
language's SLO (DEFAULT_POLICIES; de: weight 4, 2 s), the VTC queue with the worker's burst
credit (256). Cases: the light language's requests one at a time, or in
groups of `--group` arriving together (a chat turn split into segments); batch caps 8 and 16.
Per language: offered, OK, REJECTED at submission, EXPIRED or refused at admission, P99 of the
OK and late ones, goodput (OK within the SLO / offered). No model and no Kafka: the step costs
are CPU anchors measured on a 2-thread CPU (`CostModel` defaults), so it runs in seconds on
any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from bench._common import machine_info
from workers.serving.sim_admission import overload_scenario
from workers.serving.simulate import simulate

CASES: dict[str, dict[str, Any]] = {
    "singles-batch8": {"max_batch": 8},
    "groups-batch8": {"max_batch": 8, "group": True},
    "singles-batch16": {"max_batch": 16},
    "groups-batch16": {"max_batch": 16, "group": True},
}


def run_case(
    case: dict[str, Any], args: argparse.Namespace, light: str, seed: int
) -> dict[str, Any]:
    cfg = overload_scenario(
        light=light,
        overload=args.overload,
        light_share_fraction=args.light_fraction,
        light_group=args.group if case.get("group") else 1,
        max_batch=case["max_batch"],
        duration_s=args.duration,
        seed=seed,
    )
    res = simulate(cfg)
    out: dict[str, Any] = {}
    for lang, r in res.languages.items():
        out[lang] = {
            "offered_rps": round(cfg.languages[lang].rate_rps, 3),
            "slo_s": r.slo_s,
            "offered": r.arrived,
            "ok": r.completed,
            "rejected_at_submit": r.rejected,
            "dropped_at_admission": r.expired - r.rejected,
            "p99_s": None if math.isnan(r.latency_p99_s) else round(r.latency_p99_s, 2),
            "goodput": None if math.isnan(r.goodput) else round(r.goodput, 4),
        }
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--overload", type=float, default=3.0)
    p.add_argument("--light-fraction", type=float, default=0.1)
    p.add_argument("--group", type=int, default=6, help="light requests per arrival (groups)")
    p.add_argument("--lights", default="it,en", help="light languages, one run each")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    result: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "cases": {}}
    for light in [g.strip() for g in args.lights.split(",") if g.strip()]:
        for name, case in CASES.items():
            runs = {str(s): run_case(case, args, light, s) for s in seeds}
            result["cases"][f"{light}-{name}"] = runs
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    for name, runs in result["cases"].items():
        for seed, langs in runs.items():
            line = "  ".join(
                f"{g}: ok {v['ok']}/{v['offered']} rej {v['rejected_at_submit']} "
                f"p99 {v['p99_s']} gp {v['goodput']}"
                for g, v in langs.items()
            )
            print(f"{name} seed {seed}: {line}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
