"""The Kubernetes manifests of deploy/k8s/, validated offline (no cluster).

* Core kinds (Deployment, Service, ConfigMap, HPA, PodDisruptionBudget, Namespace):
  `kubernetes-validate` (PyPI), strict (unknown fields are errors), against the oldest and the
  newest Kubernetes version it ships schemas for that we support.
* Custom resources (KEDA ScaledObject, Prometheus Operator PodMonitor) and the
  prometheus-adapter config: jsonschema against the schemas in deploy/k8s/schemas/. Those
  schemas are NOT the CRDs' published ones: neither PyPI nor npm ships those as JSON Schema
  (npm's @kubernetes-models packages ship compiled JavaScript validators), so we wrote them from
  the projects' documentation; deploy/k8s/schemas/SOURCE.md says what they cover and miss.
* Every manifest must be claimed by one of the two validators, and each validator is shown to
  reject a broken object, so a green run means something.
* Cross-checks the validators cannot make: the ConfigMap is a valid tolk `Settings`; the probes
  and ports match it; the grace period covers the drain; the selectors match the pods; every
  language has a Kafka lag trigger on its catalog topic and the worker's group; the queries name
  metrics the worker really exports; the HPA's metrics are what the adapter's rules produce.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from topics.catalog import catalog, request_topic
from workers.metrics import WorkerMetrics
from workers.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # HPA v2 and PDB v1 are GA
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject.schema.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.schema.json",
}
CORE_KINDS = {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler",
              "PodDisruptionBudget", "Namespace"}  # fmt: skip


def manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S.rglob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                yield f"{path.relative_to(K8S)}#{i}", doc


ALL = list(manifests())


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in ALL if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} manifests"
    return found[0]


def crd_validator(doc: dict[str, Any]) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    return [e.message for e in crd_validator(doc).iter_errors(doc)]


def worker_settings() -> Settings:
    return Settings.from_env(one("ConfigMap", "tolk-worker-config")["data"])


def worker_container() -> dict[str, Any]:
    (container,) = one("Deployment", "tolk-worker")["spec"]["template"]["spec"]["containers"]
    return container


# -- validation ---------------------------------------------------------------------------------


def test_the_manifest_set_is_complete() -> None:
    kinds = {d["kind"] for _, d in ALL}
    assert kinds == CORE_KINDS | {"ScaledObject", "PodMonitor"}


@pytest.mark.parametrize("where,doc", ALL, ids=[w for w, _ in ALL])
def test_every_manifest_validates(where: str, doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        assert crd_errors(doc) == []
    else:
        assert doc["kind"] in CORE_KINDS, f"{where}: no validator claims {key}"
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_validate_rejects_a_broken_deployment() -> None:
    broken = copy.deepcopy(one("Deployment"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    misspelt = copy.deepcopy(one("Deployment"))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, K8S_VERSIONS[-1], strict=True)


def test_the_crd_schemas_reject_broken_objects() -> None:
    scaled = one("ScaledObject")
    no_topic_group = copy.deepcopy(scaled)
    del no_topic_group["spec"]["triggers"][0]["metadata"]["consumerGroup"]
    assert any("consumerGroup" in e for e in crd_errors(no_topic_group))
    typo = copy.deepcopy(scaled)
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    assert crd_errors(typo)
    no_query = copy.deepcopy(scaled)
    prom = next(t for t in no_query["spec"]["triggers"] if t["type"] == "prometheus")
    del prom["metadata"]["query"]
    assert any("query" in e for e in crd_errors(no_query))
    numeric = copy.deepcopy(scaled)
    numeric["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 50  # must be a string
    assert crd_errors(numeric)

    monitor = copy.deepcopy(one("PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "fifteen seconds"
    assert crd_errors(monitor)
    del monitor["spec"]["selector"]
    assert any("selector" in e for e in crd_errors(monitor))


# -- cross-checks -------------------------------------------------------------------------------


def test_the_configmap_is_a_valid_worker_configuration() -> None:
    s = worker_settings()
    assert s.health_port == 8081 and s.metrics_port == 9400
    assert s.drain_refresh_s > 0 and s.liveness_stall_s > 0
    assert set(s.languages) == {"en", "de", "fr", "es", "it"}
    assert s.group_protocol == "consumer"  # fair share across workers


def test_probes_and_ports_match_the_worker_settings() -> None:
    s = worker_settings()
    c = worker_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": s.metrics_port, "health": s.health_port}
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"),
                        ("livenessProbe", "/livez")):  # fmt: skip
        assert c[probe]["httpGet"] == {"path": path, "port": "health"}
    assert c["envFrom"] == [{"configMapRef": {"name": "tolk-worker-config"}}]
    # the startup probe must outlast a first start: dequantizing the GGUF plus compiling
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    # liveness must not restart a pod faster than the engine's own stall limit
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] < s.liveness_stall_s


def test_the_grace_period_covers_the_drain() -> None:
    s = worker_settings()
    pod = one("Deployment")["spec"]["template"]["spec"]
    # drain, then the engine's stop (<= 5 s) and the flush/commit/close, with a margin
    assert pod["terminationGracePeriodSeconds"] >= s.drain_timeout_s + 5 + 15
    assert "lifecycle" not in worker_container()  # no preStop sleep eating the grace period


def test_selectors_match_the_worker_pods() -> None:
    deployment = one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        one("Service")["spec"]["selector"],
        one("PodMonitor")["spec"]["selector"]["matchLabels"],
        one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= pod_labels.items()
    metrics_ports = {p["name"] for p in worker_container()["ports"]}
    assert one("PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] in metrics_ports
    assert one("Service")["spec"]["ports"][0]["targetPort"] in metrics_ports


def test_every_namespaced_object_is_in_the_tolk_namespace() -> None:
    for where, doc in ALL:
        if doc["kind"] == "Namespace":
            continue
        expected = "monitoring" if where.startswith("hpa/prometheus-adapter") else "tolk"
        assert doc["metadata"].get("namespace") == expected, where


def test_keda_has_a_lag_trigger_per_language_topic_and_a_time_to_drain_trigger() -> None:
    s = worker_settings()
    scaled = one("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == one("Deployment")["metadata"]["name"]
    kafka = [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "kafka"]
    assert sorted(m["topic"] for m in kafka) == sorted(request_topic(g) for g in s.languages)
    assert {m["consumerGroup"] for m in kafka} == {s.consumer_group()}
    assert {m["bootstrapServers"] for m in kafka} == {s.bootstrap}
    (drain,) = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert drain["metricType"] == "Value"  # proportional: ceil(current x value / target)
    assert "tolk_time_to_drain_seconds" in drain["metadata"]["query"]
    assert "clamp_max" in drain["metadata"]["query"]  # the +Inf sentinel made finite
    # with KIP-848's range assignor every worker holds every language: at most as many
    # workers as one language topic has partitions (the catalog's default)
    assert scaled["spec"]["maxReplicaCount"] == catalog(["de"])[0].partitions


def exported_metric_names() -> set[str]:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.init_languages(("de",))
    metrics.set_drain("de", 1, 1.0, 1.0)
    metrics.e2e_latency_seconds.labels(lang="de").observe(0.1)
    return {s.name for family in registry.collect() for s in family.samples}


def test_queries_name_metrics_the_worker_exports() -> None:
    exported = exported_metric_names()
    scaled = one("ScaledObject")
    triggers = scaled["spec"]["triggers"]
    queries = [t["metadata"]["query"] for t in triggers if "query" in t["metadata"]]
    adapter = yaml.safe_load(one("ConfigMap", "prometheus-adapter-tolk")["data"]["config.yaml"])
    queries += [r["seriesQuery"] for r in adapter["rules"]]
    for query in queries:
        for name in re.findall(r"\btolk_[a-z0-9_]+", query):
            assert name in exported, f"{name} (in {query!r}) is not exported by the worker"


def test_the_hpa_metrics_are_what_the_adapter_rules_produce() -> None:
    config = yaml.safe_load(one("ConfigMap", "prometheus-adapter-tolk")["data"]["config.yaml"])
    schema = json.loads((SCHEMAS / "prometheus-adapter-config.schema.json").read_text())
    jsonschema.validate(config, schema)
    produced = {r["name"]["as"] for r in config["rules"]}
    hpa = one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one("Deployment")["metadata"]["name"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted == produced == {"tolk_gpu_utilization_percent", "tolk_latency_p50_seconds"}
    assert hpa["spec"]["maxReplicas"] == one("ScaledObject")["spec"]["maxReplicaCount"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"rules": [{"seriesQuery": "x", "name": {"matches": "x"}}]}, schema)
