"""The quality-aware cascade, offline: which signal finds the small model's errors, and the
per-pair thresholds that defer a target share of requests to the large model (issue #44).

    python -m bench.cascade --calibrate --outputs bench/out/model_quality.json \\
        --defer-share 0.3 --out bench/out/cascade.json \\
        --out-thresholds workers/stages/cascade/thresholds.json

Inputs: the small and the large model's translations of the held-out dev items
(`bench.model_quality`'s `--out`: BConTrasT dev both ways, FLORES devtest en<->de/fr/es/it),
so both answers are the engine's own at the worker's weight format. This bench adds the
deferral signals of `workers/stages/cascade/rules.py` for every item:

* `large_logprob`: the large model scores the small model's answer (`Engine.score_request`, one
  batched prefill each, no decoding);
* `small_logprob`: the small model scores its own answer the same way, and `small_total` is
  that mean times the answer's tokens (its whole log-probability);
* `checks`: the output checks' verdict on the small answer (`faithful.rules.check`);

and compares, per (set, pair) and over all items, what each ranking recovers: the chrF of the
cascade that defers the lowest-scoring share s of the items (s in `--shares`), as the share of
the large model's gain over the small one it recovers (`recovered`: 0 = the small model alone,
1 = the large one). Two reference rankings frame them: `oracle` (by the sentence-level chrF the
large answer gains; unattainable) and `random`.

With `--calibrate`, the thresholds per language pair (on its support chats where the dev sets
have them, BConTrasT de<->en, else its FLORES sentences) for
`--defer-share` of the chosen signal (`--signal`; default: the one that recovers most at that
share over all items), plus the output checks, are written to `--out-thresholds` and evaluated
(issue #44 Done-when 1: each dev pair within 1.0 chrF of the large model alone, paired
bootstrap, at most 50 % deferred):

* in-sample: the thresholds applied to the items they were calibrated on;
* held out: two folds (odd and even items of each pair), each fold's thresholds applied to the
  other fold: the figure to expect on sentences the calibration did not see.

The scores are kept in the JSON (`scores`), and `--reuse-scores FILE` takes them from an earlier
run instead of loading the models again. JSON on stdout (and `--out`).

With `--serving` (needs the local stack), the served cascade instead: `bench.serving`'s open
loop (`--rates`, `--mix`, `--duration`, one seed: the same texts at the same times) against
three `tolk worker`s in turn: the small model alone, `--cascade LARGE` with `--thresholds`
(with `--compare-early` also the same cascade with `--no-cascade-early`: every small answer
decoded whole before it is judged), and the large model alone (`--repeats` rounds of the
arms, each arm's median over them: one 60-s point of one worker moved 0.096-0.142 s between
runs); per rate the cascade's P50 over the small model's (issue #44 Done-when 2: <= 1.3) and
its P99 of OK replies over the large model's (<= 1.0; of OK replies because a withheld answer
makes the P99 of all offered requests infinite).

    python -m bench.cascade --serving --rates 1 --duration 60 --repeats 2 \
        --thresholds workers/stages/cascade/thresholds.json --out bench/out/cascade-serving.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import dump, machine_info, parse_csv, safe_ratio, write_json
from bench.model_quality import Item, held_out_items
from replay.quality import chrf_statistics
from replay.stats import chrf_from_sums, paired_bootstrap
from workers.stages.cascade.rules import SCORER, SIGNALS, CascadeThresholds, signal_value

SHARES = "0.1,0.2,0.3,0.4,0.5,0.6"
SUPPORT_SET = "bcontrast"  # real support chats: a pair's calibration set where it has them
WITHIN_CHRF = 1.0  # Done-when 1: the cascade within this many chrF of the large model alone
MAX_SHARE = 0.5  # ... while deferring at most this share


# -- inputs ---------------------------------------------------------------------------------


def load_outputs(path: Path, small: str, large: str) -> tuple[list[Item], list[str], list[str]]:
    """The items of a `bench.model_quality` run and the two models' translations of them,
    checked to be the same items (their count and each pair's first source)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    outputs = data["outputs"]
    missing = [m for m in (small, large) if m not in outputs]
    if missing:
        raise SystemExit(f"{path} has no translations by {missing}; it has {sorted(outputs)}")
    pairs = data["pairs"]
    n_bcontrast = pairs.get("bcontrast:de-en", {}).get("n", 0)
    n_flores = pairs.get("flores:en-de", {}).get("n", 0)
    items = held_out_items(n_bcontrast, n_flores)
    if len(items) != len(outputs[small]):
        raise SystemExit(f"{path}: {len(outputs[small])} outputs for {len(items)} items")
    for key, row in pairs.items():
        first = next(i for i in items if f"{i.subset}:{i.pair}" == key)
        if row["sample"]["source"] != first.source:
            raise SystemExit(f"{path}: the items of {key} are not this checkout's")
    return items, list(outputs[small]), list(outputs[large])


def score_answers(
    model: str, quantize: str | None, items: Sequence[Item], answers: Sequence[str]
) -> list[tuple[float, int] | None]:
    """`model`'s mean log-probability of each answer as its translation of the item's source,
    through its own prompt, and the answer's tokens (None for an empty answer)."""
    from workers.engine.engine import Engine, EngineConfig

    engine = Engine.from_config(EngineConfig(model=model, quantize=quantize))
    todo = [(i, item, a) for i, (item, a) in enumerate(zip(items, answers, strict=True)) if a]
    requests = [
        engine.score_request(item.source, item.source_lang, item.target_lang, a, request_id=str(i))
        for i, item, a in todo
    ]
    results = engine.generate(requests)
    del engine
    scores: list[tuple[float, int] | None] = [None] * len(items)
    for (i, _, _), result in zip(todo, results, strict=True):
        if not result.ok or result.logprob is None:
            raise RuntimeError(f"scoring item {i} failed: {result.finish_reason} {result.error}")
        scores[i] = (result.logprob, result.scored_tokens)
    return scores


def check_flags(items: Sequence[Item], answers: Sequence[str]) -> list[bool]:
    """Whether the output checks doubt each small answer (what the worker's checks see)."""
    from workers.stages.faithful.rules import check

    return [
        not answer
        or check(item.source, answer, (), item.target_lang, source_lang=item.source_lang).suspect
        for item, answer in zip(items, answers, strict=True)
    ]


# -- what a ranking recovers ----------------------------------------------------------------


def chrf(stats: np.ndarray) -> float:
    return float(chrf_from_sums(stats.sum(axis=0)[None, :])[0]) if len(stats) else 0.0


def deferred_lowest(scores: Sequence[float | None], share: float) -> np.ndarray:
    """The round(share * n) items with the lowest scores (None: lowest of all)."""
    n = len(scores)
    k = round(share * n)
    keys = [(-np.inf if s is None else s, i) for i, s in enumerate(scores)]
    chosen = [i for _, i in sorted(keys)[:k]]
    mask = np.zeros(n, dtype=bool)
    mask[chosen] = True
    return mask


def cascade_stats(small: np.ndarray, large: np.ndarray, deferred: np.ndarray) -> np.ndarray:
    return np.where(deferred[:, None], large, small)


def rankings(
    scores: dict[str, list[float | None]], flags: Sequence[bool], gain: np.ndarray, seed: int
) -> dict[str, list[float | None]]:
    """Scores to rank by (lower = defer first): each signal, each signal with the checks'
    suspects first, the oracle and random."""
    out: dict[str, list[float | None]] = {}
    for name, values in scores.items():
        out[name] = list(values)
        out[f"{name}+checks"] = [None if f else v for v, f in zip(values, flags, strict=True)]
    out["oracle"] = [float(-g) for g in gain]
    out["random"] = [float(x) for x in np.random.default_rng(seed).random(len(gain))]
    return out


def curves(
    indices: Sequence[int],
    ranks: dict[str, list[float | None]],
    small: np.ndarray,
    large: np.ndarray,
    shares: Sequence[float],
) -> dict[str, Any]:
    """For one group of items: chrF of small and large alone, per ranking and share the
    cascade's chrF and the share of the large model's gain it recovers, and per ranking the
    least share that brings it within `WITHIN_CHRF` of the large model (`within_at`, None:
    none of `shares`; the oracle's is what Done-when 1 can ask of any signal on these items)."""
    s, la = small[indices], large[indices]
    small_chrf, large_chrf = chrf(s), chrf(la)
    gap = large_chrf - small_chrf
    row: dict[str, Any] = {
        "n": len(indices),
        "small_chrF": round(small_chrf, 2),
        "large_chrF": round(large_chrf, 2),
        "rankings": {},
        "within_at": {},
    }
    for name, values in ranks.items():
        picked = [values[i] for i in indices]
        points: dict[str, dict[str, float | None]] = {}
        within: float | None = None
        for share in sorted(shares):
            c = chrf(cascade_stats(s, la, deferred_lowest(picked, share)))
            if within is None and large_chrf - c <= WITHIN_CHRF:
                within = share
            points[f"{share:g}"] = {
                "chrF": round(c, 2),
                "recovered": round((c - small_chrf) / gap, 3) if abs(gap) > 1e-9 else None,
            }
        row["rankings"][name] = points
        row["within_at"][name] = within
    return row


# -- calibration ----------------------------------------------------------------------------


def pair_indices(items: Sequence[Item]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        out.setdefault(item.pair, []).append(i)
    return out


def set_indices(items: Sequence[Item]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        out.setdefault(f"{item.subset}:{item.pair}", []).append(i)
    return out


def evaluate(
    thresholds_of: Callable[[int], CascadeThresholds],
    items: Sequence[Item],
    indices: Sequence[int],
    scores: Sequence[float | None],
    flags: Sequence[bool],
    small: np.ndarray,
    large: np.ndarray,
) -> dict[str, Any]:
    """The cascade on `indices`, item i decided by `thresholds_of(i)`: share deferred, its
    chrF, and the large model's chrF minus the cascade's with its paired-bootstrap interval."""
    decisions = [
        thresholds_of(i).decide(items[i].source_lang, items[i].target_lang, scores[i], flags[i])
        for i in indices
    ]
    deferred = np.array([d.defer for d in decisions])
    s, la = small[list(indices)], large[list(indices)]
    c = cascade_stats(s, la, deferred)
    diff = paired_bootstrap(c, la, chrf_from_sums)  # large - cascade
    share = float(deferred.mean()) if len(deferred) else 0.0
    return {
        "n": len(indices),
        "deferred_share": round(share, 3),
        "by_check": sum(d.reason == "check" for d in decisions),
        "cascade_chrF": round(chrf(c), 2),
        "small_chrF": round(chrf(s), 2),
        "large_chrF": round(chrf(la), 2),
        "large_minus_cascade": [round(diff.estimate, 2), round(diff.low, 2), round(diff.high, 2)],
        "met": diff.estimate <= WITHIN_CHRF and share <= MAX_SHARE,
    }


def calibrate_and_evaluate(
    items: Sequence[Item],
    scores: Sequence[float | None],
    flags: Sequence[bool],
    small: np.ndarray,
    large: np.ndarray,
    make: Callable[[dict[str, list[float]], dict[str, int]], CascadeThresholds],
) -> dict[str, Any]:
    """In-sample (calibrate on all, apply to all) and two-fold held out, per dev set and pair."""

    def fitted(on: Sequence[int]) -> CascadeThresholds:
        # the scores of the answers the checks let through; the others are deferred anyway.
        # A pair with support chats is calibrated on them alone: they are what the worker
        # serves, and a threshold fitted to news sentences too defers few of them
        support = {items[i].pair for i in on if items[i].subset == SUPPORT_SET}
        on = [i for i in on if items[i].subset == SUPPORT_SET or items[i].pair not in support]
        by_pair: dict[str, list[float]] = {}
        checked: dict[str, int] = {}
        for i in on:
            score = scores[i]
            if flags[i] or score is None:
                checked[items[i].pair] = checked.get(items[i].pair, 0) + 1
            else:
                by_pair.setdefault(items[i].pair, []).append(score)
        return make(by_pair, checked)

    everything = list(range(len(items)))
    full = fitted(everything)
    folds = [everything[0::2], everything[1::2]]
    fold_thresholds = [fitted(folds[1]), fitted(folds[0])]  # fold k is judged by the other's
    groups = {"all": everything, **set_indices(items), **pair_indices(items)}
    report: dict[str, Any] = {"thresholds": full.to_json(), "in_sample": {}, "held_out": {}}
    for name, indices in groups.items():
        report["in_sample"][name] = evaluate(
            lambda _i: full, items, indices, scores, flags, small, large
        )
        # held out: each item decided by the thresholds of the fold it is not in
        report["held_out"][name] = evaluate(
            lambda i: fold_thresholds[i % 2], items, indices, scores, flags, small, large
        )
    return report


# -- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    items, small_texts, large_texts = load_outputs(Path(args.outputs), args.small, args.large)
    quantize = None if args.quantize == "none" else args.quantize
    timings: dict[str, float] = {}
    scores: dict[str, list[float | None]] = {}
    if args.reuse_scores:  # what an earlier run has; the rest is scored below
        kept = json.loads(Path(args.reuse_scores).read_text(encoding="utf-8"))["scores"]
        scores = {name: kept[name] for name in SIGNALS if name in kept}
    for role, model in (("large", args.large), ("small", args.small)):
        wanted = [s for s in SIGNALS if SCORER[s] == role and s not in scores]
        if not wanted:
            continue
        t0 = time.perf_counter()
        scored = score_answers(model, quantize, items, small_texts)
        timings[role] = round(time.perf_counter() - t0, 1)
        for signal in wanted:
            scores[signal] = [None if x is None else signal_value(signal, *x) for x in scored]
    flags = check_flags(items, small_texts)
    refs = [i.reference for i in items]
    small = chrf_statistics(small_texts, refs)
    large = chrf_statistics(large_texts, refs)
    gain = chrf_from_sums(large) - chrf_from_sums(small)  # sentence-level chrF gained
    ranks = rankings(scores, flags, gain, args.seed)
    shares = [float(s) for s in parse_csv(args.shares)]
    groups = {"all": list(range(len(items))), **set_indices(items)}
    result: dict[str, Any] = {
        "bench": "cascade",
        "machine": machine_info(),
        "small": args.small,
        "large": args.large,
        "quantize": args.quantize,
        "items": len(items),
        "scoring_s": timings,
        "checks_flagged": int(sum(flags)),
        "curves": {g: curves(ix, ranks, small, large, shares) for g, ix in groups.items()},
    }
    if args.calibrate:
        signal = args.signal or best_signal(result["curves"]["all"], args.defer_share)
        made_on = f"{len(items)} dev items ({args.outputs}), {time.strftime('%Y-%m-%d')}"

        def make(by_pair: dict[str, list[float]], checked: dict[str, int]) -> CascadeThresholds:
            return CascadeThresholds.calibrate(
                by_pair, args.defer_share, small=args.small, large=args.large,
                signal=signal, calibrated_on=made_on, checked=checked,
            )  # fmt: skip

        result["calibration"] = calibrate_and_evaluate(
            items, scores[signal], flags, small, large, make
        )
        result["calibration"]["signal"] = signal
        if args.out_thresholds:
            CascadeThresholds.from_json(result["calibration"]["thresholds"]).save(
                args.out_thresholds
            )
    result["scores"] = {**scores, "checks": flags}
    return result


def serving(args: argparse.Namespace) -> dict[str, Any]:
    """The three workers under the same load, one after another, `--repeats` rounds in turn
    (small, cascade, large, small, ...: a drift of the machine reaches all three alike); per
    arm and rate the median P50 and P99 of OK over the rounds, each round's P50 kept."""
    from bench import serving as bench_serving
    from bench.first_start import by_rate, median_of_starts

    small_flags = f"--no-cache {args.small_flags}".strip()
    cascade_flags = f"{small_flags} --cascade {args.large} --cascade-thresholds {args.thresholds}"
    arms = {"small": (args.small, small_flags), "cascade": (args.small, cascade_flags)}
    if args.compare_early:  # the same cascade, every small answer decoded whole
        arms["cascade_whole"] = (args.small, f"{cascade_flags} --no-cascade-early")
    arms["large"] = (args.large, f"--no-cache {args.large_flags}".strip())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for round_ in range(args.repeats):
        for name, (model, worker_args) in arms.items():
            argv = [
                "--systems", "tolk", "--model", model, f"--worker-args={worker_args}",
                "--rates", args.rates, "--mix", args.mix, "--duration", str(args.duration),
                "--repeats", "1", "--seed", str(args.seed),
            ]  # fmt: skip
            ns = bench_serving.parse_args(argv)
            ns.argv = argv
            runs[name].append(by_rate(bench_serving.run(ns)))
            print(f"[cascade] {name} round {round_}: {runs[name][-1]}", file=sys.stderr, flush=True)
    figures = {name: median_of_starts(rows) for name, rows in runs.items()}
    for rate, row in figures["cascade"].items():  # the outcomes of every round together
        counts: Counter[str] = Counter()
        for one in runs["cascade"]:
            counts.update(one.get(rate, {}).get("cascade_outcomes", {}))
        row["cascade_outcomes"] = dict(counts)
    ratios: dict[str, Any] = {}
    for rate, cascade in figures["cascade"].items():
        small, large = figures["small"].get(rate, {}), figures["large"].get(rate, {})
        whole = figures.get("cascade_whole", {}).get(rate, {})
        p50 = safe_ratio(cascade["p50_s"], small.get("p50_s"))
        p99 = safe_ratio(cascade["p99_ok_s"], large.get("p99_ok_s"))
        outcomes = cascade.get("cascade_outcomes", {})
        answered = sum(outcomes.values())
        ratios[rate] = {
            "p50_over_small": p50,
            "p99_ok_over_large": p99,
            "met": p50 is not None and p99 is not None and p50 <= 1.3 and p99 <= 1.0,
            # in service: the share the large model answered, and the small answers sent flagged
            "deferred_share": round(outcomes.get("deferred", 0) / answered, 3)
            if answered
            else None,
            "deadline_share": round(outcomes.get("deadline", 0) / answered, 3)
            if answered
            else None,
        }
        if whole:  # --compare-early: what stopping the small answers early changed
            ratios[rate]["p50_over_whole"] = safe_ratio(cascade["p50_s"], whole.get("p50_s"))
            ratios[rate]["p99_ok_over_whole"] = safe_ratio(
                cascade["p99_ok_s"], whole.get("p99_ok_s")
            )
    return {
        "bench": "cascade_serving",
        "machine": machine_info(),
        "arms": {k: f"tolk worker --model {m} {a}" for k, (m, a) in arms.items()},
        "figures": figures,
        "ratios": ratios,
    }


def best_signal(curve: dict[str, Any], share: float) -> str:
    """The signal whose ranking (with the checks first) recovers most at `share`."""
    key = f"{share:g}"
    points = curve["rankings"]

    def recovered(name: str) -> float:
        value = points.get(f"{name}+checks", {}).get(key, {}).get("recovered")
        return -1.0 if value is None else float(value)

    return max(SIGNALS, key=recovered)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--outputs", default="bench/out/model_quality.json")
    p.add_argument("--small", default="gemma3-270m")
    p.add_argument("--large", default="qwen2.5-coder-1.5b")
    p.add_argument("--quantize", default="int8", help="int8, int4 or none (float32)")
    p.add_argument("--shares", default=SHARES)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--defer-share", type=float, default=0.3)
    p.add_argument("--signal", choices=SIGNALS, default=None)
    p.add_argument("--out-thresholds", default=None)
    p.add_argument("--reuse-scores", default=None, help="a cascade JSON whose scores to reuse")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serving", action="store_true", help="the served cascade (module notes)")
    p.add_argument("--thresholds", default="workers/stages/cascade/thresholds.json")
    p.add_argument("--rates", default="1")
    p.add_argument("--mix", default="de=0.5,en=0.5")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=1, help="--serving: rounds of the three arms")
    p.add_argument(
        "--small-flags", default="",
        help="--serving: `tolk worker` flags of the small model (its arm and the cascade's), "
        "e.g. '--quantize int8 --compile-decode' where no probe of it is stored",
    )  # fmt: skip
    p.add_argument(
        "--large-flags", default="",
        help="--serving: flags of the large model's own arm; where no probe of the large "
        "model is stored, the cascade's large engine runs its unmeasured choice: name it "
        "here (e.g. '--quantize int8 --no-compile-decode') so the two arms compare alike",
    )  # fmt: skip
    p.add_argument(
        "--compare-early", action="store_true",
        help="--serving: a fourth arm, the cascade with --no-cascade-early",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = serving(args) if args.serving else run(args)
    write_json(result, args.out)
    print(dump({k: v for k, v in result.items() if k != "scores"}), flush=True)


if __name__ == "__main__":
    main()
