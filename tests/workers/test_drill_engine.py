"""The drill wrapper (workers/stages/drill/stage.py): only the named language's fraction is hit, the
same requests every time, latency held back, errors made, every hit noted on the result."""

from __future__ import annotations

import time

import pytest

from tests.workers.fakes import FakeEngine
from workers.engine.types import FinishReason, TranslationRequest
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.drill.stage import DRILL_NOTE_KEY, DrillEngine, parse_drill


def _submit(engine: DrillEngine, rid: str, lang: str):  # noqa: ANN202
    return engine.submit_translation(
        TranslationRequest(request_id=rid, text="hello", source_lang="en", target_lang=lang)
    )


def test_latency_drill_delays_only_the_named_language() -> None:
    inner = FakeEngine()
    engine = DrillEngine(inner, [parse_drill("latency", "de:1.0:400")])
    engine.start()
    try:
        t0 = time.monotonic()
        fr = _submit(engine, "r-fr", "fr").result(timeout=5)
        fr_s = time.monotonic() - t0
        t0 = time.monotonic()
        de = _submit(engine, "r-de", "de").result(timeout=5)
        de_s = time.monotonic() - t0
    finally:
        engine.stop()
    assert de.ok and de.notes[DRILL_NOTE_KEY] == "latency" and de_s >= 0.4
    assert fr.ok and DRILL_NOTE_KEY not in fr.notes and fr_s < 0.3
    assert engine.hits == {("de", "latency"): 1}


def test_error_drill_hits_the_same_fraction_of_requests_every_time() -> None:
    fault = parse_drill("error", "fr:0.3")
    ids = [f"req-{i}" for i in range(1000)]
    hit = [rid for rid in ids if fault.hits("fr", rid)]
    assert 240 <= len(hit) <= 360  # about 30 %
    assert hit == [rid for rid in ids if fault.hits("fr", rid)]  # deterministic
    assert not any(fault.hits("de", rid) for rid in ids)
    engine = DrillEngine(FakeEngine(), [fault])
    engine.start()
    try:
        result = _submit(engine, hit[0], "fr").result(timeout=5)
    finally:
        engine.stop()
    assert result.finish_reason is FinishReason.ERROR and result.error == "drill: injected error"
    assert result.text == "" and result.notes[DRILL_NOTE_KEY] == "error"


def test_no_drill_flag_means_no_wrapper_and_bad_specs_are_refused() -> None:
    inner = FakeEngine()
    served = build_served_engine(inner, ServingOptions.of(Settings(), faithful=False))
    assert served.entry is inner and "drill" not in served.stages
    for kind, spec in (
        ("latency", "de:1.0"),
        ("error", "de:0"),
        ("latency", "de:x:10"),
        ("other", "de:1"),
    ):
        with pytest.raises(ValueError):
            parse_drill(kind, spec)
