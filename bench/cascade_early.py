"""What the cascade's early deferral saves (issue #44, workers/stages/cascade/stage.py): the
small model's decoding of answers the cascade defers anyway.

    python -m bench.cascade_early --bcontrast 100 --flores 0 --out bench/out/cascade_early.json

For each held-out item (`bench.model_quality`'s sets: BConTrasT dev both ways, `--flores N`
FLORES devtest sentences per pair too), the small model (`--small` at `--quantize`) translates
it twice, each request alone (no batch: the seconds are the request's own), the two runs of an
item back to back (a drift of the host reaches both):

* **whole**: with its tokens' log-probabilities, as the cascade without early deferral
  (`--no-cascade-early`): the answer decoded to its end, then judged;
* **early**: with `stop_below` at its pair's threshold (`--thresholds`, the packaged file by
  default), as the served cascade does: the answer ends at the first token whose running total
  is under the threshold.

Per pair and over all: the share deferred by the score (whole answers whose total is under the
threshold), whether the early run gave every item the same verdict (it must: a sum of
log-probabilities only falls; a difference is a bug, or a tie within float noise), and over the
deferred items the small model's decoded tokens and seconds, whole against early: what a
deferred request no longer waits before the large model starts. JSON on stdout (and `--out`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench._common import dump, machine_info, write_json
from bench.model_quality import Item, held_out_items
from bench.serving_stats import percentile
from workers.stages.cascade.rules import CascadeThresholds


def measure(engine: Any, item: Item, stop_below: float | None) -> dict[str, Any]:
    """One request alone: its finish, decoded tokens, total log-probability and seconds."""
    request = engine.translation_request(
        item.source, item.source_lang, item.target_lang, logprobs=True, stop_below=stop_below
    )
    t0 = time.perf_counter()
    (result,) = engine.generate([request])
    seconds = time.perf_counter() - t0
    total = (result.logprob or 0.0) * result.scored_tokens
    return {
        "finish": result.finish_reason.value,
        "tokens": len(result.token_ids),
        "total": total,
        "seconds": seconds,
    }


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one group of items (module notes)."""
    deferred = [r for r in rows if r["deferred"]]
    out: dict[str, Any] = {
        "items": len(rows),
        "deferred_share": round(len(deferred) / len(rows), 3) if rows else None,
        "same_verdict": sum(r["deferred"] == (r["early"]["finish"] == "below") for r in rows),
        "all_seconds_mean": {
            k: round(statistics.fmean(r[k]["seconds"] for r in rows), 4) if rows else None
            for k in ("whole", "early")
        },
    }
    if deferred:
        tokens = {k: sum(r[k]["tokens"] for r in deferred) for k in ("whole", "early")}
        seconds = {k: sum(r[k]["seconds"] for r in deferred) for k in ("whole", "early")}
        out["deferred"] = {
            "tokens": tokens,
            "tokens_saved_share": round(1 - tokens["early"] / tokens["whole"], 3),
            "seconds_mean": {k: round(v / len(deferred), 4) for k, v in seconds.items()},
            "seconds_saved_share": round(1 - seconds["early"] / seconds["whole"], 3),
            "seconds_p90": {
                k: round(percentile([r[k]["seconds"] for r in deferred], 90.0) or 0.0, 4)
                for k in ("whole", "early")
            },
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers.engine.engine import Engine, EngineConfig

    thresholds = CascadeThresholds.load(args.thresholds)
    if not thresholds.signal.endswith("_total"):
        raise SystemExit(f"{args.thresholds}: signal {thresholds.signal} is not a total")
    items = held_out_items(args.bcontrast, args.flores)
    quantize = None if args.quantize == "none" else args.quantize
    t0 = time.perf_counter()
    engine = Engine.from_config(EngineConfig(model=args.small, quantize=quantize))
    load_s = time.perf_counter() - t0
    measure(engine, items[0], None)  # warm: the first request pays one-off costs
    rows: list[dict[str, Any]] = []
    for item in items:
        limit = thresholds.threshold(item.source_lang, item.target_lang)
        whole = measure(engine, item, None)
        early = measure(engine, item, limit)
        rows.append({
            "group": f"{item.subset}:{item.pair}", "threshold": limit,
            "deferred": whole["total"] < limit, "whole": whole, "early": early,
        })  # fmt: skip
    groups = sorted({r["group"] for r in rows})
    return {
        "bench": "cascade_early",
        "machine": machine_info(),
        "small": args.small,
        "quantize": args.quantize,
        "thresholds": str(args.thresholds),
        "signal": thresholds.signal,
        "load_s": round(load_s, 1),
        "all": summary(rows),
        "groups": {g: summary([r for r in rows if r["group"] == g]) for g in groups},
        "rows": rows,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", default="gemma3-270m")
    p.add_argument("--quantize", default="int8", help="int8, int4 or none (float32)")
    p.add_argument("--thresholds", default="workers/stages/cascade/thresholds.json")
    p.add_argument("--bcontrast", type=int, default=100, help="BConTrasT dev turns each way")
    p.add_argument("--flores", type=int, default=0, help="FLORES devtest sentences per pair")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    write_json(result, args.out)
    print(dump({k: v for k, v in result.items() if k != "rows"}), flush=True)


if __name__ == "__main__":
    main()
