"""The C++ ops' build survives a build that died halfway (kernels/cpu_ops.py, issue 26).

torch's build marker (`lock` in the build directory) left by a killed build made every later
`load()` on the host wait forever. The build now runs under an flock of its own, and a marker
found under it is a dead build's and removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kernels import cpu_ops

REPO = Path(__file__).resolve().parents[2]


def test_a_dead_builds_marker_is_removed_under_the_flock(tmp_path: Path) -> None:
    (tmp_path / cpu_ops.TORCH_BATON).write_text("")
    with cpu_ops.BuildFlock(tmp_path):
        assert not (tmp_path / cpu_ops.TORCH_BATON).exists()
    assert (tmp_path / cpu_ops.FLOCK_NAME).exists()


def test_a_live_builders_flock_is_waited_for_and_its_marker_kept(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from pathlib import Path
                from kernels import cpu_ops
                d = Path({str(tmp_path)!r})
                with cpu_ops.BuildFlock(d):
                    (d / cpu_ops.TORCH_BATON).write_text("")  # a live build's marker
                    print("held", flush=True)
                    time.sleep(1.5)
                    (d / cpu_ops.TORCH_BATON).unlink()  # torch removes it when done
                """
            ),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        assert (tmp_path / cpu_ops.TORCH_BATON).exists()
        started = time.monotonic()
        with cpu_ops.BuildFlock(tmp_path):
            waited = time.monotonic() - started
        assert waited > 0.5  # it waited for the live build instead of taking its marker
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()


@pytest.mark.slow
def test_load_is_not_stuck_behind_a_stale_marker(tmp_path: Path) -> None:
    if not cpu_ops.load():
        pytest.skip(f"the C++ ops do not build here: {cpu_ops.error()}")
    from torch.utils import cpp_extension

    built = Path(cpp_extension._get_build_directory(cpu_ops.EXTENSION_NAME, False))
    root = tmp_path / "ext"
    copy = root / cpu_ops.EXTENSION_NAME
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(cpu_ops.TORCH_BATON, "*.flock"))
    (copy / cpu_ops.TORCH_BATON).write_text("")  # what a SIGKILLed build leaves
    child = subprocess.run(
        [sys.executable, "-c", "from kernels import cpu_ops; print(cpu_ops.load())"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(root)},
        capture_output=True,
        text=True,
        timeout=600,  # the old code waits here forever
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "True"
    assert "did not finish" in child.stderr
