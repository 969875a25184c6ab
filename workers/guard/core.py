"""The guard's logic around the faust table: replies counted per window, windows judged.

Split out of workers/guard/app.py (issue 27: no product file over 400 lines), bodies
unchanged; `GuardCore` needs no faust (tests/workers/guard/test_windows.py drives it through
`on_reply` and `tick`), app.py builds the faust app around it. `GuardConfig` is everything the
guard process needs.

* **Counting.** One agent reads the reply topic (concurrency 1: faust-streaming #606, a
  concurrent agent can commit past unprocessed records). Each reply becomes an observation
  (`windows.observe`) and is folded into a tumbling windowed table (`window_s`, event time =
  the reply record's timestamp) keyed by `<source partition>|<language>|<arm>`. Faust writes a
  table update to the changelog partition of the event's own partition, so the source
  partition belongs in the key: every key is written from one partition only, and a restart
  restores it whole. The value carries the last source offset folded in, so a reply read twice
  counts once (`windows.add_observation`).
* **Resuming after a crash.** Faust does not wait for the changelog before it commits source
  offsets (faust-streaming 0.15.3: the commit's producer flush gives up after 0.1 s per
  queued message). A guard SIGKILLed under load had committed offset 80 of a reply partition
  whose changelog reached offset 25: the restored counts lacked 54 replies, and the restarted
  guard judged windows short. So after the table is restored and before faust seeks to the
  committed offsets, `rewind` moves each partition's committed offset back to just after the
  newest source offset in the restored table (changelog writes leave in order, so everything
  before it is in); the replies between are read again, those already counted are skipped,
  and the counts equal an uninterrupted run's (`tests/workers/guard/test_guard_kafka.py`). A
  partition none of whose updates reached the changelog cannot be told from one with no
  countable replies and is not rewound. The rewind goes `REREAD_MARGIN` records further back
  than that: they are counted already and skipped, and they absorb a record lost at the seek
  (a CI run: the restarted guard went on from offset 23 of a partition it had moved back to 22,
  one reply short in one window; the other two partitions read from their first offset). It
  never goes back to offset 0: faust-streaming 0.15.3 takes a committed offset of 0 for none
  (`perform_seek`: `offset if offset else None`), and a guard moved back to 0 on every
  partition read none of them again (its windows judged on the restored counts alone).
* **Judging.** A timer (every 0.5 s) judges, for each language in an active rollout, every
  window that has closed: its end plus `grace_s` has passed on the wall clock, and every reply
  partition has been read past it (a reply with a later timestamp processed, or the partition
  read to the high watermark seen now; at start the committed offsets count as read). The
  window's counts are summed over partitions per arm (`windows.merge_counts`) and handed to
  `policy.decide`; replies of other arms in the language are counted as `unknown_arm`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.codec import SchemaError
from schemas.wire import read_result
from workers.fairness.policy import LanguagePolicy
from workers.guard.events import RolloutBook, decision_event
from workers.guard.metrics import GuardMetrics
from workers.guard.policy import GuardPolicy, RolloutState, decide
from workers.guard.windows import Ignored, add_observation, merge_counts, observe, stats_of

__all__ = ["REREAD_MARGIN", "GuardConfig", "GuardCore", "wall_clock_ms"]

# records a rewound partition reads again before the first one past the restored counts
# (never below offset 1: see the module notes)
REREAD_MARGIN = 8

log = logging.getLogger("tolk.guard")


@dataclass(frozen=True)
class GuardConfig:
    """Everything the guard process needs (the CLI builds it from `Settings` and its flags)."""

    bootstrap: str
    kafka_config: Mapping[str, Any]  # confluent-kafka settings (security included)
    replies_topic: str
    events_topic: str
    control_topic: str
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    slos: Mapping[str, LanguagePolicy] = field(default_factory=dict)
    app_id: str = "tolk-guard"
    guard_id: str = "tolk-guard"
    grace_s: float = 2.0  # after a window's end, for late replies
    refresh_s: float = 2.0  # operator events picked up this often
    expires_s: float = 600.0  # how long a window stays in the table (at least 20 windows)
    session_timeout_s: float = 6.0  # a killed guard's partitions free up this soon
    datadir: str = ".tolk-guard"  # faust's local state (memory store: only its metadata)


class GuardCore:
    """The guard's logic around the faust table (testable without faust: see `on_reply`)."""

    def __init__(
        self,
        config: GuardConfig,
        *,
        writer: Any = None,
        metrics: GuardMetrics | None = None,
        book: RolloutBook | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else GuardMetrics()
        self.writer = writer
        self.book = book if book is not None else RolloutBook()
        self.window_ms = config.policy.window_ms
        self.read_upto: dict[int, int] = {}  # partition -> next offset to read (processed)
        self.max_ts: dict[int, int] = {}  # partition -> latest reply timestamp processed
        self.ignored: dict[str, int] = {}
        self._last_refresh = 0.0

    # -- counting -------------------------------------------------------------------------------

    def on_reply(
        self, value: bytes | None, *, partition: int, offset: int, ts_ms: int, current: Any
    ) -> tuple[str, dict[str, Any]] | None:
        """(table key, new counts) for one reply record, None when nothing is to be written
        (ignored, or already counted); `current(key)` gives the key's counts in the record's
        window."""
        self.read_upto[partition] = max(self.read_upto.get(partition, 0), offset + 1)
        self.max_ts[partition] = max(self.max_ts.get(partition, 0), ts_ms)
        try:
            reply = read_result(value) if value is not None else None
        except SchemaError:
            reply = None
        obs = observe(reply, record_ts_ms=ts_ms)
        if isinstance(obs, Ignored):
            self._ignore(obs.reason)
            return None
        key = f"{partition}|{obs.lang}|{obs.arm}"
        new = add_observation(current(key), obs, offset)
        if new is None:
            return None
        self.metrics.replies_total.labels(lang=obs.lang, arm=obs.arm).inc()
        return key, new

    def rewind(self, items: list[tuple[Any, Any]], committed: Mapping[int, int]) -> dict[int, int]:
        """The reply partitions whose committed offset is past the restored table, each with the
        offset to read from again (one past the newest source offset in the table, less
        `REREAD_MARGIN`, at least 1); `items`:
        the table's raw (key, window range) -> value pairs, `committed`: partition -> committed
        offset. The partitions' read positions go back with them, so no window is judged before
        the replies between are read again."""
        newest: dict[int, int] = {}
        for raw_key, value in items:
            partition = int(str(raw_key[0]).split("|", 1)[0])
            last = int((value or {}).get("last_offset", -1))
            newest[partition] = max(newest.get(partition, -1), last)
        back = {
            p: max(1, newest[p] + 1 - REREAD_MARGIN)
            for p, offset in committed.items()
            if p in newest and newest[p] >= 0 and offset > newest[p] + 1
        }
        for p, offset in back.items():
            self.read_upto[p] = offset
            self.max_ts.pop(p, None)
        return back

    def _ignore(self, reason: str, n: int = 1) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + n
        self.metrics.ignored_total.labels(reason=reason).inc(n)

    # -- judging --------------------------------------------------------------------------------

    def window_counts(
        self, items: list[tuple[Any, Any]], start_ms: int
    ) -> dict[tuple[str, str], dict[str, Any]]:
        """(lang, arm) -> counts of the window starting at `start_ms`, summed over partitions;
        `items`: the table's raw (key, window range) -> value pairs."""
        parts: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for raw_key, value in items:
            key, window = raw_key[0], raw_key[1]
            if int(round(float(window[0]) * 1000)) != start_ms or not value:
                continue
            _, lang, arm = str(key).split("|", 2)
            parts.setdefault((lang, arm), []).append(value)
        return {k: merge_counts(v) for k, v in parts.items()}

    def caught_up(self, end_ms: int, highwaters: Mapping[int, int]) -> bool:
        """Every reply partition read past `end_ms` + grace, or to its high watermark."""
        past = end_ms + int(self.config.grace_s * 1000)
        return all(
            self.max_ts.get(p, -1) >= past or self.read_upto.get(p, 0) >= hw
            for p, hw in highwaters.items()
        )

    def due_windows(self, state: RolloutState, now_ms: int) -> list[int]:
        """Starts of the closed windows of `state` not judged yet (oldest first)."""
        w = self.window_ms
        kept_ms = int(self.config.expires_s * 1000) - 2 * w  # still in the table
        first = max(state.judge_from_ms, state.last_window_ms + 1, now_ms - kept_ms)
        first = -(-first // w) * w  # the first whole window at or after it
        grace = int(self.config.grace_s * 1000)
        return list(range(first, now_ms - w - grace + 1, w))

    def judge(
        self, state: RolloutState, start_ms: int, counts: Mapping[tuple[str, str], Any]
    ) -> Any:
        """Decide one window of `state`'s language and write the decision; the decision."""
        lang, w = state.lang, self.window_ms
        slo = self.config.slos.get(lang)
        slo_ms = slo.slo_p99_s * 1000 if slo is not None else math.inf  # over it: "slow"
        canary, stable = (
            stats_of(
                counts.get((lang, arm)),
                lang=lang,
                arm=arm,
                start_ms=start_ms,
                window_ms=w,
                slo_ms=slo_ms,
            )
            for arm in (state.canary, state.stable)
        )
        unknown = sum(
            int(c["requests"])
            for (lg, arm), c in counts.items()
            if lg == lang and arm not in (state.stable, state.canary)
        )
        if unknown:
            self._ignore("unknown_arm", unknown)
        decision = decide(state, canary, stable, slo, self.config.policy)
        if decision is None:
            return None
        event = decision_event(decision, decided_by=self.config.guard_id, now_ms=wall_clock_ms())
        if self.writer is not None:
            self.writer.write_event(event)
            if decision.changes_share:
                self.writer.write_shares(decision.state, updated_by=self.config.guard_id)
        self.book.apply(event)
        m = self.metrics
        m.windows_total.labels(lang=lang, verdict=decision.verdict.kind).inc()
        m.decisions_total.labels(lang=lang, action=decision.action).inc()
        m.canary_share.labels(lang=lang).set(decision.share_after)
        if canary.requests:
            m.canary_p99_seconds.labels(lang=lang).set(canary.p99_ms / 1000)
        log.info(
            "%s %s window %d: %s %s, share %g -> %g (%s) %s",
            decision.action,
            lang,
            start_ms,
            decision.verdict.kind,
            state.canary,
            decision.share_before,
            decision.share_after,
            "; ".join(decision.verdict.reasons),
            " ".join(f"{k}={v:g}" for k, v in sorted(decision.verdict.figures.items())),
        )
        return decision

    def tick(self, items: list[tuple[Any, Any]], highwaters: Mapping[int, int], now_ms: int) -> int:
        """Judge every due window of every active rollout; returns how many were judged."""
        judged = 0
        for lang in sorted(self.book.active()):
            state = self.book.states[lang]
            for start in self.due_windows(state, now_ms):
                if not self.caught_up(start + self.window_ms, highwaters):
                    break
                self.judge(self.book.states[lang], start, self.window_counts(items, start))
                judged += 1
                if not self.book.states[lang].active:
                    break
        return judged


def wall_clock_ms() -> int:
    """Now, in epoch milliseconds (the guard's events and its judging timer)."""
    return int(time.time() * 1000)
