"""Stopping a replay run once every language is decided (issue #29): `tolk replay run
--stop-when-decided chrf,within_slo`.

The report's per-segment column (`replay.sequential`) is an anytime-valid confidence sequence,
so the run may look at it as often as it likes and stop as soon as it has its answer: for every
target language, every arm against the baseline (the first expected arm) and every metric
asked, the verdict is better, equivalent or worse, not inconclusive. `DecisionWatch` keeps
what that needs as the run goes (the requests in send order, each arm's first reply scored),
and the job asks it every few seconds; once decided, the job sends nothing more, waits for the
replies to what it sent, and ends finished with the verdicts in run.json (`stopped_early`).

Only the cheap metrics can stop a run: sentence chrF (sacrebleu's statistics of one segment)
and the within-SLO indicator; off-target and spans need lingua and the protected-span rules
and stay in the report. Pairs are the requests both arms answered (a request still in flight is
not yet a miss); the report, made at the end, counts an unanswered one as a miss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay import confseq, quality, sequential
from replay.run_dir import ReplyLine, SentLine

STOP_METRICS = ("chrf", "within_slo")


def parse_stop_metrics(text: str | None) -> tuple[str, ...]:
    """ "chrf,within_slo" -> the tuple; a clear error for a metric that cannot stop a run."""
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = [n for n in names if n not in STOP_METRICS]
    if unknown:
        raise ValueError(f"--stop-when-decided: {unknown} not among {list(STOP_METRICS)}")
    return names


def stop_setting(
    metrics: Sequence[str], margins: Mapping[str, float] | None, slo_ms: float
) -> dict[str, Any] | None:
    """What run.json keeps of the stop rule (a resumed run applies its own), None for none."""
    if not metrics:
        return None
    return {"metrics": list(metrics), "margins": dict(margins or {}), "slo_ms": slo_ms}


class DecisionWatch:
    """The evidence of a running replay, per language, for the sequential verdicts."""

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> DecisionWatch | None:
        """The watch a run's run.json asks for (None: the run does not stop when decided)."""
        stop = info.get("stop_when_decided")
        if not stop:
            return None
        return cls(info["arms"], stop["metrics"], margins=stop["margins"], slo_ms=stop["slo_ms"])

    def __init__(
        self,
        arms: Sequence[str],
        metrics: Sequence[str],
        *,
        margins: Mapping[str, float] | None = None,
        slo_ms: float = sequential.DEFAULT_SLO_MS,
    ) -> None:
        if len(arms) < 2:
            raise ValueError("stopping when decided needs two expected arms (--arms A,B)")
        self.baseline, self.others = arms[0], tuple(arms[1:])
        self.metrics = parse_stop_metrics(",".join(metrics))
        self.margins = {**sequential.DEFAULT_MARGINS, **(margins or {})}
        self.slo_ms = slo_ms
        self.requests: dict[str, tuple[str, str | None, float]] = {}  # rid -> lang, ref, sent
        self.measures: dict[str, dict[str, dict[str, Any]]] = {a: {} for a in arms}
        self._waiting: dict[str, None] = {}  # sent, not yet answered by every arm (send order)
        self._languages: set[str] = set()  # of the requests sent
        self._complete: dict[str, list[str]] = {}  # language -> answered by all, in that order
        self._fed: dict[str, int] = {}  # language -> how many of those the CSs have taken
        self._cs: dict[tuple[str, str, str], confseq.RunningCS] = {}
        if "chrf" in self.metrics:  # sacrebleu's first use imports it: not in the send loop
            quality.chrf_statistics(["warm"], ["warm"])

    def sent(
        self, request_id: str, target_lang: str, reference: str | None, sent_ms: float
    ) -> None:
        if request_id not in self.requests:
            self.requests[request_id] = (target_lang, reference, sent_ms)
            self._waiting[request_id] = None
            self._languages.add(target_lang)

    def sent_line(self, line: SentLine) -> None:
        """A line of requests.jsonl (a resumed run)."""
        self.sent(line.request_id, line.target_lang, line.reference, line.sent_ms)

    def replied_line(self, line: ReplyLine) -> None:
        """A line of replies.jsonl."""
        self.replied(line.request_id, line.arm, line.status, line.text, line.received_ms)

    def replied(
        self, request_id: str, arm: str | None, status: str, text: str, received_ms: float
    ) -> None:
        """An arm's reply; only its first one to a request counts (as in the report)."""
        if arm not in self.measures or request_id not in self.requests:
            return
        if request_id in self.measures[arm]:
            return
        _, reference, sent_ms = self.requests[request_id]
        m: dict[str, Any] = {"status": status}
        if status == "OK":
            m["latency_ms"] = received_ms - sent_ms
            if reference and "chrf" in self.metrics:
                m["chrf"] = quality.chrf_statistics([text], [reference])[0]
        self.measures[arm][request_id] = m

    def verdicts(self) -> dict[str, dict[str, dict[str, str]]]:
        """language -> "<arm> vs <baseline>" -> metric -> verdict, over the pairs so far.

        Each (language, arm, metric) keeps a `RunningCS`; a check feeds it the pairs completed
        since the last one (in send order among them: pairs enter in the order they became
        known, which the CS allows) and reads its interval, so checking every few seconds
        costs only the new pairs."""
        base = self.measures[self.baseline]
        out: dict[str, dict[str, dict[str, str]]] = {}
        for rid in list(self._waiting):  # send order
            lang = self.requests[rid][0]
            if all(rid in self.measures[a] for a in (self.baseline, *self.others)):
                del self._waiting[rid]
                self._complete.setdefault(lang, []).append(rid)
        for lang in sorted(self._languages):
            out[lang] = {}
            new = self._complete.get(lang, [])[self._fed.get(lang, 0) :]
            self._fed[lang] = self._fed.get(lang, 0) + len(new)
            for arm in self.others:
                other = self.measures[arm]
                out[lang][f"{arm} vs {self.baseline}"] = per_metric = {}
                for metric in sequential.METRICS:
                    if metric.name not in self.metrics:
                        continue
                    cs = self._cs.setdefault((lang, arm, metric.name), confseq.RunningCS())
                    pairs = [
                        (metric.score(base[r], self.slo_ms), metric.score(other[r], self.slo_ms))
                        for r in new
                    ]
                    cs.extend(
                        [(b - a + 1.0) / 2.0 for a, b in pairs if a is not None and b is not None]
                    )
                    per_metric[metric.name] = confseq.decide(
                        confseq.to_difference(cs.interval()),
                        float(self.margins[metric.name]),
                        higher_is_better=metric.higher_is_better,
                    )
        return out

    def decided(self) -> dict[str, dict[str, dict[str, str]]] | None:
        """The verdicts when every language's every comparison is decided in every metric
        asked; None while one is inconclusive (or nothing is paired yet)."""
        verdicts = self.verdicts()
        done = bool(verdicts) and all(
            v != confseq.INCONCLUSIVE
            for per_arm in verdicts.values()
            for per_metric in per_arm.values()
            for v in per_metric.values()
        )
        return verdicts if done else None
