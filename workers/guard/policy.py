"""The canary guard's decisions: window figures -> verdict -> decision, and the rollout state.

Pure logic (dataclasses in and out; no Kafka, no faust, no clock reads), so the same windows
always give the same decisions, in a test, in a guard restarted after SIGKILL, and in two
guards running at once.

* **Verdict** (`judge_window`) of one language's window: the canary's figures against the
  language's SLO (`LanguagePolicy.slo_p99_s`) and against the stable arm in the same window.
  *Inconclusive* below `min_requests` canary replies (nor promotes, nor rolls back, nor breaks
  a streak). *Bad* when any of: the canary's error rate or expired rate is more than
  `max_rate_increase` above the stable's (a withheld answer is not an error, issue #28); its
  rate of answers the faithfulness checks withheld or flagged is more than
  `max_suspect_increase` above the stable's, with at least `min_suspect` of them (the quality
  rule: only against a stable arm with enough replies, as a small model withholds some answers
  on either arm); its P99 is over the SLO while the stable's is not
  (or the stable has too few replies to compare) or is over the SLO and above
  `max_latency_ratio` x the stable's; its P95 is above `max_latency_ratio` x the stable's P95
  plus `latency_slack_ms` (a regression inside the SLO). Else *good*. Every bad verdict says
  why, with the figures.
* **State** (`RolloutState`) of one language's rollout is a fold of the rollout events
  (`apply_event`): START (by `tolk rollout start`) sets the arms, the steps and the first
  share; the guard's own events (HOLD, INCONCLUSIVE, PROMOTE, ROLLBACK, COMPLETE) carry the
  window they judged and are applied only to a window after the last one applied, and only for
  the same rollout id; PROMOTE and ABORT by an operator (no window) always apply.
* **Decision** (`decide`) for one judged window: None when the window is not to be judged (no
  active rollout, a window before the rollout or the last share change, already judged);
  else one event: ROLLBACK after `bad_windows_to_rollback` consecutive bad windows (share 0,
  that language only), PROMOTE after `good_windows_to_promote` consecutive good ones (the
  next step; COMPLETE at 100 %), HOLD or INCONCLUSIVE otherwise. Below `min_share` the guard
  does not judge (INCONCLUSIVE, "share below minimum").
* **Sequential mode** (the default; `decision="windows"`: the rule above): the step's counts
  (`RolloutState.step`, in every event's figures) judged by confidence sequences after each
  window: ROLLBACK once harm is shown, PROMOTE once non-inferiority is and `min_step_s` passed.
* **Idempotent, keyed**: a decision's `event_id` is `<rollout id>/<language>/<window start>`,
  so a replayed window or a second guard produces an event with the same id and the same
  content, and folding it a second time changes nothing (`apply_event` skips a window already
  applied). The share the guard then writes to the control topic is the same value too, which
  the workers ignore as no change.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.fairness.policy import LanguagePolicy
from workers.guard.sequential import StepCounts, judge_step, level_per_test
from workers.guard.windows import WindowStats

__all__ = [
    "ACTIONS",
    "DEFAULT_STEPS",
    "Decision",
    "GuardPolicy",
    "RolloutState",
    "Verdict",
    "apply_event",
    "decide",
    "judge_window",
    "next_step",
    "validate_steps",
]

DEFAULT_STEPS = (5.0, 25.0, 50.0, 100.0)
# START/ABORT: operator; PROMOTE: guard or operator; the rest: the guard's judged windows.
ACTIONS = ("START", "HOLD", "INCONCLUSIVE", "PROMOTE", "ROLLBACK", "COMPLETE", "ABORT")
DECISIONS = ("windows", "sequential")
WINDOW_ACTIONS = frozenset({"HOLD", "INCONCLUSIVE", "PROMOTE", "ROLLBACK", "COMPLETE"})


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """The guard's thresholds (one for every language; the SLO comes per language)."""

    window_s: float = 30.0  # tumbling window length
    min_requests: int = 10  # canary replies a window needs to be conclusive
    bad_windows_to_rollback: int = 3
    good_windows_to_promote: int = 3
    min_share: float = 1.0  # percent: below it the guard does not judge
    max_rate_increase: float = 0.05  # error / expired rate over the stable's by more: bad
    # withheld + flagged rate over the stable's by more, and at least min_suspect of them: bad
    max_suspect_increase: float = 0.10
    min_suspect: int = 5
    max_latency_ratio: float = 1.5  # canary P95 (P99 past the SLO) vs the stable's
    latency_slack_ms: float = 250.0  # added to the ratio bound (small latencies are noisy)
    # sequential mode: max_rate_increase is the bad replies' margin, this the over-SLO ones'
    decision: str = "sequential"  # "sequential" (issue #29) | "windows"
    alpha: float = 0.05  # false-alarm level, split over `languages` x two metrics
    languages: int = 1  # how many languages the guard judges
    max_slow_increase: float = 0.05
    min_step_s: float = 60.0  # a step lasts at least this long before it is promoted

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {self.decision!r}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha!r}")
        for name in ("min_requests", "bad_windows_to_rollback", "good_windows_to_promote"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def window_ms(self) -> int:
        return int(round(self.window_s * 1000))


@dataclass(frozen=True, slots=True)
class Verdict:
    """One language's window, judged."""

    kind: str  # "good" | "bad" | "inconclusive"
    reasons: tuple[str, ...]  # why (figures in words)
    figures: Mapping[str, float] = field(default_factory=dict)  # canary_* and stable_*


def _fmt(ms: float) -> str:
    return "n/a" if math.isnan(ms) else f"{ms:.0f} ms"


def judge_window(
    canary: WindowStats,
    stable: WindowStats | None,
    slo: LanguagePolicy | None,
    policy: GuardPolicy,
) -> Verdict:
    """The verdict on one window of a language (see the module docstring)."""
    figures = dict(canary.figures("canary"))
    if stable is not None:
        figures.update(stable.figures("stable"))
    if canary.requests < policy.min_requests:
        why = f"{canary.requests} canary replies < minimum {policy.min_requests}"
        return Verdict("inconclusive", (why,), figures)
    compare = stable is not None and stable.requests >= policy.min_requests
    base_err = stable.error_rate if compare and stable is not None else 0.0
    base_exp = stable.expired_rate if compare and stable is not None else 0.0
    reasons: list[str] = []
    if canary.error_rate > base_err + policy.max_rate_increase:
        reasons.append(f"error rate {canary.error_rate:.1%} vs stable {base_err:.1%}")
    if canary.expired_rate > base_exp + policy.max_rate_increase:
        reasons.append(f"expired rate {canary.expired_rate:.1%} vs stable {base_exp:.1%}")
    if (
        compare
        and stable is not None
        and canary.suspect >= policy.min_suspect
        and canary.suspect_rate > stable.suspect_rate + policy.max_suspect_increase
    ):
        reasons.append(
            f"withheld/flagged rate {canary.suspect_rate:.1%} vs stable {stable.suspect_rate:.1%}"
        )
    slo_ms = slo.slo_p99_s * 1000 if slo is not None else math.inf
    if canary.p99_ms > slo_ms:
        if not compare or stable is None:
            reasons.append(
                f"P99 {_fmt(canary.p99_ms)} > SLO {slo_ms:.0f} ms (no stable to compare)"
            )
        elif stable.p99_ms <= slo_ms:
            reasons.append(
                f"P99 {_fmt(canary.p99_ms)} > SLO {slo_ms:.0f} ms; stable {_fmt(stable.p99_ms)}"
            )
        elif canary.p99_ms > stable.p99_ms * policy.max_latency_ratio:
            reasons.append(
                f"P99 {_fmt(canary.p99_ms)} > SLO and > {policy.max_latency_ratio:g}x stable "
                f"{_fmt(stable.p99_ms)}"
            )
    if compare and stable is not None:
        bound = stable.p95_ms * policy.max_latency_ratio + policy.latency_slack_ms
        if canary.p95_ms > bound:
            reasons.append(
                f"P95 {_fmt(canary.p95_ms)} > {policy.max_latency_ratio:g}x stable "
                f"{_fmt(stable.p95_ms)} + {policy.latency_slack_ms:.0f} ms"
            )
    if reasons:
        return Verdict("bad", tuple(reasons), figures)
    return Verdict("good", (f"{canary.requests} canary replies within bounds",), figures)


def validate_steps(steps: Sequence[float]) -> tuple[float, ...]:
    """Promotion steps: strictly increasing percents in (0, 100], ending at 100."""
    out = tuple(float(s) for s in steps)
    if not out or out[-1] != 100.0:
        raise ValueError(f"steps must end at 100, got {list(out)}")
    increasing = all(a < b for a, b in zip(out, out[1:], strict=False))
    if any(not 0 < s <= 100 for s in out) or not increasing:
        raise ValueError(f"steps must increase strictly within (0, 100], got {list(out)}")
    return out


def next_step(steps: Sequence[float], share: float) -> float:
    """The first step above `share` (100 when none is)."""
    return next((s for s in steps if s > share), 100.0)


@dataclass(frozen=True, slots=True)
class RolloutState:
    """One language's rollout, as the events so far make it."""

    rollout_id: str
    lang: str
    stable: str
    canary: str
    share: float  # the canary's percent now
    steps: tuple[float, ...] = DEFAULT_STEPS
    phase: str = "active"  # active | rolled_back | complete | aborted
    good_streak: int = 0
    bad_streak: int = 0
    judge_from_ms: int = 0  # windows starting before this are not judged
    last_window_ms: int = -1  # start of the last window applied
    step: StepCounts = StepCounts()  # replies since the share was set (sequential mode)

    @property
    def active(self) -> bool:
        return self.phase == "active"

    def shares(self) -> dict[str, float]:
        """The control-topic entry this state stands for."""
        if self.stable == self.canary:
            return {self.stable: 100.0}
        return {self.stable: 100.0 - self.share, self.canary: self.share}


@dataclass(frozen=True, slots=True)
class Decision:
    """What the guard does about one judged window (becomes one rollout event)."""

    event_id: str  # <rollout id>/<language>/<window start>: duplicates are recognisable
    action: str  # HOLD | INCONCLUSIVE | PROMOTE | ROLLBACK | COMPLETE
    share_before: float
    share_after: float
    verdict: Verdict
    state: RolloutState  # the state after this decision
    window_start_ms: int
    window_end_ms: int

    @property
    def changes_share(self) -> bool:
        return self.share_after != self.share_before


def decide(
    state: RolloutState | None,
    canary: WindowStats,
    stable: WindowStats | None,
    slo: LanguagePolicy | None,
    policy: GuardPolicy,
) -> Decision | None:
    """The decision on one closed window of `state`'s language; None when it is not judged."""
    start = canary.window_start_ms
    if state is None or not state.active:
        return None
    if start < state.judge_from_ms or start <= state.last_window_ms:
        return None
    if policy.decision == "sequential":
        return _decide_sequential(state, canary, stable, policy)
    verdict = judge_window(canary, stable, slo, policy)
    if state.share < policy.min_share:
        why = f"share {state.share:g}% below minimum {policy.min_share:g}%: not judged"
        verdict = Verdict("inconclusive", (why,), verdict.figures)
    good, bad, share, phase = state.good_streak, state.bad_streak, state.share, state.phase
    judge_from = state.judge_from_ms
    if verdict.kind == "inconclusive":
        action = "INCONCLUSIVE"
    elif verdict.kind == "bad":
        good, bad = 0, bad + 1
        action = "HOLD"
        if bad >= policy.bad_windows_to_rollback:
            action, share, phase, bad = "ROLLBACK", 0.0, "rolled_back", bad
    else:
        good, bad = good + 1, 0
        action = "HOLD"
        if good >= policy.good_windows_to_promote:
            share = next_step(state.steps, state.share)
            action = "COMPLETE" if share >= 100.0 else "PROMOTE"
            phase = "complete" if share >= 100.0 else "active"
            good, judge_from = 0, canary.window_end_ms  # the next window has the new share
    after = dataclasses.replace(
        state,
        share=share,
        phase=phase,
        good_streak=good,
        bad_streak=bad,
        judge_from_ms=judge_from,
        last_window_ms=start,
    )
    return Decision(
        event_id=f"{state.rollout_id}/{state.lang}/{start}",
        action=action,
        share_before=state.share,
        share_after=share,
        verdict=verdict,
        state=after,
        window_start_ms=start,
        window_end_ms=canary.window_end_ms,
    )


def _decide_sequential(
    state: RolloutState, canary: WindowStats, stable: WindowStats | None, policy: GuardPolicy
) -> Decision:
    """The sequential mode's decision on one window (see the module docstring)."""
    st = (0, 0, 0) if stable is None else (stable.requests, stable.bad, stable.over_slo)
    step = state.step.plus((canary.requests, canary.bad, canary.over_slo), st)
    judged = judge_step(
        step,
        alpha=level_per_test(policy.alpha, policy.languages),
        margins={"bad": policy.max_rate_increase, "slow": policy.max_slow_increase},
    )
    figures = {**canary.figures("canary"), **judged.figures}
    figures.update(stable.figures("stable") if stable is not None else {})
    lasted_s = (canary.window_end_ms - state.judge_from_ms) / 1000
    share, phase, judge_from = state.share, state.phase, state.judge_from_ms
    reasons = judged.reasons
    if state.share < policy.min_share:
        why = f"share {state.share:g}% below minimum {policy.min_share:g}%: not judged"
        kind, action, reasons = "inconclusive", "INCONCLUSIVE", (why, *reasons)
    elif judged.kind == "harm":
        kind, action, share, phase = "bad", "ROLLBACK", 0.0, "rolled_back"
    elif judged.kind == "non_inferior" and lasted_s >= policy.min_step_s:
        kind, share = "good", next_step(state.steps, state.share)
        action = "COMPLETE" if share >= 100.0 else "PROMOTE"
        phase = "complete" if share >= 100.0 else "active"
        judge_from = canary.window_end_ms  # the next window has the new share
    elif judged.kind == "non_inferior":
        kind, action = "good", "HOLD"
        reasons = (*reasons, f"step lasted {lasted_s:.0f} s < minimum {policy.min_step_s:g} s")
    else:
        kind, action = "inconclusive", "HOLD"
    after = dataclasses.replace(
        state,
        share=share,
        phase=phase,
        judge_from_ms=judge_from,
        last_window_ms=canary.window_start_ms,
        step=step if share == state.share else StepCounts(),
    )
    return Decision(
        event_id=f"{state.rollout_id}/{state.lang}/{canary.window_start_ms}",
        action=action,
        share_before=state.share,
        share_after=share,
        verdict=Verdict(kind, tuple(reasons), figures),
        state=after,
        window_start_ms=canary.window_start_ms,
        window_end_ms=canary.window_end_ms,
    )


def apply_event(state: RolloutState | None, event: Mapping[str, Any]) -> RolloutState | None:
    """The state after one rollout event (a decoded `RolloutEvent`); unchanged when the event
    does not apply (another rollout, a window already applied). Folding the same events in
    the same order always gives the same state; folding one twice changes nothing."""
    action = str(event["action"])
    rollout_id = str(event["rollout_id"])
    if action == "START":
        return RolloutState(
            rollout_id=rollout_id,
            lang=str(event["language"]),
            stable=str(event["stable_arm"]),
            canary=str(event["canary_arm"]),
            share=float(event["share_after"]),
            steps=validate_steps(event.get("steps") or DEFAULT_STEPS),
            judge_from_ms=int(event["decided_at"]),
        )
    if state is None or rollout_id != state.rollout_id:
        return state
    share = float(event["share_after"])
    if action == "ABORT":
        return dataclasses.replace(state, share=share, phase="aborted")
    window = event.get("window_start")
    if action in WINDOW_ACTIONS and window is not None:
        if int(window) <= state.last_window_ms:
            return state  # a duplicate (replayed window, a second guard)
        phase = {"ROLLBACK": "rolled_back", "COMPLETE": "complete"}.get(action, state.phase)
        changed = share != state.share
        return dataclasses.replace(
            state,
            share=share,
            phase=phase,
            good_streak=int(event.get("good_streak", 0)),
            bad_streak=int(event.get("bad_streak", 0)),
            last_window_ms=int(window),
            judge_from_ms=int(event["window_end"]) if changed else state.judge_from_ms,
            step=StepCounts() if changed else StepCounts.from_figures(event.get("figures")),
        )
    if action == "PROMOTE":  # an operator's: no window; judging restarts after it
        phase = "complete" if share >= 100.0 else "active"
        return dataclasses.replace(
            state,
            share=share,
            phase=phase,
            good_streak=0,
            bad_streak=0,
            judge_from_ms=int(event["decided_at"]),
            step=StepCounts(),
        )
    return state
