"""The guard's decision modules stay pure (the rule of tests/test_architecture.py, with the
pure modules they build on allowed): no Kafka, no faust, no metrics, no threads, no model."""

from __future__ import annotations

import pytest

from tests.test_architecture import ROOT, imported_modules

GUARD_PURE = ("workers/guard/policy.py", "workers/guard/windows.py", "workers/guard/sequential.py")
NOT_PURE = ("confluent_kafka", "redis", "faust", "prometheus_client", "torch", "threading")
ALLOWED_PROJECT = (
    "workers.arms",
    "workers.fairness.policy",
    "workers.guard.sequential",
    "workers.guard.windows",
    "workers.reply_metadata",  # the reply metadata keys: constants, no imports
)


@pytest.mark.parametrize("module", GUARD_PURE)
def test_guard_decisions_import_no_io(module: str) -> None:
    imported = imported_modules(ROOT / module)
    assert imported, f"{module}: the checker found no imports"
    bad = sorted(m for m in imported if any(m == p or m.startswith(p + ".") for p in NOT_PURE))
    bad += sorted(
        m
        for m in imported
        if m.startswith("workers.") and not any(m.startswith(a + ".") for a in ALLOWED_PROJECT)
    )
    assert not bad, f"{module} imports {bad}"
