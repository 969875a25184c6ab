"""`Engine.stop()` returns only once the step in progress has ended (issue 26).

The soak (bench/soak.py) caught a worker that stopped cleanly ("worker ... stopped") and then
died by SIGABRT ("terminate called without an active exception", "Fatal Python error:
Aborted"): `stop()` waited 5 s for the engine thread, a step on a loaded CPU took longer, the
process exited, and the interpreter's shutdown killed the daemon engine thread inside a torch
op (pthread_exit unwinding through a C++ frame that may not throw: std::terminate). Here a
step that runs torch ops for 7 s stands in for the slow step; no model is loaded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import threading, time, torch
from workers.engine.engine import Engine

torch.set_num_threads(1)
a = torch.randn(256, 256)
engine = Engine.__new__(Engine)  # only what stop() touches: no model
engine._handles = {}
engine._stop = threading.Event()
engine._wake = threading.Event()
in_step = threading.Event()

def loop():
    while not engine._stop.is_set():
        in_step.set()
        end = time.monotonic() + 7.0  # one slow step: torch ops, the stop flag unseen
        while time.monotonic() < end:
            a @ a

engine._thread = threading.Thread(target=loop, name="tolk-engine", daemon=True)
engine._thread.start()
in_step.wait(10)
thread = engine._thread
engine.stop(drain=False, timeout=1.0)
print("engine thread alive after stop:", thread.is_alive(), flush=True)
"""


def test_the_process_exits_cleanly_after_stop_during_a_slow_step() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(CHILD)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "engine thread alive after stop: False" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert proc.returncode != -signal.SIGABRT
    assert "Fatal Python error" not in proc.stderr
