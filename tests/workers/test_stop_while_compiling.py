"""A worker stopped while its decode graphs still compile in the background exits cleanly.

Seen on 2026-12-02: `tolk worker` (auto configuration: int8 + compiled decode) got SIGTERM a
second after it started consuming; it drained and stopped, then the interpreter's exit aborted
the process ("terminate called without an active exception", "Fatal Python error: Aborted",
exit -6) because the compiling thread was inside torch. The worker now ends with `os._exit`
once its Kafka work is done (workers/worker_start.py `exit_past_compiler`).

A real `tolk worker` (SmolLM2, `--compile-decode`), real broker; SIGTERM as soon as it logs
that it consumes while it compiles in the background (dynamo alone traces for many seconds, so
the compiler is busy then). Until 2026-12-02 the test sent it at the compile line, which comes
before the worker installs its stop signals: on a loaded machine (CI) the default action ended
the process (exit -15) before it got there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kafka_fixtures import unique_name

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STARTED = ("compiling decode graphs in the background", " consuming ")


def test_sigterm_during_background_compilation_exits_zero(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    prefix = unique_name("stopcompile") + "."
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLK_")},
        "TOLK_BOOTSTRAP": kafka_bootstrap,
        "TOLK_REDIS_URL": redis_url,
        "TOLK_TOPIC_PREFIX": prefix,
        "TOLK_GROUP_ID": f"{prefix}workers",
        "TOLK_LANGUAGES": "de",
        "TOLK_HEALTH_PORT": "0",
        "TOLK_AUTO": "0",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp_path / "worker.log"
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", "smollm2-135m",
           "--compile-decode", "--no-cache", "--metrics-port", "0"]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 600
        # consuming (its stop signals installed) while the graphs compile; a signal before
        # that ends the process by the default action, with nothing consumed
        while not all(line in log_path.read_text("utf-8") for line in STARTED):
            assert proc.poll() is None, log_path.read_text("utf-8")[-3000:]
            assert time.monotonic() < end, "the worker never started consuming and compiling"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text("utf-8")
    assert "compiled decode graphs for batch sizes" not in text, "compiled before the stop"
    assert code == 0, f"exit {code}:\n{text[-3000:]}"
    assert "Fatal Python error" not in text
    assert "exiting without waiting for the compiler" in text
