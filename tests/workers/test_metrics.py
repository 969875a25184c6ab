"""WorkerMetrics: the fair-share series copied from the engine's waiting queue."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from workers.engine.types import GenerationRequest
from workers.fairness.vtc import VTCQueue
from workers.metrics import WorkerMetrics


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_fairness_gauges_follow_the_vtc_ledger() -> None:
    reg = CollectorRegistry()
    m = WorkerMetrics(reg)
    q = VTCQueue({"de": 4.0, "it": 1.0})
    for i, lang in enumerate(["de", "de", "it", "it"]):
        q.push(GenerationRequest(f"r{i}", [1, 2, 3], group=lang))
    req = q.pop()  # whichever VTC admits first
    q.charge(req, 100, 0)  # 100 uncached prompt tokens
    q.charge(req, 0, 10)  # + 10 output tokens -> 120 weighted tokens
    m.update_fairness(q)
    lang = req.group
    assert _value(reg, "tolk_worker_weighted_service_tokens", lang=lang) == 120.0
    assert _value(reg, "tolk_worker_vtc_counter", lang=lang) == q.counters()[lang]
    assert _value(reg, "tolk_worker_engine_queue_depth", lang="it") == q.depths()["it"]
    # both languages still waiting, one served 120/weight, the other nothing: unfair
    assert _value(reg, "tolk_worker_jain_index") == 0.5


def test_slo_attainment_is_a_rolling_share() -> None:
    reg = CollectorRegistry()
    m = WorkerMetrics(reg)
    for latency in (0.5, 1.0, 3.0, 0.2):
        m.observe_slo("de", latency, slo_s=2.0)
    assert _value(reg, "tolk_worker_slo_attainment_ratio", lang="de") == 0.75
    m.observe_slo("fr", 9.0, slo_s=None)  # no policy: nothing recorded
    assert _value(reg, "tolk_worker_slo_attainment_ratio", lang="fr") is None


def test_the_served_configuration_is_an_info_metric_and_switches_count() -> None:
    from workers.engine.autoconfig import ConfigReport

    reg = CollectorRegistry()
    m = WorkerMetrics(reg)
    m.engine.update_config(ConfigReport("int8", "chosen without measuring", probing=True))
    labels = {"in_use": "int8", "reason": "chosen without measuring", "probing": "true",
              "served_vs_probe": ""}  # fmt: skip
    assert _value(reg, "tolk_engine_config_info", **labels) == 1.0
    assert _value(reg, "tolk_engine_config_switches_total") == 0.0
    report = ConfigReport("int8+compiled", "fastest", switches=1, served_vs_probe=0.97)
    m.engine.update_config(report)
    m.engine.update_config(report)  # the same report again: counted once
    assert _value(reg, "tolk_engine_config_switches_total") == 1.0
    now = {"in_use": "int8+compiled", "reason": "fastest", "probing": "false",
           "served_vs_probe": "0.97"}  # fmt: skip
    assert _value(reg, "tolk_engine_config_info", **now) == 1.0
