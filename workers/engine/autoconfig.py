"""The worker's configuration picked by itself: the fastest candidate that passes the quality gate.

A candidate is a weight format (`float32`, `bfloat16`, `int8`: weight-only int8 projections and
LM head, `int4`: group-wise int4 projections and an int8 LM head; both with float32
activations) and whether small decode batches run compiled (`compile_decode`). Its speed is
measured on this machine and model by a short probe (`workers/engine/autoprobe.py`: a few
decode steps at batch 1 and 8, cached on disk); its quality
is the *recorded* gate (`quality_gate.json` beside this module, written once per model and format
by `bench/quality_gate.py`): chrF on a fixed dev slice within `GATE_CHRF` of float32 in every
direction. float32 is the reference and always passes; a format without a recorded gate for the
model does not pass (unknown quality is not assumed good).

`choose(measurements, overrides)` is pure: among the candidates that pass the gate, were
measured, and agree with the explicit flags (`Overrides`: `--quantize`, `--compile-decode`), it
takes the highest `score`, the geometric mean of batch-1 and batch-8 decode tokens/s (batch 1 is
one request's latency, batch 8 the throughput under load; neither alone). A format the flags
name is taken even if its gate fails (the operator's call; its line says so). It returns the
choice, the reason, and one log line per candidate. With nothing eligible it falls back to eager
float32, the configuration that needs nothing measured, and says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GATE_FILE = Path(__file__).with_name("quality_gate.json")
GATE_CHRF = 1.0  # chrF points below float32 a format may lose, in any direction
FORMATS = ("float32", "bfloat16", "int8", "int4")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration the worker can run."""

    weights: str  # "float32" | "bfloat16" | "int8" | "int4"
    compile_decode: bool

    def __post_init__(self) -> None:
        if self.weights not in FORMATS:
            raise ValueError(f"unknown weight format {self.weights!r} ({', '.join(FORMATS)})")

    @property
    def quantize(self) -> str | None:
        """`EngineConfig.quantize`."""
        return self.weights if self.weights in ("int8", "int4") else None

    @property
    def dtype(self) -> str | None:
        """`EngineConfig.dtype` (None: the device's default, float32 on the CPU)."""
        return "bfloat16" if self.weights == "bfloat16" else None

    @property
    def label(self) -> str:
        return f"{self.weights}{'+compiled' if self.compile_decode else ''}"


@dataclass(frozen=True, slots=True)
class Gate:
    """A format's recorded quality: chrF deltas to float32 per direction."""

    passed: bool
    detail: str  # e.g. "en-de -0.31, de-en +0.12" or why there is no record


@dataclass(frozen=True, slots=True)
class Measurement:
    """What the probe measured for one candidate (None: not measured, with `note` saying why)."""

    candidate: Candidate
    tok_s_b1: float | None
    tok_s_b8: float | None
    note: str = ""
    # tokens/s at the larger batch sizes, ((16, x), (32, y)): the running batch's cap
    # (workers/engine/batch_cap.py), not the ranking
    larger: tuple[tuple[int, float], ...] = ()

    def tok_s_by_batch(self) -> dict[int, float]:
        """Every measured batch size's decode tokens/s."""
        out = dict(self.larger)
        for batch, speed in ((1, self.tok_s_b1), (8, self.tok_s_b8)):
            if speed:
                out[batch] = speed
        return out

    @property
    def score(self) -> float | None:
        if not self.tok_s_b1 or not self.tok_s_b8:
            return None
        return math.sqrt(self.tok_s_b1 * self.tok_s_b8)


@dataclass(frozen=True, slots=True)
class Overrides:
    """Explicit flags: None leaves the dimension to the chooser."""

    weights: str | None = None
    compile_decode: bool | None = None

    def allows(self, c: Candidate) -> bool:
        return (self.weights is None or c.weights == self.weights) and (
            self.compile_decode is None or c.compile_decode == self.compile_decode
        )

    def describe(self) -> str:
        parts = []
        if self.weights is not None:
            parts.append(f"weights={self.weights}")
        if self.compile_decode is not None:
            parts.append(f"compile_decode={self.compile_decode}")
        return ", ".join(parts) or "none"


@dataclass(frozen=True, slots=True)
class Choice:
    candidate: Candidate
    reason: str
    lines: tuple[str, ...]  # one per candidate: speeds, gate, why (not) chosen
    tok_s_by_batch: Mapping[int, float] = field(default_factory=dict)  # the chosen one's
    # True: chosen without a usable probe (none on disk, or one taken on a busy host): the
    # worker serves it at once and probes in the background (workers/engine/tuner.py)
    pending_probe: bool = False
    # every measured candidate's speeds by batch size (the tuner's online check compares the
    # served speed with them)
    figures: Mapping[Candidate, Mapping[int, float]] = field(default_factory=dict)


FALLBACK = Candidate("float32", compile_decode=False)
START_FORMATS = ("int8", "float32")  # the unmeasured first choice: the first whose gate passes


def unmeasured_choice(
    gates: Mapping[str, Gate], overrides: Overrides | None = None, int8_fast: bool = True
) -> Choice:
    """The configuration a worker serves before any probe (a machine never seen): eager, so
    nothing compiles in the foreground, and int8 where its gate passes and its kernel runs its
    fast loop here (`int8_fast`: kernels/int8_linear.py's `fast_loop_expected`; then measured
    faster than float32 eager on every machine and model so far, docs/BENCHMARKS.md), else
    float32. The flags win. `pending_probe` is set: the tuner measures and may move away."""
    over = overrides or Overrides()
    formats = START_FORMATS if int8_fast else tuple(w for w in START_FORMATS if w != "int8")
    weights = over.weights or next(
        (w for w in formats if gates.get(w, Gate(False, "")).passed), FALLBACK.weights
    )
    candidate = Candidate(weights, bool(over.compile_decode))
    slow_int8 = "" if int8_fast or over.weights else "; int8's kernel: no vector loop on this CPU"
    reason = (
        f"{candidate.label}: chosen without measuring (no probe of this machine yet; it runs in "
        f"the background and the worker moves to its choice{slow_int8}; flags: "
        f"{over.describe()})"
    )
    return Choice(candidate, reason, (), pending_probe=True)


@dataclass(frozen=True, slots=True)
class ConfigReport:
    """What `/readyz`, `tolk status` and the info metric show of the served configuration
    (written by the tuner, read from any thread: replaced whole, never changed)."""

    in_use: str  # the candidate's label, e.g. "int8+compiled"
    reason: str  # why it was chosen
    candidates: tuple[str, ...] = ()  # one line per candidate (speeds, gate, why not)
    probing: bool = False  # a probe runs in the background now
    switches: int = 0  # configuration changes since the worker started
    last_switch: str = ""  # from -> to, and why
    served_vs_probe: float | None = None  # served decode speed / the probe's figure, last check
    served_normal: float = 1.0  # the ratio this workload shows at its best (tuner: `normal`)

    def as_json(self) -> dict[str, Any]:
        return {
            "in_use": self.in_use,
            "reason": self.reason,
            "candidates": list(self.candidates),
            "probing": self.probing,
            "switches": self.switches,
            "last_switch": self.last_switch,
            "served_vs_probe": self.served_vs_probe,
            "served_normal": self.served_normal,
        }


def gate_for(model: str, weights: str, table: Mapping[str, Any] | None = None) -> Gate:
    """The recorded gate of `weights` for `model` (`quality_gate.json` unless `table`)."""
    if weights == "float32":
        return Gate(True, "the reference")
    data = load_gate_table() if table is None else table
    entry = data.get("models", {}).get(model, {}).get(weights)
    if entry is None:
        return Gate(False, "no recorded gate (bench/quality_gate.py)")
    if entry.get("error"):
        return Gate(False, f"unavailable: {entry['error']}")
    deltas = entry.get("delta_chrf", {})
    if not deltas:
        return Gate(False, "recorded without chrF deltas")
    worst = min(float(d) for d in deltas.values())
    detail = ", ".join(f"{pair} {float(d):+.2f}" for pair, d in sorted(deltas.items()))
    limit = float(data.get("max_chrf_drop", GATE_CHRF))
    return Gate(worst >= -limit, f"chrF vs float32 {detail} (limit -{limit:g})")


def load_gate_table(path: Path = GATE_FILE) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}


def choose(
    measurements: Sequence[Measurement],
    gates: Mapping[str, Gate],
    overrides: Overrides | None = None,
) -> Choice:
    """The fastest measured candidate that passes its format's gate and the flags."""
    over = overrides or Overrides()
    eligible: list[Measurement] = []
    lines = []
    for m in measurements:
        c = m.candidate
        gate = gates.get(c.weights, Gate(False, "no gate"))
        note = f" ({m.note})" if m.note else ""
        speeds = (
            f"b1 {m.tok_s_b1:.1f} tok/s, b8 {m.tok_s_b8:.1f} tok/s{note}"
            if m.score is not None
            else f"not measured{note}"
        )
        gate_text = f"gate {'pass' if gate.passed else 'FAIL'}: {gate.detail}"
        asked = over.weights == c.weights  # an explicit format is the operator's call
        excluded = (
            "excluded by the flags"
            if not over.allows(c)
            else "fails the gate"
            if not gate.passed and not asked
            else "no speed"
            if m.score is None
            else ""
        )
        if not gate.passed and asked and not excluded:
            gate_text += " (asked for by the flags)"
        if not excluded:
            eligible.append(m)
        lines.append(f"{c.label}: {speeds}; {gate_text}{f'; {excluded}' if excluded else ''}")
    if not eligible:
        fallback = FALLBACK
        if over.weights is not None or over.compile_decode is not None:
            fallback = Candidate(
                over.weights or FALLBACK.weights, bool(over.compile_decode or False)
            )
        return Choice(
            fallback,
            f"no measured candidate passes the gate and the flags ({over.describe()}): "
            f"{fallback.label}",
            tuple(lines),
        )
    best = max(eligible, key=lambda m: m.score or 0.0)
    figures = {m.candidate: m.tok_s_by_batch() for m in eligible}
    runner_up = [m for m in eligible if m is not best]
    versus = ""
    if runner_up:
        second = max(runner_up, key=lambda m: m.score or 0.0)
        versus = f", {(best.score or 0) / (second.score or 1):.2f}x {second.candidate.label}"
    reason = (
        f"{best.candidate.label}: fastest that passes the quality gate or that the flags name "
        f"(sqrt(b1*b8) {best.score:.1f} tok/s{versus}; flags: {over.describe()})"
    )
    return Choice(best.candidate, reason, tuple(lines), best.tok_s_by_batch(), figures=figures)
