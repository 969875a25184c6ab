"""The replay report: per language and direction, per arm, and B vs A with verdicts.

`write_report(run_dir)` reads a replay run directory (the format of docs/REPLAY.md: run.json,
requests.jsonl, replies.jsonl, problems.jsonl), and writes report.json, report.md and
report.html into it. The JSON (also returned) is the source of the other two.

How the numbers are made:
1. Replies are matched to requests by request id, per arm (`arm` of the reply, else its
   `model_version`). The first reply of an arm counts; later ones are counted as duplicates;
   a request an arm never answered is counted unanswered for it.
2. Per arm and request (`_measure`): status, latency (received_ms - sent_ms, client side,
   OK replies only, so a fast ERROR cannot make an arm look quick), and the quality measures
   of `replay.quality` on OK replies: chrF/BLEU statistics against the reference, off-target,
   empty, truncated, protected-span counts, intent agreement.
3. Groups: every target language ("de") and every direction ("en->de"). Per group and arm:
   status counts, latency P50/P95/P99, and each metric on all of the arm's OK replies.
4. Comparisons: every arm against the baseline (`baseline`, else run.json's "baseline", else
   the first arm of the noise pair, else the first arm). Differences are paired: only requests
   both arms answered OK (and, for chrF/BLEU, with a reference) count; intervals come from
   `replay.stats` (paired bootstrap, seeded).
5. Noise: a run with two copies of one arm (`noise_pair`, run.json's "noise_pair", or two
   arms named X and X' / X-copy) gets the A-A' comparison too; every other comparison's
   verdict then also needs |B-A| > |A-A'| (`stats.verdict`).
6. Sequential column (`replay.sequential`, issue #29): per comparison and metric, an
   anytime-valid confidence sequence of the paired per-segment difference and a verdict
   against a margin declared before the run: better / equivalent / worse / inconclusive.
"""

from __future__ import annotations

import functools
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replay import confseq, quality, sequential, stats
from replay.run_dir import PROBLEMS, ReplyLine, SentLine, iter_jsonl, read_replies, read_sent
from workers import reply_metadata

STATUSES = ("OK", "ERROR", "REJECTED", "EXPIRED")
# reply metadata key of the faithfulness outcome (= workers.stages.faithful.stage.NOTE_KEY; replay
# reads replies and imports no worker code): an ERROR reply whose value is "withheld" is counted
# under status "withheld", not ERROR (the worker kept an unfaithful text back: a quality
# outcome, not a service error; issue #28)
WITHHELD_KEY = reply_metadata.FAITHFUL
# the cascade's outcome on an OK reply (workers/stages/cascade/stage.py): an arm's share of
# replies the large model answered is its `deferred_share` (None for an arm without a cascade)
CASCADE_KEY = reply_metadata.CASCADE
PERCENTILES = (50, 95, 99)
NOISE_SUFFIXES = ("'", "\u2032", "-copy", "_copy")


@dataclass(frozen=True)
class Metric:
    """One quality metric: how its per-request rows are scored, and which way is better."""

    name: str
    higher_is_better: bool
    width: int  # columns of its per-request statistics row
    score: Callable[[np.ndarray, int], np.ndarray]  # (summed rows [d, width], n) -> [d]


METRICS = (
    Metric("chrf", True, 18, lambda sums, n: stats.chrf_from_sums(sums)),
    Metric("bleu", True, 10, lambda sums, n: stats.bleu_from_sums(sums)),
    Metric("off_target_rate", False, 1, stats.mean_from_sums),
    Metric("empty_rate", False, 1, stats.mean_from_sums),
    Metric("truncated_rate", False, 1, stats.mean_from_sums),
    Metric("span_preservation", True, 2, lambda sums, n: stats.ratio_from_sums(sums)),
    Metric("intent_agreement", True, 1, stats.mean_from_sums),
)
LATENCY_METRICS = tuple(f"latency_p{q}_ms" for q in PERCENTILES)


# --- reading the run directory ----------------------------------------------------------------


def _arm_of(reply: ReplyLine) -> str:
    return reply.arm or reply.model_version or "(none)"


def find_noise_pair(arms: list[str]) -> tuple[str, str] | None:
    """Two arms named X and X' (or X′, X-copy, X_copy): copies of one configuration."""
    for arm in arms:
        for suffix in NOISE_SUFFIXES:
            if arm + suffix in arms:
                return arm, arm + suffix
    return None


# --- per-request measures ---------------------------------------------------------------------


def _measure(
    requests: dict[str, SentLine], replies: dict[str, ReplyLine], languages: list[str]
) -> dict[str, dict[str, Any]]:
    """request_id -> measures of one arm's first replies (see the module doc, step 2)."""
    out: dict[str, dict[str, Any]] = {}
    ok = [rid for rid, rep in replies.items() if rep.status == "OK" and rid in requests]
    with_ref = [rid for rid in ok if requests[rid].reference]
    hyps = [replies[rid].text for rid in with_ref]
    refs = [str(requests[rid].reference) for rid in with_ref]
    chrf_rows = dict(zip(with_ref, quality.chrf_statistics(hyps, refs), strict=True))
    bleu_rows = dict(zip(with_ref, quality.bleu_statistics(hyps, refs), strict=True))
    for rid, reply in replies.items():
        if rid not in requests:
            continue
        req = requests[rid]
        m: dict[str, Any] = {"status": reply.status}
        out[rid] = m
        if m["status"] != "OK":
            # an ERROR whose text the worker's faithfulness checks kept back (issue #18)
            m["withheld"] = reply.metadata.get(WITHHELD_KEY) == "withheld"
            continue
        text = reply.text
        cascade = reply.metadata.get(CASCADE_KEY)
        if cascade:
            m["cascade"] = cascade
        m["latency_ms"] = reply.received_ms - req.sent_ms
        if rid in chrf_rows:
            m["chrf"], m["bleu"] = chrf_rows[rid], bleu_rows[rid]
        m["off_target_rate"] = [float(quality.off_target(text, req.target_lang, languages))]
        m["empty_rate"] = [float(quality.is_empty(text))]
        m["truncated_rate"] = [float(quality.is_truncated(req.text, text, reply.metadata))]
        spans = quality.span_preservation(req.text, text)
        if spans is not None and spans[1] > 0:
            m["span_preservation"] = [float(spans[0]), float(spans[1])]
    return out


def _add_intent_agreement(
    requests: dict[str, SentLine],
    measures: dict[str, dict[str, dict[str, Any]]],
    replies: dict[str, dict[str, ReplyLine]],
) -> None:
    """Per target language: fit on the labelled references, compare predicted intents of each
    OK translation and of its reference."""
    labelled = [r for r in requests.values() if r.intent and r.reference]
    by_lang: dict[str, list[SentLine]] = defaultdict(list)
    for req in labelled:
        by_lang[req.target_lang].append(req)
    for reqs in by_lang.values():
        if len({r.intent for r in reqs}) < 2:
            continue
        references = [str(r.reference) for r in reqs]
        clf = quality.IntentClassifier(references, [str(r.intent) for r in reqs])
        ref_intent = dict(zip([r.request_id for r in reqs], clf.predict(references), strict=True))
        for arm, arm_measures in measures.items():
            rids = [rid for rid in ref_intent if arm_measures.get(rid, {}).get("status") == "OK"]
            predicted = clf.predict([replies[arm][rid].text for rid in rids])
            for rid, intent in zip(rids, predicted, strict=True):
                arm_measures[rid]["intent_agreement"] = [float(intent == ref_intent[rid])]


# --- aggregation ------------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _arm_summary(
    rids: list[str], measures: dict[str, dict[str, Any]], duplicates: Counter[str]
) -> dict[str, Any]:
    statuses = Counter(measures[rid]["status"] for rid in rids if rid in measures)
    counts = {s: statuses.get(s, 0) for s in STATUSES}
    counts["withheld"] = sum(1 for rid in rids if measures.get(rid, {}).get("withheld"))
    counts["ERROR"] -= counts["withheld"]  # service errors only
    counts["unanswered"] = sum(1 for rid in rids if rid not in measures)
    counts["duplicates"] = sum(duplicates[rid] for rid in rids)
    summary: dict[str, Any] = {"requests": len(rids), "status": counts}
    cascade = Counter(m["cascade"] for rid in rids if "cascade" in (m := measures.get(rid, {})))
    summary["cascade"] = dict(cascade)
    total = sum(cascade.values())
    summary["deferred_share"] = cascade.get("deferred", 0) / total if total else None
    lat = [measures[rid]["latency_ms"] for rid in rids if "latency_ms" in measures.get(rid, {})]
    for q, name in zip(PERCENTILES, LATENCY_METRICS, strict=True):
        summary[name] = float(np.percentile(lat, q)) if lat else None
    for metric in METRICS:
        rows = [measures[rid][metric.name] for rid in rids if metric.name in measures.get(rid, {})]
        if rows:
            sums = np.asarray(rows, dtype=np.float64).sum(axis=0)[None, :]
            summary[metric.name] = _finite(metric.score(sums, len(rows))[0])
        else:
            summary[metric.name] = None
        summary[f"{metric.name}_n"] = len(rows)
    return summary


def _differences(
    rids: list[str],
    ma: dict[str, dict[str, Any]],
    mb: dict[str, dict[str, Any]],
    draws: int,
    seed: int,
) -> dict[str, stats.Difference]:
    out: dict[str, stats.Difference] = {}
    # in send order (requests.jsonl order): the latency bootstrap resamples runs of neighbours
    both = [
        rid for rid in rids if "latency_ms" in ma.get(rid, {}) and "latency_ms" in mb.get(rid, {})
    ]
    lat_a = np.array([ma[rid]["latency_ms"] for rid in both])
    lat_b = np.array([mb[rid]["latency_ms"] for rid in both])
    for q, name in zip(PERCENTILES, LATENCY_METRICS, strict=True):
        out[name] = stats.percentile_difference(lat_a, lat_b, q, draws=draws, seed=seed)
    for metric in METRICS:
        paired = [rid for rid in both if metric.name in ma[rid] and metric.name in mb[rid]]
        rows_a = np.asarray([ma[rid][metric.name] for rid in paired], dtype=np.float64)
        rows_b = np.asarray([mb[rid][metric.name] for rid in paired], dtype=np.float64)
        n = len(paired)
        if n == 0:
            rows_a = rows_b = np.zeros((0, metric.width))
        score = functools.partial(_score_with_n, metric, n)
        out[metric.name] = stats.paired_bootstrap(rows_a, rows_b, score, draws=draws, seed=seed)
    return out


def _score_with_n(metric: Metric, n: int, sums: np.ndarray) -> np.ndarray:
    return metric.score(sums, n)


def _higher_is_better(name: str) -> bool:
    return next((m.higher_is_better for m in METRICS if m.name == name), False)


def build_report(
    run_dir: str | Path,
    *,
    baseline: str | None = None,
    noise_pair: tuple[str, str] | None = None,
    draws: int = stats.DEFAULT_DRAWS,
    seed: int = stats.DEFAULT_SEED,
    margins: dict[str, float] | None = None,
    slo_ms: float = sequential.DEFAULT_SLO_MS,
) -> dict[str, Any]:
    """The report as a dict (what report.json holds); writes nothing. `margins` and `slo_ms`:
    the sequential column's (`replay.sequential`; None = its defaults)."""
    margins = {**sequential.DEFAULT_MARGINS, **(margins or {})}
    root = Path(run_dir)
    run = json.loads((root / "run.json").read_text(encoding="utf-8"))
    requests = {r.request_id: r for r in read_sent(root)}
    first: dict[str, dict[str, ReplyLine]] = defaultdict(dict)
    duplicates: dict[str, Counter[str]] = defaultdict(Counter)
    for reply in sorted(read_replies(root), key=lambda r: r.received_ms):
        arm, rid = _arm_of(reply), reply.request_id
        if rid in first[arm]:
            duplicates[arm][rid] += 1
        else:
            first[arm][rid] = reply
    arms = list(run.get("arms") or []) + sorted(
        a for a in first if a not in (run.get("arms") or [])
    )
    pair = noise_pair or (tuple(run["noise_pair"]) if run.get("noise_pair") else None)
    pair = pair or find_noise_pair(arms)
    base = baseline or run.get("baseline") or (pair[0] if pair else (arms[0] if arms else None))
    languages = sorted(
        {r.target_lang for r in requests.values()} | {r.source_lang for r in requests.values()}
    )
    measures = {arm: _measure(requests, first[arm], languages) for arm in arms}
    _add_intent_agreement(requests, measures, first)

    groups: dict[str, list[str]] = defaultdict(list)
    for rid, req in requests.items():
        groups[f"language {req.target_lang}"].append(rid)
        groups[f"direction {req.source_lang}->{req.target_lang}"].append(rid)
    others = [arm for arm in arms if arm != base]
    noise_arm = pair[1] if pair and pair[0] == base else None
    report_groups: dict[str, Any] = {}
    for gname in sorted(groups, key=lambda g: (not g.startswith("language"), g)):
        rids = groups[gname]
        group: dict[str, Any] = {
            "arms": {arm: _arm_summary(rids, measures[arm], duplicates[arm]) for arm in arms},
            "comparisons": {},
        }
        diffs = {
            arm: _differences(rids, measures[base], measures[arm], draws, seed) for arm in others
        }
        for arm in others:
            is_noise = arm == noise_arm
            comparison: dict[str, Any] = {
                "baseline": base,
                "arm": arm,
                "noise_pair": is_noise,
                "metrics": {},
            }
            for name, diff in diffs[arm].items():
                noise = diffs[noise_arm][name] if noise_arm and not is_noise else None
                comparison["metrics"][name] = {
                    **{
                        k: _finite(v) if isinstance(v, float) else v
                        for k, v in diff.as_dict().items()
                    },
                    "higher_is_better": _higher_is_better(name),
                    "noise_estimate": _finite(noise.estimate) if noise else None,
                    "verdict": stats.verdict(
                        diff, higher_is_better=_higher_is_better(name), noise=noise
                    ),
                }
            comparison["sequential"] = sequential.compare(
                rids, measures[base], measures[arm], margins=margins, slo_ms=slo_ms
            )
            group["comparisons"][f"{arm} vs {base}"] = comparison
        report_groups[gname] = group
    return {
        "run_id": run.get("run_id"),
        "run": {
            k: run.get(k)
            for k in (
                "created_at_ms",
                "languages",
                "pacing",
                "limit",
                "seed",
                "finished",
                "tolk_commit",
                "cpu_model",
            )
        },
        "arms": arms,
        "baseline": base,
        "noise_pair": list(pair) if pair else None,
        "requests": len(requests),
        "problems": sum(1 for _ in iter_jsonl(root / PROBLEMS)),
        "bootstrap": {"draws": draws, "seed": seed, "confidence": stats.CONFIDENCE},
        "sequential": {
            "method": "paired betting confidence sequence (Waudby-Smith & Ramdas)",
            "alpha": confseq.ALPHA,
            "margins": margins,
            "slo_ms": slo_ms,
        },
        "latency_definition": "received_ms - sent_ms of OK replies (client side)",
        "groups": report_groups,
        "latencies": {arm: _latencies_by_language(requests, measures[arm]) for arm in arms},
    }


def _latencies_by_language(
    requests: dict[str, SentLine], measures: dict[str, dict[str, Any]]
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for rid, m in measures.items():
        if "latency_ms" in m:
            out[requests[rid].target_lang].append(round(m["latency_ms"], 3))
    return {lang: sorted(values) for lang, values in sorted(out.items())}


def write_report(run_dir: str | Path, **options: Any) -> dict[str, Any]:
    """Build the report of a run directory and write report.json, report.md, report.html
    there; returns the report dict. Options: see `build_report`."""
    from replay import html

    root = Path(run_dir)
    report = build_report(root, **options)
    (root / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (root / "report.md").write_text(html.markdown(report), encoding="utf-8")
    (root / "report.html").write_text(html.page(report), encoding="utf-8")
    return report
