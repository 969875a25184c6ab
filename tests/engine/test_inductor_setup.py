"""workers/engine/inductor_setup.py: inductor's SIMD probe answered from disk after the first
process on a machine, and a compile that traces the model once (no restart for its floats).

The second half is in tests/engine/test_compiled.py (`compile_attempt_1` never recorded)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine import inductor_setup


@pytest.fixture(autouse=True)
def _default_probe_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default root (TOLK_CACHE_DIR, set per test), not an earlier engine's choice."""
    monkeypatch.setattr(inductor_setup, "_probe_dir", None)


class FakeIsa:
    def __init__(self, flags: str) -> None:
        self._arch_flags = flags


def test_a_passed_probe_runs_once_per_flags_and_code_a_failed_one_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOLK_CACHE_DIR", str(tmp_path))
    calls: list[tuple[str, str]] = []

    def probe(isa: Any, code: str) -> bool:
        calls.append((isa._arch_flags, code))
        return "avx2" in isa._arch_flags

    check = inductor_setup._remembered(probe)
    assert check(FakeIsa("-mavx2"), "int main() {}") is True
    assert check(FakeIsa("-mavx2"), "int main() {}") is True  # from disk
    assert check(FakeIsa("-mamx-tile"), "int main() {}") is False
    assert check(FakeIsa("-mamx-tile"), "int main() {}") is False  # probed again, not kept
    assert check(FakeIsa("-mavx2"), "int other() {}") is True  # other code: probed again
    assert calls == [
        ("-mavx2", "int main() {}"),
        ("-mamx-tile", "int main() {}"),
        ("-mamx-tile", "int main() {}"),
        ("-mavx2", "int other() {}"),
    ]
    assert len(list((tmp_path / "probes").glob("inductor-isa-*.json"))) == 2


def test_a_corrupt_record_is_probed_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOLK_CACHE_DIR", str(tmp_path))
    answers = iter([True, False])
    check = inductor_setup._remembered(lambda isa, code: next(answers))
    assert check(FakeIsa("-mavx2"), "x") is True
    (record,) = (tmp_path / "probes").glob("inductor-isa-*.json")
    record.write_text("{not json")
    assert check(FakeIsa("-mavx2"), "x") is False  # probed again: a corrupt record not trusted


@pytest.mark.skipif(
    torch.cpu._is_avx2_supported() is False, reason="the real probe needs an x86 CPU with AVX2"
)
def test_the_real_avx2_probe_is_answered_from_disk_the_second_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch's own probe (build a test library, load it in a fresh python) through the memo."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv("TOLK_CACHE_DIR", str(tmp_path))
    inductor_setup.remember_isa_probes()
    original = getattr(cpu_vec_isa.VecISA, inductor_setup._ORIGINAL_CHECK)
    isa = cpu_vec_isa.VecAVX2()
    started = time.perf_counter()
    first = inductor_setup._remembered(original)(isa, cpu_vec_isa.VecISA._avx_code)
    probe_s = time.perf_counter() - started
    assert first is True  # AVX2 builds and loads on this CPU
    started = time.perf_counter()
    assert cpu_vec_isa.VecISA.check_build(isa, cpu_vec_isa.VecISA._avx_code) is True
    assert time.perf_counter() - started < probe_s / 5  # read, not a second subprocess
    assert len(list((tmp_path / "probes").glob("inductor-isa-*.json"))) == 1


def test_configure_compiler_is_idempotent_and_specializes_floats() -> None:
    from torch._inductor import cpu_vec_isa

    inductor_setup.configure_compiler()
    wrapped = cpu_vec_isa.VecISA.check_build
    inductor_setup.configure_compiler()
    assert cpu_vec_isa.VecISA.check_build is wrapped  # not wrapped twice
    assert torch._dynamo.config.specialize_float is True
