"""What the worker changes after its tuner moved the engine (workers/worker_start.py,
`after_switch`): the cache's weight-format key and the pace hook's decode steps."""

from __future__ import annotations

from types import SimpleNamespace

from workers.engine.batch_cap import BatchCap, choose_batch_cap
from workers.serving.pace import SloPace
from workers.worker_start import after_switch


class _Served:
    def __init__(self) -> None:
        self.variants: list[str] = []

    def set_cache_variant(self, variant: str) -> None:
        self.variants.append(variant)


def _engine(pace: SloPace | None) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(quantize="int8", dtype=None),
        scheduler=SimpleNamespace(pace=pace),
    )


def test_the_pace_takes_the_new_configurations_steps_and_the_cache_its_format() -> None:
    # a first start's pace: the latency prior's step at the default cap of 32 (no figures yet)
    pace = SloPace({"de": 2.0, "en": 3.0}, decode_steps=0.0954)
    engine, served = _engine(pace), _Served()
    # the probe's figures for the configuration switched to (this host's int8+compiled)
    cap = choose_batch_cap({1: 49.9, 8: 105.9, 16: 142.6, 32: 108.3}, 2.0, 32)
    assert cap.max_num_seqs == 8 and set(cap.steps) == {1, 8}  # the tightest SLO lowers it
    after_switch(engine, served, cap)
    assert pace.decode_steps == cap.steps
    assert pace.step_s(1) == 1 / 49.9 and pace.step_s(8) == 8 / 105.9
    assert served.variants == ["quantize=int8"]
    # a de request of 13 expected tokens, 2 s from its SLO: at risk under the prior's 95 ms
    # step (13 x 2 x 95 ms > 2 s), not under the measured one
    request = SimpleNamespace(group="de", expected_output_tokens=13, arrival=0.0)
    assert pace([(request, 0)], now=0.0) is None
    assert SloPace({"de": 2.0}, 0.0954)([(request, 0)], now=0.0) == frozenset({"de"})


def test_without_measured_steps_the_pace_stays_as_it_was() -> None:
    pace = SloPace({"de": 2.0}, decode_steps=0.05)
    after_switch(_engine(pace), _Served(), BatchCap(32, "the default"))
    assert pace.decode_steps == {1: 0.05}
    after_switch(_engine(None), _Served(), None)  # a worker without the fair engine's pace
