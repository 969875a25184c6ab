"""Weighted per-language fair share: policies, the VTC queue, deadline admission, intake quotas.

Pure logic: no Kafka, no torch. See docs/ARCHITECTURE.md for where each piece plugs in.
"""

from workers.fairness.intake import IntakeController
from workers.fairness.latency_model import (
    AdmissionDecision,
    DeadlineAdmission,
    LatencyModel,
    LatencyPrior,
    Verdict,
)
from workers.fairness.policy import DEFAULT_POLICIES, LanguagePolicy, parse_policies, weights_of
from workers.fairness.vtc import FCFSQueue, VTCQueue, jain_index, service_cost

__all__ = [
    "DEFAULT_POLICIES",
    "AdmissionDecision",
    "DeadlineAdmission",
    "FCFSQueue",
    "IntakeController",
    "LanguagePolicy",
    "LatencyModel",
    "LatencyPrior",
    "VTCQueue",
    "Verdict",
    "jain_index",
    "parse_policies",
    "service_cost",
    "weights_of",
]
