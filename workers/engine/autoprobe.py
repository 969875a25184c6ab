"""The auto configuration's probe: decode speed of each candidate on this machine.

`auto_config(model, cache_root, overrides)` returns the `Choice` of `workers/engine/autoconfig.py`
and logs it (one line per candidate, then the choice and why). The measurements come from a keyed
record on disk (`disk_cache.read_record`), keyed by the CPU (model name, flags, core count),
the model file's hash, torch's and tolk's versions, the C++ kernels' sources and the intra-op
thread count; without one (the first start on a machine, or after an upgrade) the probe
measures (workers/engine/probe_runs.py) and writes it. What it measures, and why (issue #47:
a probe that measured each candidate once, compiled only the eager winner, and kept a busy
minute's ranking for good left a machine on a configuration 2.6x slower in service than one
it never tried):

- **every candidate it may serve**: each weight format whose recorded quality gate passes (or
  that the flags name), eager and compiled (unless the flags rule compiling out). Compiling
  does not speed every format alike (Gemma 3 270M on an AMD EPYC: float32 compiled slower than
  eager, int8 compiled the fastest of all), so no format's compiled figure is inferred. The
  eager and compiled engines of one format share the loaded weights; the compiled graphs land
  in inductor's on-disk cache, where the worker's own engine finds them;
- **interleaved and repeated**: after one warm-up run each, `ROUNDS` rounds run every candidate
  once at batch 1 and 8 (the order rotated each round), and each figure is the **median** of
  its rounds: a burst of other work lands on one round of every candidate, not on all rounds of
  one. Batch 1 and 8 rank the candidates (`choose`); batch 16 and 32, measured once after the
  rounds, pick the running batch's cap (workers/engine/batch_cap.py);
- **the host's load recorded**: the share of the machine's CPU time other processes took while
  it measured (`/proc/stat` less this process's own time, steal included). Above `BUSY_SHARE`
  the record is written but marked busy: it serves until the tuner measures again on a quieter
  host (workers/engine/tuner.py), instead of deciding the machine's speed for good.

- **no compile it can show hopeless**: a format whose eager figure, times the largest
  compiled-over-eager speed-up any kept probe measured (`compile_gain_bound`: at least
  `COMPILE_GAIN_FLOOR`, with `GAIN_MARGIN` for one set of rounds' noise), stays below the best
  estimate (a compiled format's: its eager figure times its measured speed-up) is not compiled
  (workers/engine/probe_runs.py). Every probe that measured a format both ways adds its
  speed-up to `probes/compile-gains.json` (`keep_compile_gains`), so the bound follows what
  this machine has shown.

A format the gate fails is not measured (its line says so). The worker does not wait for this
on a machine it has never seen: `resolve_worker_config(background=True)` returns the unmeasured
choice (`unmeasured_choice`) and the tuner runs the probe beside the serving engine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from kernels import cpu_ops
from kernels.int8_linear import fast_loop_expected
from workers.engine.autoconfig import (
    FORMATS,
    Candidate,
    Choice,
    Gate,
    Measurement,
    Overrides,
    choose,
    gate_for,
    unmeasured_choice,
)
from workers.engine.disk_cache import (
    cpu_fingerprint,
    read_record,
    record_key,
    tolk_version,
    write_record,
)
from workers.engine.probe_runs import (
    PRUNED,
    ProbeRecord,
    compile_speedup,
    measure_candidates,
)

log = logging.getLogger(__name__)

PROBE_VERSION = 3  # bump when what the probe measures changes (3: compiled too, rounds)
# The largest compiled-over-eager speed-up of sqrt(b1 * b8) in the probes docs/BENCHMARKS.md
# keeps is int8 on the 2-vCPU Zen 3: 2.13x (a first start, 2026-12-07: b1 11.4 -> 29.7, b8 45.0
# -> 78.7 tok/s; 2.05x and 1.74x in earlier ones); float32 and bfloat16 gained 0.8-1.5x. The floor
# stands above it; kept gains raise the bound, never lower it.
COMPILE_GAIN_FLOOR = 2.2
GAIN_MARGIN = 1.25  # the figures that decide a skip are one set of rounds, not the record's
GAINS_KEPT = 200  # the newest entries of probes/compile-gains.json


def auto_config(
    model: str,
    cache_root: Path,
    overrides: Overrides | None = None,
    model_name: str = "",
    *,
    force: bool = False,
) -> Choice:
    """Measure (or read, unless `force`) the candidates' speeds, apply the gates and the flags,
    log the choice. A busy record is used (and says so) but `pending_probe` is set."""
    over = overrides or Overrides()
    gates = model_gates(model, model_name)
    record = None if force else read_probe(model, cache_root, gates, over)
    if record is None:
        record = run_probe(model, cache_root, gates, over)
    return choice_from(record, gates, over)


def model_gates(model: str, model_name: str = "") -> dict[str, Gate]:
    name = model_name or Path(model).stem
    return {w: gate_for(name, w) for w in FORMATS}


def choice_from(record: ProbeRecord, gates: dict[str, Gate], over: Overrides) -> Choice:
    """The choice a probe record makes (logged); pending another probe when it was busy."""
    choice = choose(record.measurements, gates, over)
    for line in choice.lines:
        log.info("auto config candidate %s", line)
    log.info("auto config chose %s; %s", choice.reason, record.describe())
    if record.busy:
        choice = replace(choice, pending_probe=True, reason=f"{choice.reason}; {record.describe()}")
    return choice


def probe_key(model: str) -> str:
    import torch

    from workers.engine.loader import file_hash, resolve_source

    _, path = resolve_source(model)
    source = file_hash(path) if path.is_file() else str(path.resolve())
    return record_key(
        probe=PROBE_VERSION,
        cpu=cpu_fingerprint(),
        model=source,
        tolk=tolk_version(),
        kernels=cpu_ops.sources_digest(),  # a faster kernel can change the ranking
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )


def record_path(model: str, cache_root: Path) -> Path:
    name = Path(model).name  # a preset's name may hold dots ("qwen2.5-coder-1.5b")
    return cache_root / "probes" / f"auto-{name.removesuffix('.gguf')}.json"


def read_probe(
    model: str, cache_root: Path, gates: dict[str, Gate], overrides: Overrides
) -> ProbeRecord | None:
    """The stored record when its key matches and it measured what these gates and flags can
    choose from; else None."""
    path = record_path(model, cache_root)
    stored = read_record(path, probe_key(model))
    if not isinstance(stored, dict):
        return None
    record = ProbeRecord(
        tuple(_from_json(x) for x in stored.get("measurements", ())),
        float(stored.get("others_share", 0.0)),
        float(stored.get("measured_at", 0.0)),
    )
    if not _covers(list(record.measurements), gates, overrides):
        return None
    log.info("auto config: speeds read from %s (probe cached)", path)
    return record


def run_probe(
    model: str, cache_root: Path, gates: dict[str, Gate], overrides: Overrides
) -> ProbeRecord:
    """Measure every candidate (module notes) and store the record."""
    path = record_path(model, cache_root)
    log.info(
        "auto config: probing decode speed on this machine (first start with this CPU, model "
        "and version, or measured again; the result is kept in %s)",
        path,
    )
    key = probe_key(model)
    wanted = _wanted(gates, overrides)
    skipped = []
    for weights in FORMATS:  # the formats it will not measure, and why
        if not any(c.weights == weights for c in wanted):
            asked_other = overrides.weights not in (None, weights)
            why = "another format asked for" if asked_other else "gate fails"
            skipped.append(Measurement(Candidate(weights, False), None, None, why))
    bound = compile_gain_bound(cache_root)
    record = measure_candidates(model, wanted, cache_root, skipped, compile_gain=bound)
    keep_compile_gains(cache_root, record, model)
    value = {
        "measurements": [_to_json(m) for m in record.measurements],
        "others_share": record.others_share,
        "measured_at": record.measured_at,
    }
    write_record(path, key, value)
    if record.busy:
        log.warning("auto config: the probe ran on a busy host: %s", record.describe())
    return record


def gains_path(cache_root: Path) -> Path:
    return cache_root / "probes" / "compile-gains.json"


def compile_gain_bound(cache_root: Path) -> float:
    """The most compiling may speed a format up, as far as anything kept shows, with a margin:
    max(`COMPILE_GAIN_FLOOR`, every kept gain) x `GAIN_MARGIN`."""
    kept = [float(g["gain"]) for g in _read_gains(cache_root)]
    return max([COMPILE_GAIN_FLOOR, *kept]) * GAIN_MARGIN


def keep_compile_gains(cache_root: Path, record: ProbeRecord, model: str) -> None:
    """Add the record's compiled-over-eager speed-ups (formats measured both ways) to the kept
    gains; a busy record's too: a gain a burst inflated only makes the bound more cautious."""
    by_candidate = {m.candidate: m for m in record.measurements}
    gains = {
        c.weights: compile_speedup(m, by_candidate.get(Candidate(c.weights, False)))
        for c, m in by_candidate.items()
        if c.compile_decode
    }
    new = [
        {
            "cpu": cpu_fingerprint(),
            "model": Path(model).name,
            "weights": weights,
            "gain": round(gain, 4),
            "at": record.measured_at,
        }  # fmt: skip
        for weights, gain in gains.items()
        if gain is not None
    ]
    if not new:
        return
    path = gains_path(cache_root)
    kept = (_read_gains(cache_root) + new)[-GAINS_KEPT:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gains": kept}, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: the floor still bounds the next probe
        log.warning("auto config: cannot keep compile gains in %s: %s", path, exc)


def _read_gains(cache_root: Path) -> list[dict[str, Any]]:
    try:
        gains = json.loads(gains_path(cache_root).read_text()).get("gains", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [g for g in gains if isinstance(g, dict) and isinstance(g.get("gain"), int | float)]


def _covers(got: list[Measurement], gates: dict[str, Gate], over: Overrides) -> bool:
    """Whether a stored probe measured everything these gates and flags can choose from: every
    eligible format eagerly, and compiled too unless the flags rule it out (a candidate that
    could not run counts as measured: it would fail again; so does a compile the bound skipped)."""
    tried = {
        m.candidate
        for m in got
        if m.score is not None or m.note.startswith(("unavailable", "failed", PRUNED))
    }
    return all(c in tried for c in _wanted(gates, over))


def _wanted(gates: dict[str, Gate], over: Overrides) -> list[Candidate]:
    """The candidates a probe measures for these gates and flags, format by format."""
    formats = [
        w for w in FORMATS if over.weights in (None, w) and (gates[w].passed or over.weights)
    ]
    compiled = (False, True) if over.compile_decode is None else (over.compile_decode,)
    return [Candidate(w, c) for w in formats for c in compiled]


def _to_json(m: Measurement) -> dict[str, Any]:
    return {
        "weights": m.candidate.weights,
        "compile_decode": m.candidate.compile_decode,
        "tok_s_b1": m.tok_s_b1,
        "tok_s_b8": m.tok_s_b8,
        "larger": [list(pair) for pair in m.larger],
        "note": m.note,
    }


def _from_json(d: dict[str, Any]) -> Measurement:
    return Measurement(
        Candidate(str(d["weights"]), bool(d["compile_decode"])),
        d.get("tok_s_b1"),
        d.get("tok_s_b8"),
        str(d.get("note", "")),
        tuple((int(b), float(s)) for b, s in d.get("larger", ())),
    )


QUANTIZE_FLAGS = {
    "none": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "int8": "int8",
    "int4": "int4",
}


def resolve_worker_config(
    model: str,
    *,
    device: str,
    quantize: str | None,
    compile_decode: bool | None,
    auto: bool,
    cache_root: Path,
    background: bool = False,
) -> Choice:
    """The worker's weights and compile flag: both flags given -> them; else on the CPU with
    `auto` -> the probe's choice within the flags (with its speeds per batch size, for the
    batch cap); else the flags over eager float32 (no speeds).

    `background`: without a stored probe, do not measure now: return the unmeasured choice
    (`pending_probe` set) for the tuner to probe beside the serving engine."""
    if quantize is not None and quantize not in QUANTIZE_FLAGS:
        raise ValueError(f"--quantize {quantize!r}: one of {', '.join(QUANTIZE_FLAGS)}")
    weights = QUANTIZE_FLAGS[quantize] if quantize is not None else None
    if auto and device == "cpu" and (weights is None or compile_decode is None):
        over = Overrides(weights, compile_decode)
        if not background:
            return auto_config(model, cache_root, over, model)
        gates = model_gates(model, model)
        record = read_probe(model, cache_root, gates, over)
        if record is not None:
            return choice_from(record, gates, over)
        choice = unmeasured_choice(gates, over, int8_fast=fast_loop_expected())
        log.info("auto config chose %s", choice.reason)
        return choice
    chosen = Candidate(weights or "float32", bool(compile_decode))
    log.info("worker config %s (from the flags%s)", chosen.label, "" if auto else ", --no-auto")
    return Choice(chosen, "from the flags", ())
