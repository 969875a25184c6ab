"""The served configuration kept the fastest while the worker runs: `ConfigTuner`.

The probe (workers/engine/autoprobe.py) ranks the candidate configurations (weight format x
compiled decode) by short decode runs. Two things it cannot do alone (issue #47):

- **serve before it has measured.** On a machine never seen the probe takes minutes (every gated
  format loaded, each compiled: ~1-3 min per format on two cores, ~10 min for a 1.5B model).
  The worker starts on `unmeasured_choice` (int8 eager where its gate passes) and consumes at
  once; this tuner runs the probe on its own thread beside the serving engine, then moves the
  engine to the probe's choice;
- **notice that it was wrong.** A probe measured while other work held the cores can rank
  badly. The tuner keeps watching: every `check_every_s` it compares the engine's own
  decode-only steps since the last check (`EngineStats.decode_by_batch`: steps and seconds by
  batch size; not the eager steps a compiled configuration serves while its graphs build,
  which read as a slow configuration and once started a ten-minute re-probe of a 1.5B model
  beside the serving engine) with the probe's figures for the configuration in use,
  interpolated at the batch sizes served (`served_ratio`). Served below `1 - margin` of its
  own figure, or below `1 - other_margin` of another candidate's, for `sustained_checks`
  checks in a row: it probes again (at most once per `min_reprobe_s`) and moves if the new
  ranking says so. A probe that itself ran on a busy host is repeated after `busy_retry_s`.
  Served figures include the longer contexts of real prompts, so a configuration is served a
  little below its probe figure; the margins are wider than that gap for Gemma 3 270M
  (measured: docs/BENCHMARKS.md) but not for a 1.5B model on few-shot prompts of ~350 tokens,
  where attention is no longer negligible: it served at 0.82x its probe figure, and re-probed
  in the middle of a measurement to keep what it had. So a re-probe for slowness that **keeps**
  the configuration teaches the tuner the workload's gap: the served-over-probe ratio of the
  window that asked for it, against the fresh figures, becomes the configuration's `normal`
  (at least `MIN_NORMAL`), and later checks compare the served speed with `normal` x the
  figures (every candidate's: the gap is the workload's, not one configuration's). A probe
  taken on a busy host teaches nothing. The steps served while a probe ran (it shares the
  cores) are not counted either.
  A worker serving a cascade (`--cascade`) turns this check off
  (`TunerSettings.watch_served`): the large model's runs take the cores from the small one's
  steps, which read as 0.76x its probe figure and started a re-probe in the first served run.

Moving is `Engine.switch_to`: the new configuration's engine is built (and its graphs compiled,
its languages warmed) on this thread, then the serving engine takes its model side over at a
moment no sequence runs: requests wait in the queue meanwhile, none is dropped, none is computed
by two models. The scheduler, queue and fair share stay as they are. Each change is logged
with its reason, counted (`ConfigReport.switches`) and shown by `/readyz`, `tolk status` and
the `tolk_engine_config_info` metric (the worker reads `Engine.config_report`).

Costs, said plainly: the background probe and compilation share the cores with serving, so the
first minutes on a new machine serve slower than they will; a re-probe does the same for the
probe's length (the compiled graphs come from inductor's cache then, seconds per format).

Pure logic (`served_ratio`, `ConfigTuner.check`) is separate from the thread so tests drive it
with a clock and scripted figures; the engine and the probe come in as callables.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine.autoconfig import Choice, ConfigReport
from workers.engine.heap import trim_heap
from workers.engine.threads import release_openmp_pool

__all__ = ["ConfigTuner", "TunerSettings", "expected_tok_s", "served_ratio"]

log = logging.getLogger(__name__)

DecodeTally = Mapping[int, tuple[int, float]]  # batch size -> (decode steps, seconds)
MIN_NORMAL = 0.5  # the lowest served-over-probe ratio the tuner learns as a workload's normal


@dataclass(frozen=True, slots=True)
class TunerSettings:
    check_every_s: float = 30.0  # how often the served speed is compared with the probe's
    min_decode_steps: int = 100  # decode steps a check needs (fewer: it waits for more)
    margin: float = 0.15  # served below (1 - margin) x its own probe figure: slow
    other_margin: float = 0.10  # ... or below (1 - other_margin) x another candidate's figure
    sustained_checks: int = 2  # slow checks in a row before probing again
    min_reprobe_s: float = 1800.0  # at most one re-probe for slowness in this time
    busy_retry_s: float = 600.0  # a probe taken on a busy host is repeated after this
    # probe again when the served speed falls short (off where another engine of the process
    # shares the cores, the cascade's large model: its steps would read as a slow configuration)
    watch_served: bool = True


def expected_tok_s(figures: Mapping[int, float], batch: int) -> float | None:
    """Decode tokens/s at `batch` from a probe's figures by batch size: linear between the
    measured sizes, the nearest one's outside them; None without figures."""
    sizes = sorted(b for b, s in figures.items() if s > 0)
    if not sizes:
        return None
    if batch <= sizes[0]:
        return figures[sizes[0]]
    if batch >= sizes[-1]:
        return figures[sizes[-1]]
    hi = next(b for b in sizes if b >= batch)
    lo = max(b for b in sizes if b <= batch)
    if hi == lo:
        return figures[lo]
    w = (batch - lo) / (hi - lo)
    return figures[lo] * (1 - w) + figures[hi] * w


def served_ratio(figures: Mapping[int, float], window: DecodeTally) -> float | None:
    """How fast the served decode steps of `window` ran against `figures`: the seconds the
    figures predict for the same tokens at the same batch sizes, over the seconds they took
    (1.0: as probed; 0.5: half as fast). None when nothing comparable was served."""
    predicted = served = 0.0
    for batch, (steps, seconds) in window.items():
        speed = expected_tok_s(figures, batch)
        if not speed or steps <= 0:
            continue
        predicted += steps * batch / speed
        served += seconds
    return predicted / served if served > 0 else None


def tally_between(before: DecodeTally, after: DecodeTally) -> dict[int, tuple[int, float]]:
    """The decode steps counted after `before` (cumulative tallies)."""
    out = {}
    for batch, (steps, seconds) in after.items():
        s0, t0 = before.get(batch, (0, 0.0))
        if steps > s0:
            out[batch] = (steps - s0, seconds - t0)
    return out


class ConfigTuner:
    """Probes in the background when asked, watches the served speed, moves the engine.

    `engine`: the serving `Engine` (its `stats.decode_by_batch`, `switch_to`, `config_report`).
    `probe()`: measures afresh and returns the new `Choice` (autoprobe.auto_config(force=True)).
    `build(choice)`: the engine of `choice.candidate`, built, compiled and warmed, not started.
    `on_switch(old, new, why)`: told after each change (a log line is written regardless)."""

    def __init__(
        self,
        engine: Any,
        choice: Choice,
        *,
        probe: Callable[[], Choice],
        build: Callable[[Choice], Any],
        settings: TunerSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_switch: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.choice = choice
        self.probe = probe
        self.build = build
        self.settings = settings or TunerSettings()
        self.clock = clock
        self.on_switch = on_switch
        self.switches = 0
        self.last_switch = ""
        self._slow_checks = 0
        self._last_reprobe = -math.inf
        self._retry_at = clock() + self.settings.busy_retry_s if choice.pending_probe else None
        self._seen: dict[int, tuple[int, float]] = dict(engine.stats.decode_by_batch)
        self._served: float | None = None
        # served over probe figure that this workload shows at its best (see the docstring):
        # learnt from a re-probe for slowness that kept the configuration
        self.normal = 1.0
        self._slow_window: DecodeTally | None = None  # the window that asked for a re-probe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.busy = False  # probing or building now (torch work on this thread)
        self._publish(probing=False)

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tolk-tuner", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; a probe or build in progress ends on its own (daemon thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self.choice.pending_probe:
            self.reprobe("first start without a usable probe of this machine")
        while not self._stop.wait(self.settings.check_every_s):
            why = self.check()
            if why is not None:
                self.reprobe(why)

    # -- the decisions ---------------------------------------------------------------------
    def check(self) -> str | None:
        """One comparison of the served speed with the probe's figures; the reason to probe
        again, or None."""
        s = self.settings
        now = self.clock()
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = None
            return "the last probe ran on a busy host"
        after = dict(self.engine.stats.decode_by_batch)
        window = tally_between(self._seen, after)
        if sum(steps for steps, _ in window.values()) < s.min_decode_steps:
            return None  # too few steps yet: the window grows until the next check
        self._seen = after
        current = self.choice.candidate
        own = self.choice.figures.get(current) or self.choice.tok_s_by_batch
        ratio = served_ratio(own, window)
        self._served = ratio
        self._publish(probing=False)
        if not s.watch_served:
            return None  # shown (`_publish`), never acted on
        if ratio is not None:
            ratio /= self.normal
        others: dict[Any, float | None] = {}
        for c, f in self.choice.figures.items():
            if c != current:
                r = served_ratio(f, window)
                others[c] = None if r is None else r / self.normal
        beaten_by = min(
            ((r, c) for c, r in others.items() if r is not None),
            key=lambda rc: rc[0],
            default=None,
        )
        slow = ratio is not None and ratio < 1 - s.margin
        # another candidate would beat what is served, and what is served is below its own
        # figure too (else the probe's ranking, which weighs batch 1 and 8, stands as it is)
        beaten = (
            beaten_by is not None
            and beaten_by[0] < 1 - s.other_margin
            and (ratio is None or ratio < 1 - s.other_margin)
        )
        self._slow_checks = self._slow_checks + 1 if slow or beaten else 0
        if self._slow_checks < s.sustained_checks or now - self._last_reprobe < s.min_reprobe_s:
            return None
        self._slow_checks = 0
        normal = "" if self.normal == 1.0 else f" (over its normal {self.normal:.2f}x here)"
        if slow:
            self._slow_window = window
            return f"{current.label} served at {ratio:.2f}x its own probe figure{normal}"
        assert beaten_by is not None
        return (
            f"{current.label} served at {beaten_by[0]:.2f}x the speed the probe measured "
            f"for {beaten_by[1].label}{normal}"
        )

    def reprobe(self, why: str) -> None:
        """Measure again (this thread), then move to the new choice if it differs."""
        self.busy = True
        try:
            self._reprobe(why)
        finally:
            self.busy = False
            # the probe and the build ran torch work here: this thread's OpenMP pool, left
            # beside the serving engine's, makes more threads than CPUs, and libgomp then
            # throttles the spinning of both (workers/engine/threads.py): the likely reason
            # first starts served 4-24 % slower than a start with the probe stored
            # (docs/BENCHMARKS.md, "Five first starts, 120-s points")
            release_openmp_pool()

    def _reprobe(self, why: str) -> None:
        self._last_reprobe = self.clock()
        log.info("config tuner: probing (%s)", why)
        self._publish(probing=True)
        try:
            choice = self.probe()
        except Exception:  # a failed probe keeps the configuration in use
            log.exception("config tuner: the probe failed; keeping %s", self.choice.candidate)
            self._publish(probing=False)
            return
        self._retry_at = self.clock() + self.settings.busy_retry_s if choice.pending_probe else None
        slow_window, self._slow_window = self._slow_window, None
        if choice.candidate != self.choice.candidate:
            self._switch(choice, why)
        else:
            self.choice = choice  # the same configuration, fresh figures
            log.info("config tuner: keeping %s (%s)", choice.candidate.label, choice.reason)
            if slow_window is not None and not choice.pending_probe:
                self._learn_normal(choice, slow_window)
        # the steps served while the probe shared the cores say nothing of the configuration
        self._seen = dict(self.engine.stats.decode_by_batch)
        self._slow_checks = 0
        self._publish(probing=False)

    def _learn_normal(self, choice: Choice, window: DecodeTally) -> None:
        """The fresh probe kept the configuration that served slowly: the gap is the
        workload's (longer contexts than the probe's), not a wrong choice. Its size against
        the fresh figures is what later checks take as served-as-probed."""
        ratio = served_ratio(choice.figures.get(choice.candidate) or choice.tok_s_by_batch, window)
        if ratio is None:
            return
        # at most as probed; at least MIN_NORMAL: a gap wider than that, kept by the probe, is
        # no workload's length but something to look at, and must not blind later checks
        self.normal = min(1.0, max(MIN_NORMAL, ratio))
        log.warning(
            "config tuner: %s serves at %.2fx its probe figure on this workload and the probe "
            "keeps it: later checks take %.2fx as its normal",
            choice.candidate.label,
            ratio,
            self.normal,
        )

    def _switch(self, choice: Choice, why: str) -> None:
        old, new = self.choice.candidate, choice.candidate
        try:
            built = self.build(choice)
        except Exception:
            log.exception("config tuner: building %s failed; keeping %s", new.label, old.label)
            return
        done = self.engine.switch_to(built)
        while not done.wait(0.5):
            if self._stop.is_set():
                return  # the worker stops; the engine may still switch when it drains
        del built  # the engine now holds its model side; the old one's memory goes back
        trim_heap()
        self.switches += 1
        self.last_switch = f"{old.label} -> {new.label}: {why}"
        self.choice = choice  # (the served steps are counted afresh by `_reprobe`)
        log.warning("config tuner: switched %s (now: %s)", self.last_switch, choice.reason)
        if self.on_switch is not None:
            self.on_switch(old.label, new.label, why)

    def _publish(self, probing: bool) -> None:
        self.engine.config_report = ConfigReport(
            in_use=self.choice.candidate.label,
            reason=self.choice.reason,
            candidates=self.choice.lines,
            probing=probing,
            switches=self.switches,
            last_switch=self.last_switch,
            served_vs_probe=None if self._served is None else round(self._served, 3),
            served_normal=round(self.normal, 3),
        )
