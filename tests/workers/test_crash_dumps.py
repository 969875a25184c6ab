"""A native crash in a tolk process leaves every thread's Python stack on stderr (issue 26).

Each test starts a child process through the `tolk` app (`workers.cli.app`, the console
script's entry), whose callback turns `faulthandler` on (`workers.process_hooks`), and crashes
it in native code: a SIGSEGV on a Python thread inside a real subcommand, and one on a thread
that runs no Python at all (as librdkafka's `rdk:main` does). Without the callback the child
dies by the same signal with nothing on stderr.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers import process_hooks

REPO = Path(__file__).resolve().parents[2]


def _run_child(script: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_segfault_inside_a_subcommand_dumps_every_thread() -> None:
    # `tolk demo` is the subcommand; its body is replaced by a native crash on the main thread
    # while a second Python thread waits in a function of its own.
    proc = _run_child(
        """
        import faulthandler, threading
        import workers.demo
        from workers.cli import app

        waiting = threading.Event()

        def side_thread_waiting_for_ever():
            waiting.set()
            threading.Event().wait(60)

        def crash_in_native_code(**kwargs):
            threading.Thread(target=side_thread_waiting_for_ever, daemon=True).start()
            waiting.wait(10)
            faulthandler._sigsegv()

        workers.demo.main = crash_in_native_code
        app(["demo"])
        """
    )
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert "Current thread" in proc.stderr
    assert "crash_in_native_code" in proc.stderr  # the crashing thread's stack
    assert "side_thread_waiting_for_ever" in proc.stderr  # and every other thread's


def test_a_segfault_on_a_thread_without_python_dumps_the_python_threads() -> None:
    # A pthread started from C (like librdkafka's rdk:main) reads address 0: no Python frame
    # on it, but the dump still shows where each Python thread was.
    proc = _run_child(
        """
        import ctypes, time
        from workers.cli import app

        @app.command("crash-off-python")
        def crash_off_python():
            main_thread_waiting()

        def main_thread_waiting():  # on the stack from before the native thread starts
            libc = ctypes.CDLL(None)
            tid = ctypes.c_ulong()
            strlen = ctypes.cast(libc.strlen, ctypes.c_void_p)
            libc.pthread_create(ctypes.byref(tid), None, strlen, None)  # strlen(NULL)
            time.sleep(30)

        app(["crash-off-python"])
        """
    )
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert "main_thread_waiting" in proc.stderr


def test_a_dump_already_on_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(process_hooks.faulthandler, "is_enabled", lambda: True)
    monkeypatch.setattr(process_hooks.faulthandler, "enable", lambda **kw: calls.append(kw))
    assert process_hooks.enable_crash_dumps() is True
    assert calls == []


def test_a_stderr_without_a_descriptor_runs_without_a_dump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[object] = []
    monkeypatch.setattr(process_hooks.faulthandler, "is_enabled", lambda: False)
    monkeypatch.setattr(process_hooks.faulthandler, "enable", lambda **kw: calls.append(kw))
    monkeypatch.setattr(process_hooks.sys, "__stderr__", io.StringIO())
    assert process_hooks.enable_crash_dumps() is False
    assert calls == []
