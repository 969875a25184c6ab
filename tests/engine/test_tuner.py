"""The tuner (workers/engine/tuner.py): the served speed against the probe's figures, the
decisions to probe again, and a move of a real serving engine to another configuration with
no request lost, answered twice or computed by two models (issue #47, Done-when 4)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from workers.engine.autoconfig import Candidate, Choice
from workers.engine.tuner import (
    ConfigTuner,
    TunerSettings,
    expected_tok_s,
    served_ratio,
    tally_between,
)

F32 = Candidate("float32", False)
I8 = Candidate("int8", False)
I8C = Candidate("int8", True)


def test_expected_speed_interpolates_between_probed_batch_sizes() -> None:
    figures = {1: 40.0, 8: 200.0, 16: 280.0}
    assert expected_tok_s(figures, 1) == 40.0
    assert expected_tok_s(figures, 4) == pytest.approx(40.0 + 160.0 * 3 / 7)
    assert expected_tok_s(figures, 12) == pytest.approx(240.0)
    assert expected_tok_s(figures, 64) == 280.0  # beyond the largest: the largest's
    assert expected_tok_s({}, 4) is None


def test_served_ratio_compares_seconds_taken_with_seconds_predicted() -> None:
    figures = {1: 50.0, 8: 200.0}  # b1: 20 ms a step; b8: 40 ms a step
    as_probed = {1: (100, 2.0), 8: (50, 2.0)}
    assert served_ratio(figures, as_probed) == pytest.approx(1.0)
    twice_as_slow = {1: (100, 4.0), 8: (50, 4.0)}
    assert served_ratio(figures, twice_as_slow) == pytest.approx(0.5)
    assert served_ratio(figures, {}) is None
    assert tally_between({1: (10, 1.0)}, {1: (25, 2.5), 8: (3, 0.3)}) == {
        1: (15, 1.5),
        8: (3, 0.3),
    }


@dataclass
class FakeStats:
    decode_by_batch: dict[int, tuple[int, float]] = field(default_factory=dict)


class FakeEngine:
    """The parts of `Engine` the tuner uses; `switch_to` takes effect at once."""

    def __init__(self) -> None:
        self.stats = FakeStats()
        self.config_report: Any = None
        self.switched_to: list[Any] = []

    def serve(self, batch: int, steps: int, seconds: float) -> None:
        n, s = self.stats.decode_by_batch.get(batch, (0, 0.0))
        self.stats.decode_by_batch[batch] = (n + steps, s + seconds)

    def switch_to(self, other: Any) -> threading.Event:
        self.switched_to.append(other)
        done = threading.Event()
        done.set()
        return done


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def choice(c: Candidate, figures: dict[Candidate, dict[int, float]], **kw: Any) -> Choice:
    return Choice(c, f"{c.label} (test)", (), figures[c], figures=figures, **kw)


FIGURES = {F32: {1: 50.0, 8: 200.0}, I8: {1: 45.0, 8: 190.0}}
SETTINGS = TunerSettings(min_decode_steps=20, sustained_checks=2, min_reprobe_s=600.0)


def make_tuner(
    engine: FakeEngine, start: Choice, probe_result: Choice, clock: Clock
) -> tuple[ConfigTuner, list[str]]:
    switches: list[str] = []
    tuner = ConfigTuner(
        engine,
        start,
        probe=lambda: probe_result,
        build=lambda new: f"engine of {new.candidate.label}",
        settings=SETTINGS,
        clock=clock,
        on_switch=lambda old, new, why: switches.append(f"{old}->{new}"),
    )
    return tuner, switches


def test_served_as_probed_never_asks_for_a_probe() -> None:
    engine, clock = FakeEngine(), Clock()
    tuner, _ = make_tuner(engine, choice(F32, FIGURES), choice(F32, FIGURES), clock)
    for _ in range(5):
        engine.serve(1, 50, 50 / 50.0 * 1.05)  # 5 % below the figure: within the margin
        clock.now += 30
        assert tuner.check() is None
    assert engine.config_report.served_vs_probe == pytest.approx(1 / 1.05, abs=1e-3)


def test_sustained_slowness_probes_again_and_moves() -> None:
    engine, clock = FakeEngine(), Clock()
    faster = {**FIGURES, I8C: {1: 90.0, 8: 300.0}}
    tuner, switches = make_tuner(engine, choice(F32, FIGURES), choice(I8C, faster), clock)
    engine.serve(1, 5, 1.0)
    assert tuner.check() is None  # too few steps: waits for more
    engine.serve(1, 50, 2.0)  # 55 steps in 3 s: 18 tok/s against 50 probed
    assert tuner.check() is None  # one slow check is not yet a trend
    engine.serve(1, 60, 3.0)
    why = tuner.check()
    assert why == "float32 served at 0.40x its own probe figure"  # 60 steps: 1.2 s in 3 s
    tuner.reprobe(why)
    assert switches == ["float32->int8+compiled"]
    assert engine.switched_to == ["engine of int8+compiled"]
    report = engine.config_report
    assert report.in_use == "int8+compiled" and report.switches == 1
    assert "float32 -> int8+compiled" in report.last_switch and not report.probing
    # right after a re-probe, slowness does not probe again before min_reprobe_s
    engine.serve(1, 60, 6.0)
    clock.now += 30
    assert tuner.check() is None
    engine.serve(1, 60, 6.0)
    clock.now += 30
    assert tuner.check() is None


def test_a_cascade_worker_shows_the_served_speed_but_never_probes_for_it() -> None:
    """With the cascade's large model on the same cores the small model's steps run slower
    than its probe measured them; that is not a slow configuration (watch_served=False)."""
    from dataclasses import replace

    engine, clock = FakeEngine(), Clock()
    tuner, switches = make_tuner(engine, choice(F32, FIGURES), choice(F32, FIGURES), clock)
    tuner.settings = replace(SETTINGS, watch_served=False)
    for _ in range(4):
        engine.serve(1, 60, 3.0)  # 0.40x the probe figure, check after check
        clock.now += 30
        assert tuner.check() is None
    assert engine.config_report.served_vs_probe == pytest.approx(0.4, abs=1e-3)
    assert switches == []


def test_a_probe_that_keeps_the_choice_does_not_switch() -> None:
    engine, clock = FakeEngine(), Clock()
    tuner, switches = make_tuner(engine, choice(F32, FIGURES), choice(F32, FIGURES), clock)
    tuner.reprobe("test")
    assert switches == [] and engine.switched_to == []
    assert engine.config_report.in_use == "float32"


def test_a_reprobe_that_keeps_the_configuration_learns_the_workloads_gap() -> None:
    """The 1.5B on few-shot prompts served at 0.82x its probe figure (longer contexts than the
    probe's) and re-probed to keep what it had; without learning that gap it would re-probe
    every `min_reprobe_s` for good. After a keep, 0.82x is its normal: served at that speed
    it never asks again, and a real slowdown below the normal still does."""
    engine, clock = FakeEngine(), Clock()
    tuner, switches = make_tuner(engine, choice(F32, FIGURES), choice(F32, FIGURES), clock)
    whys = []
    for _ in range(2):
        engine.serve(1, 50, 50 / 50.0 / 0.82)  # 0.82x its own figure: below 1 - margin
        clock.now += 30
        whys.append(tuner.check())
    assert whys[0] is None and whys[1] == "float32 served at 0.82x its own probe figure"
    engine.serve(1, 500, 1.0)  # steps served while the probe shares the cores: not counted
    tuner.reprobe(whys[1])
    assert switches == [] and tuner.normal == pytest.approx(0.82, abs=1e-3)
    assert engine.config_report.served_normal == pytest.approx(0.82, abs=1e-3)
    for _ in range(6):  # the same gap, long past min_reprobe_s: never asks again
        engine.serve(1, 50, 50 / 50.0 / 0.82)
        clock.now += SETTINGS.min_reprobe_s
        assert tuner.check() is None
    slower = []
    for _ in range(2):  # 0.6x the figure: 0.73x its normal, a real slowdown
        engine.serve(1, 50, 50 / 50.0 / 0.6)
        clock.now += 30
        slower.append(tuner.check())
    assert slower[1] == "float32 served at 0.73x its own probe figure (over its normal 0.82x here)"


def test_a_busy_probe_or_a_switch_teaches_no_gap() -> None:
    engine, clock = FakeEngine(), Clock()
    busy = choice(F32, FIGURES, pending_probe=True)
    tuner, _ = make_tuner(engine, choice(F32, FIGURES), busy, clock)
    for _ in range(2):
        engine.serve(1, 50, 50 / 50.0 / 0.7)
        clock.now += 30
        why = tuner.check()
    assert why is not None
    tuner.reprobe(why)  # kept, but measured on a busy host: no lesson in it
    assert tuner.normal == 1.0


def test_a_gap_wider_than_half_is_not_learnt_whole() -> None:
    """A kept configuration served at 0.3x its figure is no workload's normal: the tuner takes
    at most MIN_NORMAL (0.5), so a later collapse still asks for a probe."""
    from workers.engine.tuner import MIN_NORMAL

    engine, clock = FakeEngine(), Clock()
    tuner, _ = make_tuner(engine, choice(F32, FIGURES), choice(F32, FIGURES), clock)
    for _ in range(2):
        engine.serve(1, 50, 50 / 50.0 / 0.3)
        clock.now += 30
        why = tuner.check()
    assert why is not None
    tuner.reprobe(why)
    assert tuner.normal == MIN_NORMAL == 0.5


def test_another_candidate_beating_the_served_speed_probes_again() -> None:
    # the in-use figure is close to served, but int8's figure beats what is served by > 10 %
    figures = {F32: {1: 50.0, 8: 200.0}, I8: {1: 80.0, 8: 320.0}}
    engine, clock = FakeEngine(), Clock()
    tuner, _ = make_tuner(engine, choice(F32, figures), choice(I8, figures), clock)
    for _ in range(2):
        engine.serve(1, 50, 50 / 50.0 / 0.88)  # 0.88x its own figure: not "slow" (margin 15 %)
        clock.now += 30
        why = tuner.check()
    assert why is not None and "the probe measured for int8" in why


def test_a_busy_probe_is_repeated_later() -> None:
    engine, clock = FakeEngine(), Clock()
    busy = choice(F32, FIGURES, pending_probe=True)
    tuner, _ = make_tuner(engine, busy, busy, clock)
    assert tuner.check() is None
    clock.now += SETTINGS.busy_retry_s
    assert tuner.check() == "the last probe ran on a busy host"
    assert tuner.check() is None  # asked once


def test_a_failed_probe_or_build_keeps_the_configuration_in_use() -> None:
    engine, clock = FakeEngine(), Clock()

    def broken_probe() -> Choice:
        raise RuntimeError("no memory")

    tuner = ConfigTuner(
        engine, choice(F32, FIGURES), probe=broken_probe, build=lambda c: None, clock=clock
    )
    tuner.reprobe("test")
    assert engine.switched_to == [] and engine.config_report.in_use == "float32"

    def broken_build(c: Choice) -> Any:
        raise RuntimeError("compile failed")

    tuner = ConfigTuner(
        engine,
        choice(F32, FIGURES),
        probe=lambda: choice(I8, FIGURES),
        build=broken_build,
        clock=clock,
    )
    tuner.reprobe("test")
    assert engine.switched_to == [] and engine.config_report.in_use == "float32"


@pytest.mark.slow
def test_a_scripted_slow_configuration_is_switched_with_no_request_lost(smollm2: Any) -> None:
    """Done-when 4 of issue #47: a real SmolLM2 engine serving from its loop thread is made slow
    (each model step sleeps); the tuner sees the served speed far below the probe's figure,
    probes (scripted: int8 wins), builds the int8 engine and moves to it while requests keep
    coming. Every request is answered exactly once, OK, and by one model only."""
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import load_model

    slow = Engine(smollm2, EngineConfig(model="smollm2-135m", max_new_tokens=6))
    fast = Engine(
        load_model("smollm2-135m"),
        EngineConfig(model="smollm2-135m", quantize="int8", max_new_tokens=6),
    )
    models_by_request: dict[str, set[int]] = {}
    finished: list[str] = []
    run_model, finish = slow._run_model, slow.results.finish

    def scripted_slow_run(out: Any) -> Any:  # the slow configuration: 40 ms more per step
        for c in out.chunks:
            models_by_request.setdefault(c.seq.request_id, set()).add(id(slow.model))
        if slow.config.quantize is None:
            time.sleep(0.04)
        return run_model(out)

    def counted_finish(seq: Any) -> Any:
        finished.append(seq.request_id)
        return finish(seq)

    slow._run_model = scripted_slow_run  # type: ignore[method-assign]
    slow.results.finish = counted_finish  # type: ignore[method-assign]
    figures = {F32: {1: 60.0, 8: 240.0}, I8: {1: 55.0, 8: 220.0}}
    built: list[Engine] = []

    def build(new: Choice) -> Engine:
        built.append(fast)
        return fast

    tuner = ConfigTuner(
        slow,
        choice(F32, figures),
        probe=lambda: choice(I8, figures),
        build=build,
        settings=TunerSettings(check_every_s=0.3, min_decode_steps=8, min_reprobe_s=0.0),
    )
    slow.start()
    tuner.start()
    handles: list[Any] = []
    try:
        texts = ["Good morning!", "Where is my order?", "Thank you very much.", "I need help."]
        deadline = time.monotonic() + 60
        while (tuner.switches == 0 or len(handles) < 24) and time.monotonic() < deadline:
            for text in texts:
                request = slow.translation_request(text, "en", "de")
                handles.append(slow.submit(request))
            time.sleep(0.15)
        results = [h.result(timeout=60) for h in handles]
    finally:
        tuner.stop()
        slow.stop()
    assert tuner.switches == 1 and built == [fast]
    assert slow.config.quantize == "int8" and slow.model is fast.model
    assert slow.config_report is not None and slow.config_report.in_use == "int8"
    ids = [h.request_id for h in handles]
    assert sorted(finished) == sorted(ids)  # every request finished once: none lost, none twice
    assert all(r.ok and r.text.strip() for r in results), [r.error for r in results if not r.ok]
    # none was computed by two models (the switch waited for the running ones to finish)
    assert all(len(models) == 1 for models in models_by_request.values())
    after = [rid for rid in ids if models_by_request[rid] == {id(fast.model)}]
    assert after, "no request was served after the switch"


def test_the_tuner_says_when_it_is_busy_so_the_worker_does_not_wait_at_exit() -> None:
    engine, clock = FakeEngine(), Clock()
    seen: list[bool] = []

    def probe() -> Choice:
        seen.append(tuner.busy)
        return choice(F32, FIGURES)

    tuner = ConfigTuner(engine, choice(F32, FIGURES), probe=probe, build=lambda c: c, clock=clock)
    assert not tuner.busy
    tuner.reprobe("test")
    assert seen == [True] and not tuner.busy


def test_a_probe_frees_its_threads_openmp_pool_whether_it_switches_fails_or_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe and the build run torch work on the tuner's thread; its OpenMP pool, left
    beside the serving engine's, throttles both (first starts served 4-24 % slower than a
    start with the probe stored): each re-probe ends by freeing it, on its own thread."""
    from workers.engine import tuner as tuner_module

    freed: list[str] = []
    monkeypatch.setattr(
        tuner_module, "release_openmp_pool", lambda: freed.append(threading.current_thread().name)
    )
    engine, clock = FakeEngine(), Clock()
    faster = {**FIGURES, I8C: {1: 90.0, 8: 300.0}}
    tuner, switches = make_tuner(engine, choice(F32, FIGURES), choice(I8C, faster), clock)
    tuner.reprobe("switches")
    assert switches == ["float32->int8+compiled"] and len(freed) == 1

    def failing() -> Choice:
        raise RuntimeError("probe failed")

    tuner.probe = failing
    tuner.reprobe("fails")
    assert len(freed) == 2
    thread = threading.Thread(target=tuner.reprobe, args=("on the tuner's thread",), name="t")
    thread.start()
    thread.join()
    assert freed[-1] == "t"


def test_eager_steps_served_while_graphs_compile_are_not_the_configurations_speed(
    smollm2: Any,
) -> None:
    """A compiled configuration serves eagerly until its graphs are built in the background;
    those steps are not counted as its decode speed (counted, a 1.5B model's first minute read
    as 0.83x its probe figure and started a ten-minute re-probe beside the serving engine)."""
    from workers.engine.engine import Engine, EngineConfig

    config = EngineConfig(model="smollm2-135m", max_new_tokens=6, compile_decode=True)
    warming = Engine(smollm2, config)
    assert warming.compiled is not None
    warming.compiled.ready = warming.compiled.rows_ready = False  # as while graphs build
    (result,) = warming.generate([warming.translation_request("Thank you.", "en", "de")])
    assert result.tokens_out > 1 and warming.stats.steps_by_kind.get("decode", 0) > 0
    assert warming.stats.decode_by_batch == {}
    eager = Engine(smollm2, EngineConfig(model="smollm2-135m", max_new_tokens=6))
    eager.generate([eager.translation_request("Thank you.", "en", "de")])
    assert sum(n for n, _ in eager.stats.decode_by_batch.values()) > 0
