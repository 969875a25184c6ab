"""The probe's measurements (workers/engine/probe_runs.py) and its record's use at start-up
(workers/engine/autoprobe.py): interleaved rounds with medians, the host's load, a busy record
measured again, and a worker that never waits for a probe."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from workers.engine import probe_runs
from workers.engine.autoconfig import Candidate, Gate, Measurement, Overrides, unmeasured_choice
from workers.engine.autoprobe import _to_json, probe_key, record_path, resolve_worker_config
from workers.engine.disk_cache import write_record
from workers.engine.probe_runs import ProbeRecord, _measure_rounds, _others_share

F32 = Candidate("float32", False)
F32C = Candidate("float32", True)
I8 = Candidate("int8", False)
I8C = Candidate("int8", True)


def test_rounds_interleave_the_candidates_and_keep_the_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every round runs every candidate (rotated order); one disturbed round does not move a
    candidate's figure (the median), and batch 16 / 32 are measured once, after the rounds."""
    calls: list[tuple[str, int]] = []
    base = {"f32": 40.0, "i8": 60.0}
    disturbed = {("f32", 1): 1}  # the second timed b1 run of f32 lands in a burst of other work

    def fake_decode(engine: Any, batch: int) -> float:
        calls.append((engine, batch))
        n = sum(1 for c in calls if c == (engine, batch)) - 2  # 0: warm-up, 1..: timed rounds
        slow = disturbed.get((engine, batch)) == n
        return base[engine] * batch**0.5 * (0.3 if slow else 1.0)

    monkeypatch.setattr(probe_runs, "_decode_tok_s", fake_decode)
    monkeypatch.setattr(probe_runs, "ROUNDS", 3)
    got = {m.candidate: m for m in _measure_rounds({F32: "f32", I8: "i8"})}
    assert got[F32].tok_s_b1 == pytest.approx(40.0)  # the median ignores the disturbed round
    assert got[I8].tok_s_b8 == pytest.approx(60.0 * 8**0.5)
    assert dict(got[I8].larger) == pytest.approx({16: 240.0, 32: 60.0 * 32**0.5})
    timed = [c for c in calls if c[1] == 1][2:]  # after each one's warm-up
    assert [e for e, _ in timed] == ["f32", "i8", "i8", "f32", "f32", "i8"]  # rotated rounds
    assert calls[-4:] == [("f32", 16), ("f32", 32), ("i8", 16), ("i8", 32)]


def test_a_candidate_that_fails_to_decode_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_decode(engine: Any, batch: int) -> float:
        if engine == "broken":
            raise RuntimeError("out of memory")
        return 10.0

    monkeypatch.setattr(probe_runs, "_decode_tok_s", fake_decode)
    got = {m.candidate: m for m in _measure_rounds({F32: "ok", I8C: "broken"})}
    assert got[F32].score == pytest.approx(10.0)
    assert got[I8C].score is None and got[I8C].note == "failed: RuntimeError"


def test_other_processes_share_of_the_cpu() -> None:
    cpus = __import__("os").cpu_count() or 1
    # 10 s of wall time; the machine was busy 10 * cpus * 0.5 CPU-seconds, 1 s of them ours
    before = (0.0, 100.0, 5.0)
    after = (10.0, 100.0 + 5.0 * cpus, 6.0)
    assert _others_share(before, after) == pytest.approx((5.0 * cpus - 1.0) / (10.0 * cpus))
    assert _others_share(before, (10.0, 101.0, 6.0)) == 0.0  # only us
    assert ProbeRecord((), 0.6, 0.0).busy and not ProbeRecord((), 0.1, 0.0).busy
    sample = probe_runs._cpu_sample()
    assert sample is None or (sample[1] > 0 and sample[2] > 0)


GATES_I8 = {"float32": Gate(True, "ref"), "bfloat16": Gate(False, "x"),
            "int8": Gate(True, "ok"), "int4": Gate(False, "x")}  # fmt: skip


def test_the_unmeasured_choice_is_int8_eager_where_its_gate_passes() -> None:
    got = unmeasured_choice(GATES_I8)
    assert got.candidate == I8 and got.pending_probe and "without measuring" in got.reason
    no_int8 = {**GATES_I8, "int8": Gate(False, "chrF -3")}
    assert unmeasured_choice(no_int8).candidate == F32
    flags = unmeasured_choice(GATES_I8, Overrides(weights="float32", compile_decode=True))
    assert flags.candidate == F32C


def test_the_unmeasured_choice_is_float32_where_int8s_kernel_has_no_fast_loop() -> None:
    # a CPU without AVX-512 or AVX2: the int8 op is its plain loop, slower than float32's BLAS
    got = unmeasured_choice(GATES_I8, int8_fast=False)
    assert got.candidate == F32 and "no vector loop on this CPU" in got.reason
    # the flags still win
    asked = unmeasured_choice(GATES_I8, Overrides(weights="int8"), int8_fast=False)
    assert asked.candidate == I8 and "lacks" not in asked.reason


def _store(model: str, root: Path, others_share: float) -> None:
    measurements = [
        Measurement(F32, 40.0, 200.0),
        Measurement(F32C, 35.0, 190.0),
        Measurement(Candidate("bfloat16", False), None, None, "gate fails"),
        Measurement(I8, 50.0, 220.0),
        Measurement(I8C, 90.0, 300.0, larger=((16, 320.0), (32, 330.0))),
        Measurement(Candidate("int4", False), None, None, "gate fails"),
    ]
    value = {
        "measurements": [_to_json(m) for m in measurements],
        "others_share": others_share,
        "measured_at": time.time(),
    }
    write_record(record_path(model, root), probe_key(model), value)


def test_the_worker_starts_at_once_and_a_busy_record_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`background=True` (the worker): no record -> the unmeasured choice, nothing measured;
    a quiet record -> its choice; a busy record -> its choice, pending another probe."""
    import workers.engine.autoprobe as autoprobe

    monkeypatch.setattr(autoprobe, "model_gates", lambda model, name="": GATES_I8)
    monkeypatch.setattr(autoprobe, "measure_candidates", lambda *a, **k: pytest.fail("measured"))
    model = str(tmp_path / "model.gguf")
    Path(model).write_bytes(b"GGUF")
    kw: dict[str, Any] = dict(device="cpu", quantize=None, compile_decode=None, auto=True,
                              cache_root=tmp_path, background=True)  # fmt: skip
    first = resolve_worker_config(model, **kw)
    assert first.candidate == I8 and first.pending_probe and not first.figures
    _store(model, tmp_path, others_share=0.05)
    quiet = resolve_worker_config(model, **kw)
    assert quiet.candidate == I8C and not quiet.pending_probe
    assert quiet.figures[F32C] == {1: 35.0, 8: 190.0}  # every candidate's, for the tuner
    assert dict(quiet.tok_s_by_batch) == {1: 90.0, 8: 300.0, 16: 320.0, 32: 330.0}
    _store(model, tmp_path, others_share=0.6)
    busy = resolve_worker_config(model, **kw)
    assert busy.candidate == I8C and busy.pending_probe and "busy" in busy.reason
    assert record_path("qwen2.5-coder-1.5b", tmp_path).name == "auto-qwen2.5-coder-1.5b.json"


def test_candidates_are_measured_format_by_format_when_all_would_not_fit() -> None:
    from workers.engine.probe_runs import groups_that_fit

    wanted = [F32, F32C, I8, I8C]
    gib = 2**30
    # Gemma 3 270M: a 1.1 GB checkpoint on a machine with 20 GB free: all at once
    assert groups_that_fit(wanted, int(1.1 * gib), 20 * gib) == [wanted]
    # a 1.5B model: 6.2 GB float32: float32 (2x) + int8 + loading = 22 GB > 60 % of 20 GB
    assert groups_that_fit(wanted, int(6.2 * gib), 20 * gib) == [[F32, F32C], [I8, I8C]]
    assert groups_that_fit(wanted, int(6.2 * gib), None) == [wanted]  # unknown: as before


class _FakeEngine:
    def __init__(self, label: str, loaded: object) -> None:
        self.label, self.loaded = label, loaded


BF16 = Candidate("bfloat16", False)
BF16C = Candidate("bfloat16", True)
# sqrt(b1 * b8) of each candidate: Gemma 3 270M's shape on the Zen 3 (int8 compiled 1.7x eager)
SCORES = {F32: 24.0, F32C: 26.0, BF16: 16.0, BF16C: 19.0, I8: 39.0, I8C: 67.0}


def _fake_probe(monkeypatch: pytest.MonkeyPatch, fits: bool) -> list[tuple[str, bool]]:
    """`_build` and `_decode_tok_s` replaced: engines that decode at `SCORES`; returns the log
    of builds as (label, whether it got another engine's weights)."""
    builds: list[tuple[str, bool]] = []

    def fake_build(model: str, c: Candidate, root: Path, loaded: Any) -> Any:
        builds.append((c.label, loaded is not None))
        return _FakeEngine(c.label, loaded or f"weights-{c.weights}")

    by_label = {c.label: s for c, s in SCORES.items()}
    monkeypatch.setattr(probe_runs, "_build", fake_build)
    monkeypatch.setattr(probe_runs, "_decode_tok_s", lambda e, b: by_label[e.label])
    monkeypatch.setattr(probe_runs, "ROUNDS", 1)
    monkeypatch.setattr(probe_runs, "_checkpoint_bytes", lambda model, root: 10**9)
    monkeypatch.setattr(probe_runs, "_available_bytes", lambda: 10**12 if fits else 10**9)
    return builds


@pytest.mark.parametrize("fits", [True, False])
def test_a_compile_no_kept_gain_could_make_the_winner_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fits: bool
) -> None:
    """Eager engines first; int8 (best eager) compiled first; float32 (24 x 2.5 = 60) and
    bfloat16 (40) cannot reach int8 + compiled's 67: not compiled, and their lines say why.
    Held together or format by format, the record has every candidate's figure or reason."""
    builds = _fake_probe(monkeypatch, fits)
    wanted = [F32, F32C, BF16, BF16C, I8, I8C]
    record = probe_runs.measure_candidates("m", wanted, tmp_path, compile_gain=2.5)
    got = {m.candidate: m for m in record.measurements}
    assert [c for c in wanted if c in got] == wanted  # every candidate, in the wanted order
    assert [label for label, _ in builds][:3] == [F32.label, BF16.label, I8.label]
    compiled_built = [label for label, _ in builds if "compiled" in label]
    assert compiled_built == [I8C.label]
    for c in (F32C, BF16C):
        assert got[c].score is None and got[c].note.startswith(probe_runs.PRUNED)
        assert "x 2.50 < 67.0" in got[c].note
    assert got[I8C].score == pytest.approx(67.0) and got[F32].score == pytest.approx(24.0)
    # the compiled engine reuses the eager one's weights (held together), or the eager engine
    # is built again on the compiled one's weights for the pair (format by format)
    assert (I8C.label, fits) in builds
    assert (I8.label, True) in builds or fits
    if fits:  # held together: the hopeless eager engines' record is their eager-pass figure
        assert got[F32].note.startswith("eager pass only, x1.00") and not got[F32].larger
        assert dict(got[I8].larger).keys() == {16, 32}  # the cap's sizes, on the final rounds


def test_hopeless_eager_engines_are_let_go_before_the_compiles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Held together: float32's and bfloat16's compiles are skipped, so their eager engines
    (below the best estimate too) are not timed again; the eager pass times no cap batch."""
    builds = _fake_probe(monkeypatch, fits=True)
    by_label = {c.label: s for c, s in SCORES.items()}
    timed: list[tuple[str, int, bool]] = []  # (label, batch, after int8's compile)

    def decode(engine: Any, batch: int) -> float:
        timed.append((engine.label, batch, any("compiled" in label for label, _ in builds)))
        return by_label[engine.label]

    monkeypatch.setattr(probe_runs, "_decode_tok_s", decode)
    wanted = [F32, F32C, BF16, BF16C, I8, I8C]
    probe_runs.measure_candidates("m", wanted, tmp_path, compile_gain=2.5)
    eager_pass = {(label, b) for label, b, later in timed if not later}
    assert {b for _, b in eager_pass} == set(probe_runs.RANK_BATCHES)
    later = {label for label, _, after in timed if after}
    assert later == {I8.label, I8C.label}
    assert {(label, b) for label, b, after in timed if after and b in (16, 32)} == {
        (label, b) for label in (I8.label, I8C.label) for b in (16, 32)
    }


def test_a_larger_bound_compiles_what_could_still_win(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    builds = _fake_probe(monkeypatch, fits=True)
    wanted = [F32, F32C, BF16, BF16C, I8, I8C]
    record = probe_runs.measure_candidates("m", wanted, tmp_path, compile_gain=3.0)
    compiled_built = [label for label, _ in builds if "compiled" in label]
    assert compiled_built == [I8C.label, F32C.label]  # 24 x 3 = 72 > 67: it might have won
    got = {m.candidate: m for m in record.measurements}
    assert got[F32C].score == pytest.approx(26.0) and got[BF16C].note.startswith("not compiled")
    # no bound: every format compiled (the probe as before)
    builds.clear()
    probe_runs.measure_candidates("m", wanted, tmp_path)
    assert len([label for label, _ in builds if "compiled" in label]) == 3


def test_compile_gains_are_kept_and_raise_the_bound_never_lower_it(tmp_path: Path) -> None:
    from workers.engine import autoprobe

    floor = autoprobe.COMPILE_GAIN_FLOOR * autoprobe.GAIN_MARGIN
    assert autoprobe.compile_gain_bound(tmp_path) == pytest.approx(floor)
    record = ProbeRecord(
        (Measurement(I8, 20.0, 80.0), Measurement(I8C, 60.0, 240.0),  # 3.0x
         Measurement(F32, 40.0, 40.0), Measurement(F32C, None, None, "not compiled: ...")),
        0.0, 1.0,
    )  # fmt: skip
    autoprobe.keep_compile_gains(tmp_path, record, "/models/gemma.gguf")
    [kept] = autoprobe._read_gains(tmp_path)
    assert kept["weights"] == "int8" and kept["gain"] == pytest.approx(3.0)
    assert kept["model"] == "gemma.gguf"
    assert autoprobe.compile_gain_bound(tmp_path) == pytest.approx(3.0 * autoprobe.GAIN_MARGIN)
    slower = ProbeRecord((Measurement(I8, 20.0, 80.0), Measurement(I8C, 10.0, 40.0)), 0.0, 2.0)
    autoprobe.keep_compile_gains(tmp_path, slower, "gemma")
    assert len(autoprobe._read_gains(tmp_path)) == 2
    assert autoprobe.compile_gain_bound(tmp_path) == pytest.approx(3.0 * autoprobe.GAIN_MARGIN)
    autoprobe.gains_path(tmp_path).write_text("{not json")
    assert autoprobe.compile_gain_bound(tmp_path) == pytest.approx(floor)  # corrupt: the floor


@pytest.mark.slow
def test_the_staged_probe_on_real_engines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SmolLM2's real eager engines through the staged path: measured, every compile skipped by
    a bound below 1 (nothing compiles: a cold compile takes minutes), the record complete."""
    from workers.engine.disk_cache import cache_root

    monkeypatch.setattr(probe_runs, "DECODE_STEPS", 4)
    monkeypatch.setattr(probe_runs, "ROUNDS", 1)
    (tmp_path / "weights").symlink_to(cache_root() / "weights")  # the dequantized checkpoints
    wanted = [F32, F32C, I8, I8C]
    record = probe_runs.measure_candidates("smollm2-135m", wanted, tmp_path, compile_gain=0.5)
    got = {m.candidate: m for m in record.measurements}
    assert list(got) == wanted
    assert (got[F32].score or 0) > 0 and (got[I8].score or 0) > 0
    assert dict(got[I8].larger).keys() == {16, 32}  # the cap's batch sizes, on the final rounds
    for c in (F32C, I8C):
        assert got[c].score is None and got[c].note.startswith(probe_runs.PRUNED)
    assert 0.0 <= record.others_share <= 1.0


def test_the_skip_compares_side_by_side_ratios_not_figures_minutes_apart(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The host slows to half after the eager pass (a first start on the Zen 3: int8 eager
    33.5 tok/s in the eager pass, 18.0 beside its compiled engine): int8 + compiled then
    measures 33.5, yet its pair's 1.7x speed-up puts it at 67 in the eager pass's units, and
    float32 (24 x 2.5 = 60) is still not compiled."""
    builds = _fake_probe(monkeypatch, fits=True)
    by_label = {c.label: s for c, s in SCORES.items()}

    def slower_after_a_compile(engine: Any, batch: int) -> float:
        compiled_yet = any("compiled" in label for label, _ in builds)
        return by_label[engine.label] * (0.5 if compiled_yet else 1.0)

    monkeypatch.setattr(probe_runs, "_decode_tok_s", slower_after_a_compile)
    wanted = [F32, F32C, BF16, BF16C, I8, I8C]
    record = probe_runs.measure_candidates("m", wanted, tmp_path, compile_gain=2.5)
    assert [label for label, _ in builds if "compiled" in label] == [I8C.label]
    got = {m.candidate: m for m in record.measurements}
    assert "< 67.0 tok/s" in got[F32C].note
    assert got[I8C].score == pytest.approx(33.5)  # the record: the final interleaved rounds
    # float32's eager engine was let go before the slowdown: its eager-pass 24 at the final
    # rounds' pace (int8 eager 39 -> 19.5 between the two), as int8 + compiled's 33.5 is
    assert got[F32].score == pytest.approx(12.0) and "x0.50" in got[F32].note
