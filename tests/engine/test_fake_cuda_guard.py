"""The stand-in CUDA guard that torch's tracing installs must not die with a thread (SIGSEGV).

On a GPU-less machine with torch's CUDA build, a `FakeTensorMode` entered on a thread that then
exits leaves a dangling device guard, and the next entry on another thread crashed the process
(workers/engine/compiled.py, `pin_fake_cuda_guard`). Run in a child process: a crash must fail
this test, not take the test runner with it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = """
import threading
import workers.engine.compiled  # pins the guard on the main thread at import
from torch._subclasses.fake_tensor import FakeTensorMode

def trace_on_a_thread():
    with FakeTensorMode():  # as dynamo does on the background compile thread
        pass

t = threading.Thread(target=trace_on_a_thread)
t.start()
t.join()  # the thread, and its thread-locals, are gone
with FakeTensorMode():  # a later trace on the main thread
    pass
print("survived")
"""


def test_tracing_after_a_compile_thread_exits_does_not_crash() -> None:
    run = subprocess.run([sys.executable, "-c", SCENARIO], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    assert "survived" in run.stdout
