"""The auto configuration: the chooser as pure logic (measured speeds + recorded gates + flags ->
choice and reason), the recorded gate table, and the flag resolution without a probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.autoconfig import (
    FALLBACK,
    FORMATS,
    Candidate,
    Choice,
    Gate,
    Measurement,
    Overrides,
    choose,
    gate_for,
    load_gate_table,
)
from workers.engine.autoprobe import resolve_worker_config

F32 = Candidate("float32", False)
F32C = Candidate("float32", True)
BF16 = Candidate("bfloat16", False)
I8 = Candidate("int8", False)
I8C = Candidate("int8", True)

PASS = Gate(True, "ok")
FAIL = Gate(False, "chrF -2.5")


def measured(c: Candidate, b1: float, b8: float) -> Measurement:
    return Measurement(c, b1, b8)


SPEEDS = [
    measured(F32, 17.0, 90.0),
    measured(BF16, 12.0, 60.0),
    measured(I8, 40.0, 150.0),
    measured(I8C, 70.0, 210.0),
]


def test_fastest_passing_candidate_wins_with_reason_and_one_line_each() -> None:
    choice = choose(SPEEDS, {"float32": PASS, "bfloat16": PASS, "int8": PASS})
    assert choice.candidate == I8C
    assert "int8+compiled" in choice.reason and "fastest" in choice.reason
    assert len(choice.lines) == len(SPEEDS)
    assert any(line.startswith("int8+compiled: b1 70.0 tok/s, b8 210.0") for line in choice.lines)


def test_a_format_that_fails_the_gate_is_not_chosen_however_fast() -> None:
    choice = choose(SPEEDS, {"float32": PASS, "bfloat16": PASS, "int8": FAIL})
    assert choice.candidate == F32
    assert all("fails the gate" in line for line in choice.lines if line.startswith("int8"))


def test_score_balances_batch_1_and_batch_8() -> None:
    # A: faster at batch 1 only, by less than B is faster at batch 8
    a = measured(Candidate("float32", True), 30.0, 60.0)  # sqrt = 42.4
    b = measured(Candidate("int8", False), 25.0, 120.0)  # sqrt = 54.8
    assert choose([a, b], {"float32": PASS, "int8": PASS}).candidate == b.candidate


def test_flags_override_the_choice() -> None:
    gates = {"float32": PASS, "bfloat16": PASS, "int8": PASS}
    no_compile = choose(SPEEDS, gates, Overrides(compile_decode=False))
    assert no_compile.candidate == I8
    f32 = choose(SPEEDS, gates, Overrides(weights="float32"))
    assert f32.candidate == F32
    assert any("excluded by the flags" in line for line in f32.lines)


def test_an_explicit_format_is_taken_even_if_its_gate_fails() -> None:
    choice = choose(SPEEDS, {"float32": PASS, "int8": FAIL}, Overrides(weights="int8"))
    assert choice.candidate == I8C
    assert any("asked for by the flags" in line for line in choice.lines)


def test_nothing_measured_falls_back_to_eager_float32_or_the_flags() -> None:
    unmeasured = [Measurement(I8, None, None, "unavailable")]
    assert choose(unmeasured, {"int8": PASS}).candidate == FALLBACK
    flagged = choose(unmeasured, {"int8": PASS}, Overrides("int8", True))
    assert flagged.candidate == I8C
    assert "no measured candidate" in flagged.reason


def test_gate_table_deltas_decide() -> None:
    table = {
        "max_chrf_drop": 1.0,
        "models": {
            "m": {
                "int8": {"delta_chrf": {"en-de": -0.4, "de-en": 0.2}},
                "bfloat16": {"delta_chrf": {"en-de": -1.3, "de-en": 0.0}},
                "broken": {"error": "RuntimeError: no kernel"},
            }
        },
    }
    assert gate_for("m", "float32", table).passed
    assert gate_for("m", "int8", table).passed
    assert not gate_for("m", "bfloat16", table).passed  # one direction beyond the limit
    assert not gate_for("other", "int8", table).passed  # no record: not assumed good
    assert "no recorded gate" in gate_for("other", "int8", table).detail


def test_int4_is_a_candidate_format_of_its_own() -> None:
    assert "int4" in FORMATS
    c = Candidate("int4", compile_decode=True)
    assert c.quantize == "int4" and c.dtype is None and c.label == "int4+compiled"
    with pytest.raises(ValueError, match="unknown weight format"):
        Candidate("int3", False)


def test_the_recorded_gate_covers_the_shipped_models() -> None:
    table = load_gate_table()
    for model in ("gemma3-270m", "smollm2-135m"):
        entry = table["models"][model]
        assert "chrf" in entry["float32"], model
        assert "int8" in entry, model


def test_both_flags_given_skip_the_probe(tmp_path: Path) -> None:
    # no model is loaded: a probe would fail on this non-existent model name
    got = resolve_worker_config(
        "no-such-model",
        device="cpu",
        quantize="int8",
        compile_decode=False,
        auto=True,
        cache_root=tmp_path,
    )
    assert got.candidate == I8 and not got.tok_s_by_batch  # no speeds: the default batch cap
    off = resolve_worker_config(
        "no-such-model", device="cpu", quantize=None, compile_decode=None, auto=False,
        cache_root=tmp_path,
    )  # fmt: skip
    assert off.candidate == F32
    assert resolve_worker_config(
        "no-such-model", device="cuda", quantize="none", compile_decode=None, auto=True,
        cache_root=tmp_path,
    ).candidate == F32  # fmt: skip
    with pytest.raises(ValueError, match="--quantize"):
        resolve_worker_config(
            "m", device="cpu", quantize="int3", compile_decode=None, auto=False,
            cache_root=tmp_path,
        )  # fmt: skip


@pytest.mark.slow
def test_auto_choice_loads_and_translates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real probe on SmolLM2 (eager candidates only, to keep it short): one log line per
    candidate, a record on disk that the next start reads, and the chosen engine translates."""
    import logging

    from workers.engine import probe_runs
    from workers.engine.autoprobe import auto_config
    from workers.engine.disk_cache import cache_root
    from workers.engine.engine import Engine, EngineConfig

    # fewer timed tokens than a real start measures (speeds are not asserted, only that each
    # batch size was measured, stored and read back): 4 steps, one timed run after the warm-up
    monkeypatch.setattr(probe_runs, "DECODE_STEPS", 4)
    monkeypatch.setattr(probe_runs, "ROUNDS", 2)

    (tmp_path / "weights").symlink_to(cache_root() / "weights")  # the dequantized checkpoints
    over = Overrides(compile_decode=False)
    with caplog.at_level(logging.INFO, logger="workers.engine.autoprobe"):
        choice = auto_config("smollm2-135m", tmp_path, over)
    lines = [r.getMessage() for r in caplog.records if "auto config candidate" in r.getMessage()]
    assert len(lines) == 4  # float32, bfloat16, int8, int4 (each measured or said why not)
    assert not choice.candidate.compile_decode
    assert list((tmp_path / "probes").glob("auto-*.json"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.engine.autoprobe"):
        again = auto_config("smollm2-135m", tmp_path, over)
    assert again.candidate == choice.candidate
    assert "probe cached" in caplog.text
    # the chosen candidate's speeds at every probed batch size, stored and read back
    assert sorted(choice.tok_s_by_batch) == [1, 8, 16, 32]
    assert dict(again.tok_s_by_batch) == dict(choice.tok_s_by_batch)
    engine = Engine.from_config(
        EngineConfig(
            model="smollm2-135m",
            dtype=choice.candidate.dtype,
            quantize=choice.candidate.quantize,
            cache_dir=str(tmp_path),
        )
    )
    [result] = engine.generate([engine.translation_request("Good morning!", "en", "de")])
    assert result.ok and result.text.strip()


@pytest.mark.parametrize(
    "args, env, expected",
    [
        ([], {"TOLK_AUTO": "1"}, ("auto", None, None)),  # the default outside the tests
        (["--quantize", "int8"], {"TOLK_AUTO": "1"}, ("auto", "int8", None)),
        (["--no-compile-decode"], {"TOLK_AUTO": "1"}, ("auto", None, False)),
        (["--no-auto"], {"TOLK_AUTO": "1"}, ("fixed", None, None)),
        ([], {"TOLK_AUTO": "0"}, ("fixed", None, None)),
    ],
)
def test_tolk_worker_builds_the_engine_the_resolution_chose(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    args: list[str],
    env: dict[str, str],
    expected: tuple[str, str | None, bool | None],
) -> None:
    from typer.testing import CliRunner

    import workers.cli as cli
    import workers.engine.autoprobe as autoprobe
    import workers.serving.fair_engine as fair_engine
    import workers.worker as worker_module
    from tests.workers.test_cache_engine import FakeEngine, RecordingWorker

    seen: list[tuple[str, str | None, bool | None]] = []
    configs: list[object] = []

    def resolve(model: str, *, device: str, quantize: str | None, compile_decode: bool | None,
                auto: bool, cache_root: Path, background: bool = False) -> Choice:  # fmt: skip
        seen.append(("auto" if auto else "fixed", quantize, compile_decode))
        assert cache_root == tmp_path
        assert background  # the worker never waits for a probe (workers/engine/tuner.py)
        # at batch 16 the step is 2x slower for 10 % more tokens/s: the cap stays at 8
        return Choice(I8C, "test", (), {1: 50.0, 8: 220.0, 16: 242.0, 32: 215.0})

    monkeypatch.setattr(cli, "_check_broker_or_exit", lambda settings: None)
    monkeypatch.setattr(autoprobe, "resolve_worker_config", resolve)
    monkeypatch.setattr(
        fair_engine, "build_fair_engine", lambda c, *a, **k: configs.append(c) or FakeEngine()
    )
    monkeypatch.setattr(worker_module, "Worker", RecordingWorker)
    RecordingWorker.engines = []
    result = CliRunner().invoke(
        cli.app,
        ["worker", "--metrics-port", "0", "--no-cache", "--no-faithful", *args],
        env={**env, "TOLK_CACHE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 0, result.output
    assert seen == [expected]
    (config,) = configs
    assert config.quantize == "int8" and config.compile_decode  # type: ignore[attr-defined]
    assert config.compile_in_background  # type: ignore[attr-defined]
    assert config.max_num_seqs == 8  # type: ignore[attr-defined]


def test_a_stored_probe_is_reused_only_if_it_measured_what_can_be_chosen() -> None:
    from workers.engine.autoprobe import _covers

    gates = {"float32": PASS, "bfloat16": FAIL, "int8": PASS, "int4": FAIL}
    only_int8 = [Measurement(F32, None, None, "another format asked for"), *SPEEDS[2:]]
    assert _covers(only_int8, gates, Overrides(weights="int8"))
    assert not _covers(only_int8, gates, Overrides())  # float32 never measured: probe again
    eager_only = SPEEDS[:3]
    assert _covers(eager_only, gates, Overrides(compile_decode=False))
    assert not _covers(eager_only, gates, Overrides())  # compiled decode never measured
    # every gated format compiled too: int8 compiled alone does not cover float32's (issue #47)
    assert not _covers(SPEEDS, gates, Overrides())
    assert _covers([*SPEEDS, measured(F32C, 15.0, 80.0)], gates, Overrides())
    # a compile the bound showed hopeless counts as measured (probing again would skip it again)
    skipped = Measurement(F32C, None, None, "not compiled: eager 12.0 x 2.50 < 90.0 tok/s")
    assert _covers([*SPEEDS, skipped], gates, Overrides())


def test_probe_key_changes_with_the_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record measured with other C++ kernels is not read back: a faster int8 loop can change
    which format wins, so the probe measures again (the key holds the sources' digest)."""
    from kernels import cpu_ops
    from workers.engine import autoprobe

    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    key = autoprobe.probe_key(str(weights))
    assert autoprobe.probe_key(str(weights)) == key  # stable while nothing changes
    digest = cpu_ops.sources_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    monkeypatch.setattr(cpu_ops, "sources_digest", lambda: "0" * 16)
    assert autoprobe.probe_key(str(weights)) != key
