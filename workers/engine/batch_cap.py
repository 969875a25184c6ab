"""The running batch's cap (`max_num_seqs`), picked from measured decode speeds.

Continuous batching adds a request to the running batch whenever a slot is free, and every
running request then decodes at the pace of the whole batch: one step per token, and a step
costs more the more rows it has. On a GPU a bigger batch is almost free up to large sizes; on a
CPU the decode step becomes compute-bound early, and beyond that point a bigger batch buys no
throughput, only longer steps. Gemma 3 270M, int8 + compiled, 2 AMD EPYC (Zen 4) vCPUs
(docs/BENCHMARKS.md, "The running batch's cap"): decode steps of 23 / 36 / 64 / 149 ms at
batch 4 / 8 / 16 / 32, that is 171 / 222 / 252 / 215 tokens/s. With the old fixed cap of 32 an
overloaded language filled the batch, and a light language's request, admitted first by the
fair share, still decoded at a 32-row batch's pace (on a Xeon: P99 11.6 s against a 3 s SLO).

`choose_batch_cap(tok_s, tightest_slo_s)` is pure. From the probe's decode tokens/s per batch
size (`workers/engine/autoprobe.py`) it takes

1. the knee: the smallest measured cap (of `CAP_CHOICES`) whose tokens/s is within
   `THROUGHPUT_TOLERANCE` of the best measured one (a bigger batch would buy at most that much
   throughput with proportionally longer steps);
2. then lowers it, one choice at a time, while a request of `TYPICAL_OUTPUT_TOKENS` tokens
   decoding in a full batch (tokens x step time) would not finish within the tightest
   language's SLO: the light language's P99 is a full batch's steps, whatever the fair share.

It never goes below the smallest choice: smaller batches lose throughput steeply (batch 1 is a
quarter of batch 8's tokens/s above), and under overload throughput is what admits anybody.
Without measurements (flags instead of the probe, a GPU) the caller's default stands.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "CAP_CHOICES",
    "THROUGHPUT_TOLERANCE",
    "TYPICAL_OUTPUT_TOKENS",
    "BatchCap",
    "choose_batch_cap",
]

CAP_CHOICES = (8, 16, 32)  # the batch sizes the probe measures above batch 1
THROUGHPUT_TOLERANCE = 0.15  # share of the best tokens/s a smaller cap may give up
# a support turn's translation: the load mix's outputs are mostly 10-40 tokens
TYPICAL_OUTPUT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class BatchCap:
    max_num_seqs: int
    reason: str  # logged at start-up: the figures behind the choice
    # a decode-only step's seconds by batch size up to the cap, as measured (empty: not); the
    # scheduler's pace hook reads it at the running batch's size (workers/serving/pace.py)
    steps: dict[int, float] = field(default_factory=dict)


def choose_batch_cap(
    tok_s: Mapping[int, float], tightest_slo_s: float | None, default: int
) -> BatchCap:
    """The running batch's cap from decode tokens/s per batch size (see the module docstring);
    `default` when fewer than two of `CAP_CHOICES` were measured."""
    measured = {b: s for b, s in tok_s.items() if b in CAP_CHOICES and s > 0}
    if len(measured) < 2:
        return BatchCap(default, f"{default} (batch sizes not measured: the default)")
    sizes = sorted(measured)
    best = max(measured.values())
    knee = next(b for b in sizes if measured[b] >= (1 - THROUGHPUT_TOLERANCE) * best)
    figures = ", ".join(
        f"b{b} {measured[b]:.0f} tok/s ({b / measured[b] * 1e3:.0f} ms/step)" for b in sizes
    )
    cap, why = knee, f"within {THROUGHPUT_TOLERANCE:.0%} of the best throughput"
    if tightest_slo_s is not None:
        while cap > sizes[0] and TYPICAL_OUTPUT_TOKENS * cap / measured[cap] > tightest_slo_s:
            cap = max(b for b in sizes if b < cap)
            why = (
                f"{TYPICAL_OUTPUT_TOKENS} tokens in a full batch within the tightest SLO "
                f"{tightest_slo_s:g} s"
            )
    steps = {b: b / s for b, s in tok_s.items() if 0 < b <= cap and s > 0}
    return BatchCap(cap, f"{cap} ({why}; {figures})", steps)
