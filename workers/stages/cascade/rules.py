"""The cascade's deferral rule (issue #44): which small-model answers go to the large model.

A cascade answers every request with a small model (Gemma 3 270M) and sends to a large one
(Qwen2.5-Coder-1.5B) only the answers a quality estimate doubts (Farinhas et al., "Translate
Smart, not Hard", EMNLP 2025). The estimate here needs no new weights:

* `large_logprob`: the large model's mean log-probability of the small model's answer, given
  the large model's own prompt for the request (`Engine.score_request`: one prefill of prompt
  plus answer, no decoding; a few times cheaper than letting the large model translate);
* `small_logprob`: the small model's own mean log-probability of its answer (the same call on
  the small engine);
* `small_total`: the same model's log-probability of the whole answer (the mean times its
  tokens): lower for a long answer, where a corpus-level chrF has more to lose (on the dev
  sets it ranks errors best; docs/BENCHMARKS.md, "Quality-aware cascade");
* the output checks (`workers.stages.faithful.rules.check`): an answer they doubt (wrong
  language, an invented number, a dropped span or name) is deferred whatever its score.

A low score means "likely wrong": an answer scoring below its language pair's threshold is
deferred. Thresholds are calibrated per pair on dev sets for a target share of deferred
requests (`python -m bench.cascade --calibrate --defer-share 0.3`, which also says which signal
ranks the small model's errors best) and kept in a JSON file the worker reads at start
(`CascadeThresholds.load`); a pair the calibration did not see gets the threshold of all pairs
pooled. The packaged `thresholds.json` holds the calibration of the default pair of models.

Pure logic over numbers: no engine, no Kafka.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SCORER",
    "SIGNALS",
    "CascadeThresholds",
    "Deferral",
    "packaged_thresholds",
    "signal_value",
    "threshold_for_share",
]

SIGNALS = ("large_logprob", "small_logprob", "small_total")
# which model scores the answer for each signal ("large" or "small")
SCORER = {"large_logprob": "large", "small_logprob": "small", "small_total": "small"}
PACKAGED = Path(__file__).with_name("thresholds.json")


@dataclass(frozen=True, slots=True)
class Deferral:
    """What the rule says about one small-model answer."""

    defer: bool
    reason: str  # "score" (below the threshold), "check" (a check doubts it), "" (kept)
    score: float | None  # the signal's value (None: not computed, e.g. a check fired first)
    threshold: float | None  # the pair's threshold it was compared with


def signal_value(signal: str, mean_logprob: float, tokens: int) -> float:
    """A signal's value from a scoring result (`GenerationResult.logprob`, `.scored_tokens`)."""
    return mean_logprob * tokens if signal.endswith("_total") else mean_logprob


def threshold_for_share(scores: Sequence[float], share: float) -> float:
    """The threshold below which `share` of `scores` lie: deferring every score strictly below
    it defers round(share * n) of them (ties aside). Midway between the last deferred score
    and the first kept one, so a score calibrated on one side stays there."""
    if not scores:
        raise ValueError("no scores to calibrate on")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share {share} is not in [0, 1]")
    ordered = sorted(scores)
    k = round(share * len(ordered))
    if k <= 0:
        return ordered[0]  # nothing lies strictly below the lowest score
    if k >= len(ordered):
        return ordered[-1] + 1.0
    return (ordered[k - 1] + ordered[k]) / 2


@dataclass(frozen=True, slots=True)
class CascadeThresholds:
    """Per language pair ("de-en"), the score below which an answer is deferred."""

    small: str  # the model presets the calibration ran (a worker checks it runs the same)
    large: str
    signal: str  # one of SIGNALS
    thresholds: Mapping[str, float]
    pooled: float  # for pairs not calibrated: the threshold of every pair's scores together
    defer_share: float | None = None  # the share the thresholds were calibrated for
    calibrated_on: str = ""  # which dev sets, how many items, when
    extra: Mapping[str, Any] = field(default_factory=dict)  # the calibration's own figures

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"unknown cascade signal {self.signal!r}; known: {SIGNALS}")
        bad = {p: t for p, t in self.thresholds.items() if not math.isfinite(t)}
        if bad or not math.isfinite(self.pooled):
            raise ValueError(f"thresholds must be finite numbers: {bad or self.pooled}")

    @staticmethod
    def calibrate(
        scores: Mapping[str, Sequence[float]],
        share: float,
        *,
        small: str,
        large: str,
        signal: str,
        calibrated_on: str = "",
        checked: Mapping[str, int] | None = None,
    ) -> CascadeThresholds:
        """Thresholds that defer `share` of each pair's dev items: `scores` are the signal's
        values on the items the checks let through (pair -> values), `checked` how many more
        the checks defer anyway; the threshold takes what is left of the share from the
        scored ones."""
        checked = checked or {}

        def fit(values: Sequence[float], flagged: int) -> float:
            total = len(values) + flagged
            rest = (share * total - flagged) / len(values)
            return threshold_for_share(values, min(1.0, max(0.0, rest)))

        pooled = [s for values in scores.values() for s in values]
        return CascadeThresholds(
            small=small,
            large=large,
            signal=signal,
            thresholds={p: fit(v, checked.get(p, 0)) for p, v in scores.items() if v},
            pooled=fit(pooled, sum(checked.values())),
            defer_share=share,
            calibrated_on=calibrated_on,
        )

    def threshold(self, source_lang: str, target_lang: str) -> float:
        return self.thresholds.get(f"{source_lang}-{target_lang}", self.pooled)

    def decide(
        self, source_lang: str, target_lang: str, score: float | None, suspect: bool = False
    ) -> Deferral:
        """Defer when a check doubts the answer, or when its score is below the pair's
        threshold. A missing score (the signal could not be computed) defers: the rule errs
        toward the better model."""
        limit = self.threshold(source_lang, target_lang)
        if suspect:
            return Deferral(True, "check", score, limit)
        if score is None or score < limit:
            return Deferral(True, "score", score, limit)
        return Deferral(False, "", score, limit)

    def to_json(self) -> dict[str, Any]:
        return {
            "small": self.small,
            "large": self.large,
            "signal": self.signal,
            "thresholds": dict(sorted(self.thresholds.items())),
            "pooled": self.pooled,
            "defer_share": self.defer_share,
            "calibrated_on": self.calibrated_on,
            "extra": dict(self.extra),
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> CascadeThresholds:
        try:
            return CascadeThresholds(
                small=str(data["small"]),
                large=str(data["large"]),
                signal=str(data["signal"]),
                thresholds={str(k): float(v) for k, v in data["thresholds"].items()},
                pooled=float(data["pooled"]),
                defer_share=(
                    None if data.get("defer_share") is None else float(data["defer_share"])
                ),
                calibrated_on=str(data.get("calibrated_on", "")),
                extra=dict(data.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a cascade thresholds file: {e!r}") from e

    @staticmethod
    def load(path: str | Path) -> CascadeThresholds:
        """A thresholds file (`bench.cascade --calibrate --out-thresholds`); a clear error
        naming the file when it is missing or malformed."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"cascade thresholds file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"cascade thresholds file {path} is not JSON: {e}") from None
        try:
            return CascadeThresholds.from_json(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def packaged_thresholds() -> CascadeThresholds:
    """The calibration shipped with tolk (docs/BENCHMARKS.md, "Quality-aware cascade")."""
    return CascadeThresholds.load(PACKAGED)
