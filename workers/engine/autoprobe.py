"""The auto configuration's start-up probe: decode speed of each candidate on this machine.

`auto_config(model, cache_root, overrides)` returns the `Choice` of `workers/engine/autoconfig.py`
and logs it (one line per candidate, then the choice and why). The measurements come from a keyed
record on disk (`disk_cache.read_record`), keyed by the CPU (model name, flags, core count),
the model file's hash, torch's and tolk's versions, the C++ kernels' sources and the intra-op
thread count; without one (the first start on a machine, or after an upgrade) the probe
measures and writes it:

- each weight format whose recorded quality gate passes (or that the flags name) is loaded
  (from the dequantized checkpoint cache) and run eagerly: `DECODE_STEPS` greedy decode steps
  of a fixed prompt at batch 1, 8, 16 and 32, the best of `ROUNDS`; decode-only steps timed from
  the engine's step trace, as bench/engine.py does. Batch 1 and 8 rank the candidates; the
  chosen one's speeds at 8, 16 and 32 pick the running batch's cap (workers/engine/batch_cap.py);
- compiled decode is measured for the fastest eager format only (each compiled format costs a
  compilation, ~1-3 min the first time on two cores): compiling speeds every format up alike
  (fewer dispatches per op), so it does not change which format is fastest, only by how much.
  Its graphs land in inductor's on-disk cache, where the worker's own engine finds them.
A format the gate fails is not measured (its line says so). The probe costs seconds per
eager format (four batch sizes) plus one compilation, once per machine and model (Gemma 3 270M
on 2 AMD EPYC vCPUs: 14-49 s per format, 204 s with the compilation).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

from kernels import cpu_ops
from workers.engine.autoconfig import (
    FORMATS,
    Candidate,
    Choice,
    Gate,
    Measurement,
    Overrides,
    choose,
    gate_for,
)
from workers.engine.disk_cache import (
    cpu_fingerprint,
    read_record,
    record_key,
    tolk_version,
    write_record,
)

log = logging.getLogger(__name__)

PROBE_VERSION = 2  # bump when what the probe measures changes (2: batch 16 and 32)
DECODE_STEPS = 12  # new tokens per probe run
ROUNDS = 2  # timed runs per batch size (after one warm-up run); the best counts
BATCHES = (1, 8, 16, 32)  # 1 and 8 rank the candidates; 8-32 pick the batch cap
PROBE_TEXT = "Your order has shipped and should arrive within three business days."


def auto_config(
    model: str,
    cache_root: Path,
    overrides: Overrides | None = None,
    model_name: str = "",
) -> Choice:
    """Measure (or read) the candidates' speeds, apply the gates and the flags, log the choice."""
    over = overrides or Overrides()
    name = model_name or Path(model).stem
    gates = {w: gate_for(name, w) for w in FORMATS}
    measurements = probe(model, cache_root, gates, over)
    choice = choose(measurements, gates, over)
    for line in choice.lines:
        log.info("auto config candidate %s", line)
    log.info("auto config chose %s", choice.reason)
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


def probe(
    model: str, cache_root: Path, gates: dict[str, Gate], overrides: Overrides
) -> list[Measurement]:
    """Every candidate's measurement: from the record when its key matches, else measured."""
    key = probe_key(model)
    path = cache_root / "probes" / f"auto-{Path(model).stem}.json"
    stored = read_record(path, key)
    if stored is not None:
        got = [_from_json(x) for x in stored]
        if _covers(got, gates, overrides):
            log.info("auto config: speeds read from %s (probe cached)", path)
            return got
    log.info(
        "auto config: probing decode speed on this machine (first start with this CPU, model "
        "and version; the result is kept in %s)",
        path,
    )
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus:
        log.warning(
            "auto config: the machine is busy (load %.1f on %d CPUs): the probe measures that "
            "too; its ranking is kept in %s until the key changes (delete it to measure again)",
            load, cpus, path,
        )  # fmt: skip
    measured = _measure_all(model, gates, overrides, cache_root)
    write_record(path, key, [_to_json(m) for m in measured])
    return measured


def _covers(got: list[Measurement], gates: dict[str, Gate], over: Overrides) -> bool:
    """Whether a stored probe measured everything these gates and flags can choose from: every
    eligible format eagerly, and compiled decode unless the flags rule it out (a format that
    could not run counts as measured: it would fail again)."""
    tried = {
        m.candidate
        for m in got
        if m.score is not None or m.note.startswith(("unavailable", "failed"))
    }
    wanted = [w for w in FORMATS if over.weights in (None, w) and (gates[w].passed or over.weights)]
    if not all(Candidate(w, False) in tried for w in wanted):
        return False
    return over.compile_decode is False or any(c.compile_decode for c in tried)


def _measure_all(
    model: str, gates: dict[str, Gate], over: Overrides, root: Path
) -> list[Measurement]:
    out: list[Measurement] = []
    for weights in FORMATS:
        eager = Candidate(weights, compile_decode=False)
        if over.weights not in (None, weights):
            out.append(Measurement(eager, None, None, "another format asked for"))
            continue
        if not gates[weights].passed and over.weights is None:
            out.append(Measurement(eager, None, None, "gate fails"))
            continue
        out.append(_measure(model, eager, root))
    eager_done = [m for m in out if m.score is not None]
    if over.compile_decode is not False and eager_done:
        best = max(eager_done, key=lambda m: m.score or 0.0)
        out.append(_measure(model, Candidate(best.candidate.weights, compile_decode=True), root))
    if over.compile_decode is True and not eager_done:
        out.append(Measurement(Candidate("float32", True), None, None, "no format measured"))
    return out


def _measure(model: str, candidate: Candidate, root: Path) -> Measurement:
    """Load `model` as `candidate`, time decode-only steps at each batch size."""
    import torch

    from workers.engine.engine import Engine, EngineConfig

    t0 = time.perf_counter()
    config = EngineConfig(
        model=model,
        dtype=candidate.dtype,
        quantize=candidate.quantize,
        compile_decode=candidate.compile_decode,
        # the pool and batch cap of the worker's own engine (EngineConfig's defaults): the
        # compiled graphs are specialized to the KV pools' sizes, so a probe with smaller pools
        # compiled graphs the worker could not reuse and its first start compiled twice
        # (~5 min each on two cores, 2026-12-02)
        cache_dir=str(root),
    )
    try:
        engine = Engine.from_config(config)
    except (ImportError, NotImplementedError, RuntimeError, ValueError) as exc:
        log.warning("auto config: %s unavailable: %s", candidate.label, exc)
        return Measurement(candidate, None, None, f"unavailable: {type(exc).__name__}")
    speeds: dict[int, float] = {}
    try:
        with torch.inference_mode():
            for batch in BATCHES:
                runs = [_decode_tok_s(engine, batch) for _ in range(ROUNDS + 1)][1:]
                speeds[batch] = max(runs)
    except RuntimeError as exc:
        log.warning("auto config: %s failed to decode: %s", candidate.label, exc)
        return Measurement(candidate, None, None, f"failed: {type(exc).__name__}")
    finally:
        del engine
        gc.collect()
    log.info(
        "auto config: measured %s in %.1fs: %s",
        candidate.label,
        time.perf_counter() - t0,
        ", ".join(f"b{b} {s:.1f} tok/s" for b, s in speeds.items()),
    )
    larger = tuple((b, speeds[b]) for b in BATCHES if b > 8)
    return Measurement(candidate, speeds[1], speeds[8], larger=larger)


def _decode_tok_s(engine: Any, batch: int) -> float:
    """Decode tokens/s over the steps in which all `batch` sequences decoded."""
    reqs = [
        engine.translation_request(
            PROBE_TEXT, "en", "de", max_new_tokens=DECODE_STEPS, ignore_eos=True
        )
        for _ in range(batch)
    ]
    engine.step_trace = []
    engine.generate(reqs)
    trace, engine.step_trace = engine.step_trace, None
    full = [s for s in trace if s.kind == "decode" and s.num_seqs == batch]
    seconds = sum(s.seconds for s in full)
    return sum(s.num_seqs for s in full) / seconds if seconds > 0 else 0.0


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
) -> Choice:
    """The worker's weights and compile flag: both flags given -> them; else on the CPU with
    `auto` -> the probe's choice within the flags (with its speeds per batch size, for the
    batch cap); else the flags over eager float32 (no speeds)."""
    if quantize is not None and quantize not in QUANTIZE_FLAGS:
        raise ValueError(f"--quantize {quantize!r}: one of {', '.join(QUANTIZE_FLAGS)}")
    weights = QUANTIZE_FLAGS[quantize] if quantize is not None else None
    if auto and device == "cpu" and (weights is None or compile_decode is None):
        return auto_config(model, cache_root, Overrides(weights, compile_decode), model)
    chosen = Candidate(weights or "float32", bool(compile_decode))
    log.info("worker config %s (from the flags%s)", chosen.label, "" if auto else ", --no-auto")
    return Choice(chosen, "from the flags", ())
