"""The probe's measurements: every candidate's decode speed, interleaved and repeated.

`measure_candidates(model, candidates, root)` builds one engine per candidate (the eager and
compiled engines of a weight format share its loaded weights; compiled graphs compile while they
are built and land in inductor's on-disk cache, where the worker's own engine finds them), then
times greedy decode steps of a fixed translation prompt:

- one warm-up run per candidate (first-call allocations, the graphs' first run);
- `ROUNDS` rounds, each running every candidate once at batch 1 and 8, the order rotated each
  round; each figure is the **median** of its rounds, so a burst of other work lands on one
  round of every candidate rather than on every round of one;
- batch 16 and 32 once after the rounds (they pick the running batch's cap, not the ranking).

Every candidate's engine is held at once when their estimated memory fits (`groups_that_fit`: a
1.5B model's float32 engines alone take ~12 GB); otherwise the formats are measured one after
the other, each format's eager and compiled engines still interleaved, and the log says so.

**Compiles it can show are not worth it are skipped** (`compile_gain`, given by autoprobe.py:
the largest compiled-over-eager speed-up of any kept probe, with a margin). Compiling a format
takes ~100 s on a Xeon and ~300 s on a 2-vCPU Zen 3, most of a first start's probe. So the
eager engines are measured first, together; then the formats are compiled best eager figure
first, each compiled engine measured beside its eager one. Every comparison is in the eager
pass's units: a compiled format's estimate is its eager figure times the speed-up its pair
showed (two engines timed side by side), because absolute figures minutes apart are not
comparable on a shared host (a first start on the Zen 3: int8 eager 33.5 tok/s in the eager
pass, 18.0 in its pair seven minutes later). A format whose eager figure times `compile_gain`
stays below the best estimate is not compiled: no speed-up ever kept could make it the winner
(its line says so, `PRUNED`). The held engines are then measured once more, interleaved, for
the record (one group), or each format's pair is its record (format by format). Held together,
a format whose compile was skipped lets its eager engine go at once (its eager figure is below
the best estimate too): it is not held through the compiles nor timed again, and its record is
its eager-pass figure scaled to the final rounds' pace (`_to_final_pace`); and the eager pass
skips the cap's batch sizes, which the final rounds measure for every engine still held. On the
Zen 3 that took ~70 of the final rounds' 85 s (bfloat16 at batch 32: ~24 tok/s without a native
bfloat16 matmul) and ~35 s of the eager pass's 90.

Only decode-only steps count (the engine's step trace), as bench/engine.py measures them. Around
it all, the share of the machine's CPU time other processes took (`/proc/stat` less this
process's own time, steal included; the load average where /proc is missing) is recorded: the
record it makes (`ProbeRecord`) is "busy" above `BUSY_SHARE`, and a busy record is measured again
later (workers/engine/tuner.py) instead of kept for good. The record's keying, storage and the
choice it makes are workers/engine/autoprobe.py's.

One concern: timing the candidates. The staged path (eager pass, pruned compiles, final rounds)
and the plain one share the builds, the timed rounds and the load sampling, and split apart
they would pass those around between files for no reader's gain.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engine.autoconfig import Candidate, Measurement
from workers.engine.heap import trim_heap

log = logging.getLogger(__name__)

DECODE_STEPS = 12  # new tokens per probe run
ROUNDS = 3  # interleaved timed rounds (after one warm-up run each); the median counts
RANK_BATCHES = (1, 8)  # rank the candidates (autoconfig.choose)
CAP_BATCHES = (16, 32)  # measured once after the rounds: the batch cap (batch_cap.py)
BUSY_SHARE = 0.25  # other processes' share of the CPU above which a probe counts as busy
PROBE_TEXT = "Your order has shipped and should arrive within three business days."


@dataclass(frozen=True, slots=True)
class ProbeRecord:
    """One probe's measurements and the host's load while they were taken."""

    measurements: tuple[Measurement, ...]
    others_share: float  # share of the machine's CPU time other processes took (0..1)
    measured_at: float  # unix time

    @property
    def busy(self) -> bool:
        return self.others_share > BUSY_SHARE

    def describe(self) -> str:
        load = f"other processes took {self.others_share:.0%} of the CPU while it measured"
        return load + (" (busy: measured again later)" if self.busy else "")


def measure_candidates(
    model: str,
    wanted: Sequence[Candidate],
    root: Path,
    skipped: Sequence[Measurement] = (),
    compile_gain: float | None = None,
) -> ProbeRecord:
    """Each of `wanted` measured (module notes); `skipped`: the lines of those not measured.
    All candidates are held at once when they fit in memory (`groups_that_fit`), else format
    by format (each format's eager and compiled engines still interleaved). `compile_gain`:
    the bound on compiling's speed-up that lets it skip hopeless compiles (None: compile all)."""
    out: list[Measurement] = list(skipped)
    if not wanted:
        return ProbeRecord(tuple(out), 0.0, time.time())
    groups = groups_that_fit(wanted, _checkpoint_bytes(model, root), _available_bytes())
    if len(groups) > 1:
        log.info("auto config: measuring format by format (all at once would not fit in memory)")
    paired = {c.weights for c in wanted if c.compile_decode} & {
        c.weights for c in wanted if not c.compile_decode
    }
    if compile_gain is not None and len(paired) > 1:
        return _measure_pruning_compiles(model, wanted, root, out, compile_gain, len(groups) == 1)
    others: list[float] = []
    for group in groups:
        engines: dict[Candidate, Any] = {}
        loaded: dict[str, Any] = {}  # a format's eager and compiled engines share its weights
        for c in group:
            got = _build(model, c, root, loaded.get(c.weights))
            if isinstance(got, Measurement):
                out.append(got)
            else:
                engines[c] = got
                loaded[c.weights] = got.loaded
        # the load is sampled around the timed runs only: building compiles in inductor's
        # worker processes, which /proc counts as other processes' time
        before = _cpu_sample()
        try:
            out.extend(_measure_rounds(engines))
        finally:
            engines.clear()
            loaded.clear()
            trim_heap()  # the candidates' weights back to the system (heap.py)
        others.append(_others_share(before, _cpu_sample()))
    return ProbeRecord(tuple(out), max(others, default=0.0), time.time())


PRUNED = "not compiled"  # a Measurement note: the bound showed compiling could not win


def _measure_pruning_compiles(
    model: str,
    wanted: Sequence[Candidate],
    root: Path,
    out: list[Measurement],
    compile_gain: float,
    together: bool,
) -> ProbeRecord:
    """Eager engines first, then compiles best eager figure first, each skipped when its eager
    figure times `compile_gain` stays below the best estimate so far (module notes).
    `together`: every engine held at once and measured interleaved at the end; else format by
    format."""
    figures: dict[Candidate, Measurement] = {}  # each candidate's latest measurement
    engines: dict[Candidate, Any] = {}
    loaded: dict[str, Any] = {}  # a format's eager and compiled engines share its weights
    others: list[float] = []

    hopeless: dict[Candidate, Measurement] = {}  # eager engines let go, their eager-pass figure

    def timed(group: dict[Candidate, Any], caps: bool = True) -> None:
        before = _cpu_sample()  # around the timed runs only (building compiles in subprocesses)
        figures.update({m.candidate: m for m in _measure_rounds(group, caps)})
        others.append(_others_share(before, _cpu_sample()))

    def drop_all() -> None:
        engines.clear()
        loaded.clear()
        trim_heap()  # the candidates' weights back to the system (heap.py)

    try:
        for c in (c for c in wanted if not c.compile_decode):
            got = _build(model, c, root, None)
            if isinstance(got, Measurement):
                figures[c] = got
                continue
            engines[c], loaded[c.weights] = got, got.loaded
            if not together:
                timed({c: got})
                drop_all()
        if together:  # the cap's batch sizes on the final rounds, for the engines still held
            timed(dict(engines), caps=False)

        # the eager pass's figures, and each format's best in those units (module notes)
        eager_pass = {c.weights: m.score for c, m in figures.items() if m.score}
        estimate = dict(eager_pass)
        for c in sorted(
            (c for c in wanted if c.compile_decode),
            key=lambda c: eager_pass.get(c.weights, 0.0),
            reverse=True,
        ):
            eager = Candidate(c.weights, False)
            best = max(estimate.values(), default=0.0)
            if c.weights in eager_pass and eager_pass[c.weights] * compile_gain < best:
                figures[c] = Measurement(
                    c, None, None, f"{PRUNED}: eager {eager_pass[c.weights]:.1f} x "
                    f"{compile_gain:.2f} < {best:.1f} tok/s, the best estimate"
                )  # fmt: skip
                log.info("auto config: %s %s", c.label, figures[c].note)
                if together and eager in engines and compile_gain >= 1.0:
                    # its eager engine cannot win either (eager <= eager x bound < best): let
                    # it go now rather than hold it through the compiles and re-measure it
                    hopeless[eager] = figures[eager]
                    del engines[eager], loaded[c.weights]
                    trim_heap()
                continue
            got = _build(model, c, root, loaded.get(c.weights))
            if isinstance(got, Measurement):
                figures[c] = got
                continue
            pair = {c: got}
            if eager in engines:
                pair[eager] = engines[eager]
            elif c.weights in eager_pass:  # format by format: its eager engine again
                again = _build(model, eager, root, got.loaded)
                if not isinstance(again, Measurement):
                    pair[eager] = again
            engines.update(pair)
            timed(pair)
            gain = compile_speedup(figures.get(c), figures.get(eager))
            if c.weights in eager_pass and gain is not None:
                estimate[c.weights] = eager_pass[c.weights] * max(1.0, gain)
            elif figures[c].score:  # no eager figure to scale: its own, as measured
                estimate[c.weights] = max(estimate.get(c.weights, 0.0), figures[c].score or 0.0)
            if not together:
                drop_all()
        if together and engines:
            timed(dict(engines))  # the record's figures: every held engine, interleaved
            figures.update(_to_final_pace(hopeless, figures, eager_pass))
    finally:
        drop_all()
    out.extend(figures[c] for c in wanted if c in figures)
    return ProbeRecord(tuple(out), max(others, default=0.0), time.time())


def _to_final_pace(
    hopeless: dict[Candidate, Measurement],
    figures: dict[Candidate, Measurement],
    eager_pass: dict[str, float],
) -> dict[Candidate, Measurement]:
    """The eager-pass figures of engines let go before the final rounds, scaled to those
    rounds' pace: by the median change of the eager engines measured in both (the host drifts
    between them; 1.0 when none was), so the record's figures stay comparable."""
    changes = [
        m.score / eager_pass[c.weights]
        for c, m in figures.items()
        if not c.compile_decode and c not in hopeless and m.score and eager_pass.get(c.weights)
    ]
    pace = statistics.median(changes) if changes else 1.0
    note = f"eager pass only, x{pace:.2f} to the final rounds' pace: no compile could win"
    return {
        c: Measurement(
            c,
            m.tok_s_b1 * pace if m.tok_s_b1 else m.tok_s_b1,
            m.tok_s_b8 * pace if m.tok_s_b8 else m.tok_s_b8,
            note,
        )
        for c, m in hopeless.items()
    }


def compile_speedup(compiled: Measurement | None, eager: Measurement | None) -> float | None:
    """Compiled over eager sqrt(b1 x b8), both from one timed set; None without both."""
    if compiled is None or eager is None or not compiled.score or not eager.score:
        return None
    return compiled.score / eager.score


# resident bytes of a format's engine per byte of the float32 checkpoint (the weights as served,
# packed copies included), measured roughly on Gemma 3 270M; loading a format reads the float32
# checkpoint first, so building one needs that much more for a moment
RESIDENT_PER_CHECKPOINT_BYTE = {"float32": 2.0, "bfloat16": 1.0, "int8": 0.6, "int4": 0.5}
MEMORY_SHARE = 0.6  # of the memory available when the probe starts


def groups_that_fit(
    wanted: Sequence[Candidate], checkpoint_bytes: int, available_bytes: int | None
) -> list[list[Candidate]]:
    """`wanted` in one group when every format's engines fit in `MEMORY_SHARE` of the memory
    available (plus one checkpoint's worth while a format loads), else one group per format."""
    formats = list(dict.fromkeys(c.weights for c in wanted))
    need = checkpoint_bytes * (1 + sum(RESIDENT_PER_CHECKPOINT_BYTE[w] for w in formats))
    if available_bytes is None or not checkpoint_bytes or need <= MEMORY_SHARE * available_bytes:
        return [list(wanted)]
    return [[c for c in wanted if c.weights == w] for w in formats]


def _checkpoint_bytes(model: str, root: Path) -> int:
    """Bytes of the float32 checkpoint the candidates load (0 when unknown)."""
    try:
        from workers.engine.loader import checkpoint_dir

        directory = checkpoint_dir(model, root / "weights")
    except (OSError, ValueError, KeyError):
        return 0
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _build(model: str, candidate: Candidate, root: Path, loaded: Any) -> Any:
    """The engine of `candidate` (compiled graphs compiled now), or a Measurement saying why not."""
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
        engine = Engine.from_config(config, loaded=loaded)
    except (ImportError, NotImplementedError, RuntimeError, ValueError) as exc:
        log.warning("auto config: %s unavailable: %s", candidate.label, exc)
        return Measurement(candidate, None, None, f"unavailable: {type(exc).__name__}")
    log.info("auto config: %s built in %.1fs", candidate.label, time.perf_counter() - t0)
    return engine


def _measure_rounds(engines: dict[Candidate, Any], caps: bool = True) -> list[Measurement]:
    """Warm-up, then `ROUNDS` interleaved rounds at the ranking batch sizes (medians), then the
    cap's batch sizes once (`caps`)."""
    import torch

    samples: dict[Candidate, dict[int, list[float]]] = {c: {} for c in engines}
    failed: dict[Candidate, str] = {}
    order = list(engines)

    def run(c: Candidate, batch: int) -> float | None:
        if c in failed:
            return None
        try:
            return _decode_tok_s(engines[c], batch)
        except RuntimeError as exc:
            log.warning("auto config: %s failed to decode: %s", c.label, exc)
            failed[c] = f"failed: {type(exc).__name__}"
            return None

    with torch.inference_mode():
        for c in order:  # warm-up (first-call allocations, the graphs' first run)
            for batch in RANK_BATCHES:
                run(c, batch)
        for r in range(ROUNDS):
            for c in order[r % len(order) :] + order[: r % len(order)]:
                for batch in RANK_BATCHES:
                    speed = run(c, batch)
                    if speed is not None:
                        samples[c].setdefault(batch, []).append(speed)
        for c in order:
            for batch in CAP_BATCHES if caps else ():
                speed = run(c, batch)
                if speed is not None:
                    samples[c][batch] = [speed]
    out = []
    for c in order:
        if c in failed:
            out.append(Measurement(c, None, None, failed[c]))
            continue
        speeds = {b: statistics.median(v) for b, v in samples[c].items() if v}
        spread = {b: (min(v), max(v)) for b, v in samples[c].items() if len(v) > 1}
        log.info(
            "auto config: measured %s: %s",
            c.label,
            ", ".join(
                f"b{b} {s:.1f} tok/s"
                + (f" ({spread[b][0]:.1f}-{spread[b][1]:.1f})" if b in spread else "")
                for b, s in sorted(speeds.items())
            ),
        )
        larger = tuple((b, speeds[b]) for b in CAP_BATCHES if b in speeds)
        out.append(Measurement(c, speeds.get(1), speeds.get(8), larger=larger))
    return out


CpuSample = tuple[float, float, float]


def _cpu_sample() -> CpuSample | None:
    """(wall seconds, the machine's busy CPU seconds incl. steal, this process's CPU seconds);
    None where /proc/stat cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return time.monotonic(), (sum(ticks[:8]) - idle) / hz, own.user + own.system


def _others_share(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> float:
    """The share of the machine's CPU time (all cores) other processes took between two
    samples; from the load average where /proc/stat is missing."""
    cpus = os.cpu_count() or 1
    if before is None or after is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return max(0.0, min(1.0, (load - 1.0) / cpus))  # 1.0: the probe's own thread
    wall = after[0] - before[0]
    if wall <= 0:
        return 0.0
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, min(1.0, others / (wall * cpus)))


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
