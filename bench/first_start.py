"""First starts on a machine never seen: where the default worker ends up, and how fast it serves.

    python -m bench.first_start --starts 5 --hog-s 60 --rate 1 --duration 60 \\
        --explicit "int8,int8+compiled,float32+compiled" --out bench/out/first_start.json

Issue #47's check of the auto configuration (workers/engine/tuner.py, autoprobe.py). In one run:

1. `--starts` first starts of the default `tolk worker` (no --quantize / --compile-decode), each
   from an **empty cache directory** (TOLK_CACHE_DIR: nothing converted, compiled or probed)
   with a **busy loop on one core for the first `--hog-s` seconds** (`bench.serving_kafka.
   start_hog`, other work on the host while it starts). Each is measured by the serving bench
   (`bench.serving`, open loop at `--rate` req/s for `--duration` s) once its tuner settled:
   the seconds to consuming, to the settled configuration, which one, and its P50 / P99;
2. the **explicit configurations** (`--explicit`, each as `tolk worker --quantize W
   [--compile-decode]`, the cache warm) under the same load, one start each;
3. per first start: its P50 over the best explicit configuration's P50 (issue #47's Done-when
   1: within 1.10).

JSON on stdout (and `--out`). Needs the local stack. A first start compiles every gated
format's decode graphs (minutes each on two cores): the run takes ~10 min per start.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from bench._common import JSON, dump, machine_info, parse_csv, write_json

WITHIN = 1.10  # a first start's served P50 over the best explicit configuration's


def flags_of(label: str) -> str:
    """`tolk worker` flags of a candidate label: "int8+compiled" -> "--quantize int8
    --compile-decode"."""
    weights, _, compiled = label.partition("+")
    quantize = "none" if weights == "float32" else weights
    return f"--quantize {quantize} {'--compile-decode' if compiled else '--no-compile-decode'}"


def serving_args(args: argparse.Namespace, *extra: str) -> argparse.Namespace:
    from bench import serving

    argv = [
        "--systems", "tolk", "--rates", str(args.rate), "--mix", args.mix,
        "--duration", str(args.duration), "--model", args.model, *extra,
    ]  # fmt: skip
    ns = serving.parse_args(argv)
    ns.argv = argv
    return ns


def p50(result: JSON) -> tuple[float | None, float | None]:
    """(P50, P99 of OK replies) over all languages of a one-point serving result."""
    (row,) = result["runs"]
    figures = row["languages"]["all"]
    return figures.get("p50_s"), figures.get("p99_ok_s")


def run(args: argparse.Namespace) -> JSON:
    from bench import serving

    starts: list[JSON] = []
    for i in range(args.starts):
        ns = serving_args(
            args, "--repeats", "1", "--fresh-cache", "--hog-s", str(args.hog_s),
            "--worker-args", "--no-cache", "--seed", str(i),
        )  # fmt: skip
        result = serving.run(ns)
        (info,) = result["starts"]
        p50_s, p99_s = p50(result)
        row = {
            "start": i,
            "start_to_consuming_s": info.get("start_to_assigned_s"),
            "consuming_to_settled_s": info.get("assigned_to_tuned_s"),
            "config": info.get("tuned_config"),
            "p50_s": p50_s,
            "p99_ok_s": p99_s,
        }
        starts.append(row)
        print(f"[first_start] {row}", file=sys.stderr, flush=True)
    explicit: dict[str, JSON] = {}
    for label in parse_csv(args.explicit):
        ns = serving_args(args, "--repeats", "1", "--worker-args", f"--no-cache {flags_of(label)}")
        p50_s, p99_s = p50(serving.run(ns))
        explicit[label] = {"p50_s": p50_s, "p99_ok_s": p99_s}
        print(f"[first_start] explicit {label}: {explicit[label]}", file=sys.stderr, flush=True)
    served = {k: v["p50_s"] for k, v in explicit.items() if v["p50_s"] is not None}
    best = min(served, key=lambda k: served[k]) if served else None
    for row in starts:
        if best is not None and row["p50_s"] is not None:
            row["p50_over_best"] = round(row["p50_s"] / served[best], 3)
            row["within"] = row["p50_over_best"] <= WITHIN
    return {
        "bench": "first_start",
        "command": "python -m bench.first_start " + " ".join(args.argv),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "argv")},
        "definitions": {
            "start_to_consuming_s": "process start -> partition assignment (serving begins)",
            "consuming_to_settled_s": "-> the tuner moved to the probe's choice or kept its own",
            "p50_s": f"all languages, open loop at {args.rate:g} req/s for {args.duration:g} s, "
            "measured once settled",
            "p50_over_best": f"over the fastest explicit configuration's P50 (pass <= {WITHIN})",
        },
        "starts": starts,
        "explicit": explicit,
        "best_explicit": best,
        "all_within": all(r.get("within") for r in starts) if starts else None,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--hog-s", type=float, default=60.0, help="busy loop on one core, first N s")
    p.add_argument("--rate", type=float, default=1.0, help="total requests/s")
    p.add_argument("--mix", default="de=0.5,en=0.5")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--explicit", default="int8,int8+compiled,float32,float32+compiled")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result: Any = run(args)
    print(dump(result))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
