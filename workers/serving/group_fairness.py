"""Weighted fair share across the workers of one consumer group: what holds, by simulation.

Each worker runs its own VTC queue (`workers.fairness.vtc`) over the requests of the partitions
it holds; no state is shared between workers. So the guarantee is **per worker**: among the
languages a worker holds, backlogged languages get its service in proportion to their weights.
Globally, language l gets the sum over workers of what each gave it. That sum is in proportion
to the weights exactly when every worker is backlogged in every language that is backlogged
at all, i.e. each worker holds at least one partition of every busy language and those
partitions bring it more than its fair share. If a worker holds no partition of a language,
the languages it does hold split its whole capacity between them, and the global split
follows the partition assignment, not the weights.

Hence the deployment rule (docs/ARCHITECTURE.md, "Several workers"): run the group with the
KIP-848 protocol (`TOLK_GROUP_PROTOCOL=consumer`) and give each language topic at least as
many partitions as there will be workers (a multiple of the worker count keeps the spread
even). The broker's `range` assignor of KIP-848 then splits every language topic over all
workers; the classic protocol's cooperative-sticky assignor balances only each worker's total
number of partitions, and on the real broker gave one of three workers all four partitions of
one language and the others none (tests/workers/test_partition_spread.py measures both).

`simulate_group` runs one `workers.serving.simulate` simulation per worker (the real scheduler
and queue, no model), each with the share of every language's offered load that its partitions
carry (keys hash evenly over partitions), and adds their per-language service up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from workers.fairness.vtc import jain_index
from workers.serving.sim_config import SimConfig
from workers.serving.simulate import simulate

__all__ = ["GroupResult", "simulate_group"]


@dataclass(frozen=True, slots=True)
class GroupResult:
    """Per-language service summed over the workers of a group."""

    service: dict[str, float]  # weighted tokens served in the measurement window
    normalized_service: dict[str, float]  # service / weight
    jain_index: float  # over the languages' normalized service (1 = shares follow weights)
    per_worker: list[dict[str, float]]  # each worker's service per language


def simulate_group(config: SimConfig, holdings: Sequence[Mapping[str, float]]) -> GroupResult:
    """`holdings[k][lang]`: the fraction of `lang`'s partitions worker k holds (each language's
    fractions sum to 1 over the workers; a missing language is 0)."""
    for lang in config.languages:
        total = sum(h.get(lang, 0.0) for h in holdings)
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"the workers hold {total:g} of {lang!r}'s partitions, not 1")
    per_worker: list[dict[str, float]] = []
    for k, held in enumerate(holdings):
        loads = {
            lang: dataclasses.replace(
                load,
                rate_rps=load.rate_rps * held.get(lang, 0.0),
                burst=round(load.burst * held.get(lang, 0.0)),
            )
            for lang, load in config.languages.items()
            if held.get(lang, 0.0) > 0
        }
        result = simulate(dataclasses.replace(config, languages=loads, seed=config.seed + k))
        per_worker.append({lang: r.service for lang, r in result.languages.items()})
    service = {lang: sum(w.get(lang, 0.0) for w in per_worker) for lang in config.languages}
    normalized = {lang: service[lang] / config.languages[lang].weight for lang in service}
    return GroupResult(
        service=service,
        normalized_service=normalized,
        jain_index=jain_index(list(normalized.values())),
        per_worker=per_worker,
    )
