"""The C++ ops built as one translation unit (kernels/cpu_ops.py `unity_source`).

Four units cost ~63 s of g++ on a 2-vCPU AMD EPYC, almost all of it ATen's headers parsed four
times; one unit ~20 s. Each source keeps its own namespace, so helpers of the same name in
two sources (`row_plain`, `kLanes`) still compile, and the unit changes when a source does.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import cpu_ops

HELPER = """\
#include <cmath>
#include <vector>
namespace {
constexpr int kLanes = %d;
inline float row_plain(float x) { return std::sqrt(x) * kLanes; }
}  // namespace
float %s(float x) { return row_plain(x); }
"""


def _sources(tmp_path: Path) -> list[Path]:
    paths = []
    for name, lanes in (("first", 16), ("second", 8)):
        path = tmp_path / f"{name}.cpp"
        path.write_text(HELPER % (lanes, f"{name}_op"))
        paths.append(path)
    return paths


def test_the_unit_includes_each_source_once_in_its_own_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_ops, "SOURCES", _sources(tmp_path))
    text = cpu_ops.unity_source(tmp_path / "build").read_text()
    assert text.count("#include <cmath>") == 1 and text.count("#include <vector>") == 1
    for name in ("first", "second"):
        assert text.count(f'#include "{tmp_path / name}.cpp"') == 1
        assert f"namespace tolk_unity_{name} {{" in text
    # the headers come before any source's namespace (inside one they would be no-ops)
    assert text.index("#include <vector>") < text.index("namespace tolk_unity_first")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_helpers_of_the_same_name_in_two_sources_compile_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_ops, "SOURCES", _sources(tmp_path))
    unity = cpu_ops.unity_source(tmp_path / "build")
    out = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", str(unity)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    # the same sources as one file without the namespaces would not (the reason for them)
    joined = tmp_path / "joined.cpp"
    joined.write_text("".join(p.read_text() for p in cpu_ops.SOURCES))
    plain = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(joined)], capture_output=True)
    assert plain.returncode != 0


def test_a_changed_source_changes_the_unit_and_an_unchanged_one_is_not_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = _sources(tmp_path)
    monkeypatch.setattr(cpu_ops, "SOURCES", sources)
    unity = cpu_ops.unity_source(tmp_path / "build")
    before, stamp = unity.read_text(), unity.stat().st_mtime_ns
    assert cpu_ops.unity_source(tmp_path / "build").stat().st_mtime_ns == stamp
    sources[1].write_text(sources[1].read_text().replace("* kLanes", "+ kLanes"))
    assert cpu_ops.unity_source(tmp_path / "build").read_text() != before
