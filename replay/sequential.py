"""The replay report's anytime-valid column: per language and metric, a paired confidence
sequence on per-segment differences B - A, judged against a margin fixed before the run.

The bootstrap columns of `replay.report` answer "is there a difference?" once, at the end. This
column answers "better / equivalent / worse / inconclusive?" with a confidence sequence
(`replay.confseq`, Waudby-Smith and Ramdas's betting CS), which is valid at every segment at
once: a run may be looked at while it goes and stopped as soon as every language is decided,
and "equivalent" (the whole CS within +-margin) says that two arms agree, which "no detectable
difference" cannot.

Per-segment scores, each in [0, 1], paired by request in send order:

- chrf: sentence chrF / 100 (sacrebleu's statistics of the one segment); both arms OK, with a
  reference; higher is better;
- within_slo: 1 if the reply is OK within `slo_ms` of its send, else 0 (an unanswered request
  too); every request either arm answered; higher is better;
- off_target: 1 if the OK reply is not in the target language; both OK; lower is better;
- span_kept: protected spans kept / spans in the source; both OK, the source has spans; higher.

Margins (`DEFAULT_MARGINS`, in the score's units: 0.03 = 3 chrF points or 3 percentage points;
the default is what a 400-turn A/A' replay, ~200 turns a language, can show: two identical
arms' CS is +-0.024 wide there) and the SLO are declared before the run (`tolk replay report
--margin chrf=0.05 --slo-ms 1500`). Each CS is at level alpha on its own (0.05), like the
bootstrap intervals: across the report's many groups and metrics a few verdicts can be chance;
the canary guard, which acts on its verdicts, splits its level.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay import confseq, stats

DEFAULT_SLO_MS = 2000.0  # the serving benchmark's goodput SLO (bench/serving.py)
DEFAULT_MARGINS: dict[str, float] = {
    "chrf": 0.03,
    "within_slo": 0.03,
    "off_target": 0.03,
    "span_kept": 0.03,
}

Measure = dict[str, Any]  # one arm's measures of one request (replay.report._measure)


def _chrf(m: Measure, slo_ms: float) -> float | None:
    if "chrf" not in m:
        return None
    row = np.asarray(m["chrf"], dtype=np.float64)[None, :]
    return float(np.nan_to_num(stats.chrf_from_sums(row)[0])) / 100.0


def _within_slo(m: Measure, slo_ms: float) -> float | None:
    return float(m.get("status") == "OK" and m.get("latency_ms", float("inf")) <= slo_ms)


def _off_target(m: Measure, slo_ms: float) -> float | None:
    return float(m["off_target_rate"][0]) if "off_target_rate" in m else None


def _span_kept(m: Measure, slo_ms: float) -> float | None:
    if "span_preservation" not in m:
        return None
    kept, total = m["span_preservation"]
    return float(kept) / float(total) if total else None


@dataclass(frozen=True, slots=True)
class SequentialMetric:
    name: str
    higher_is_better: bool
    score: Callable[[Measure, float], float | None]  # None: this request is not scored
    unanswered_scores_zero: bool = False  # within_slo: a request never answered is a miss


METRICS = (
    SequentialMetric("chrf", True, _chrf),
    SequentialMetric("within_slo", True, _within_slo, unanswered_scores_zero=True),
    SequentialMetric("off_target", False, _off_target),
    SequentialMetric("span_kept", True, _span_kept),
)


def parse_margins(text: str | None) -> dict[str, float]:
    """ "chrf=0.03,within_slo=0.05" -> the defaults with those replaced; a clear error for an
    unknown metric or a margin that is not in (0, 1)."""
    margins = dict(DEFAULT_MARGINS)
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in margins:
            raise ValueError(
                f"margin {part!r}: expected METRIC=VALUE, METRIC one of {sorted(margins)}"
            )
        try:
            margin = float(value)
        except ValueError:
            margin = -1.0  # not a number: refused below, with the rule
        if not 0.0 < margin < 1.0:
            raise ValueError(f"margin {part!r}: must be in (0, 1), in the score's units")
        margins[name] = margin
    return margins


def compare(
    rids: list[str],
    a: Mapping[str, Measure],
    b: Mapping[str, Measure],
    *,
    margins: Mapping[str, float],
    slo_ms: float = DEFAULT_SLO_MS,
    alpha: float = confseq.ALPHA,
) -> dict[str, dict[str, Any]]:
    """Per metric: the CS of mean(B - A) over `rids` (in send order), its verdict, margin, n."""
    out: dict[str, dict[str, Any]] = {}
    for metric in METRICS:
        sa: list[float] = []
        sb: list[float] = []
        for rid in rids:
            ma, mb = a.get(rid), b.get(rid)
            missing = (ma is None) + (mb is None)
            if missing == 2 or (missing == 1 and not metric.unanswered_scores_zero):
                continue
            va = metric.score(ma, slo_ms) if ma is not None else 0.0
            vb = metric.score(mb, slo_ms) if mb is not None else 0.0
            if va is not None and vb is not None:
                sa.append(va)
                sb.append(vb)
        cs = confseq.paired_difference_cs(sa, sb, alpha)
        margin = float(margins[metric.name])
        out[metric.name] = {
            "estimate": float(np.mean(np.subtract(sb, sa))) if sa else None,
            **cs.as_dict(),
            "margin": margin,
            "higher_is_better": metric.higher_is_better,
            "verdict": confseq.decide(cs, margin, higher_is_better=metric.higher_is_better),
        }
    return out
