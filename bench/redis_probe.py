"""Redis calls of busy workers: how long they take, and who is to blame for the slow ones.

    python -m bench.redis_probe --seconds 180 --rate de=1,en=1 --out bench/out/redis_probe.json

Reproduces issue 26 item 3 (Redis timeouts under CPU load) on the local stack: two
`tolk worker --model smollm2-135m` processes (one consumer group, the translation cache on,
so the L2 and the results store both see traffic) under `tolk load` for `--seconds`, and
measures every Redis call the workers make, from inside them.

Each worker runs under `--as-worker`: before the CLI starts, `redis.Redis.execute_command`
and `Pipeline.execute` are wrapped to record, per call, its wall time, the calling thread's
CPU time (`time.thread_time`) and the calling thread's run-queue wait during the call (the
kernel's `/proc/thread-self/schedstat`, field 2: time runnable but not running), and a
sampler thread sleeps 2 ms in a loop and records how late it wakes: late by run-queue wait
(its own schedstat) or late by the GIL (the rest). Calls are written as JSON lines to
`<out dir>/calls-<k>.jsonl`. Meanwhile the parent samples redis-server's own run-queue wait
(`/proc/<pid>/task/*/schedstat`) and the host's CPU pressure (`/proc/pressure/cpu`) every
100 ms, and reads `INFO commandstats` and `SLOWLOG` before and after: the server's time per
command, which excludes every scheduling delay.

The summary (stdout, `--out`): per worker, the calls, the errors by kind, latency
percentiles, and for each call over 100 ms what its time went to; redis-server's run-queue
wait percentiles per 100 ms window; the log lines of the issue (results not stored, lookups
failed, L2 outages) counted in the workers' logs. Needs the stack (`bash compose/stack.sh up`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SLOW_S = 0.1


def _run_delay_ns(path: str = "/proc/thread-self/schedstat") -> int:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class _Lag:
    """A thread that sleeps `period_s` in a loop; per wake-up: how late, and how much of that
    was the run queue (the rest is the GIL, plus timer slack)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.events: list[tuple[float, float, float]] = []  # (woke at, late s, run-queue s)
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="redis-probe-lag", daemon=True).start()

    def _run(self) -> None:
        while True:
            rd0 = _run_delay_ns()
            t0 = time.monotonic()
            time.sleep(self.period_s)
            t1 = time.monotonic()
            late = t1 - t0 - self.period_s
            if late > 0.005:
                rq = (_run_delay_ns() - rd0) / 1e9
                with self._lock:
                    self.events.append((t1, late, rq))
                    del self.events[:-5000]

    def worst(self, start: float, end: float) -> tuple[float, float]:
        """(max lateness, max GIL part) of the wake-ups within [start, end + 10 ms]."""
        late = gil = 0.0
        with self._lock:
            for t, lt, rq in reversed(self.events):
                if t < start:
                    break
                if t <= end + 0.01:
                    late, gil = max(late, lt), max(gil, lt - rq)
        return late, gil


def instrument(path: str) -> None:
    """Wrap redis-py's command paths so each call is recorded to `path` (JSON lines)."""
    import redis.client

    lag = _Lag()
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the process)
    lock = threading.Lock()

    def record(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        cpu0, rd0, t0 = time.thread_time(), _run_delay_ns(), time.monotonic()
        error = ""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            t1 = time.monotonic()
            row: dict[str, Any] = {
                "t": round(t0, 4),
                "cmd": name,
                "thread": threading.current_thread().name,
                "wall_ms": round((t1 - t0) * 1e3, 2),
                "cpu_ms": round((time.thread_time() - cpu0) * 1e3, 2),
                "runq_ms": round((_run_delay_ns() - rd0) / 1e6, 2),
                "error": error,
            }
            if t1 - t0 > SLOW_S or error:
                late, gil = lag.worst(t0, t1)
                row["lag_ms"], row["gil_ms"] = round(late * 1e3, 1), round(gil * 1e3, 1)
            with lock:
                out.write(json.dumps(row) + "\n")

    execute_command = redis.client.Redis.execute_command
    pipeline_execute = redis.client.Pipeline.execute

    def wrapped_execute(self: Any, *args: Any, **options: Any) -> Any:
        if isinstance(self, redis.client.Pipeline):  # a pipeline only buffers here
            return execute_command(self, *args, **options)
        return record(str(args[0]), execute_command, self, *args, **options)

    def wrapped_pipeline(self: Any, *args: Any, **kwargs: Any) -> Any:
        return record(
            f"PIPELINE[{len(self.command_stack)}]", pipeline_execute, self, *args, **kwargs
        )

    redis.client.Redis.execute_command = wrapped_execute  # type: ignore[method-assign]
    redis.client.Pipeline.execute = wrapped_pipeline  # type: ignore[method-assign]


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))], 2)

    return {"n": len(s), "p50": at(0.5), "p99": at(0.99), "p999": at(0.999), "max": s[-1]}


def _redis_pid() -> int:
    out = subprocess.run(["pgrep", "-x", "redis-server"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def _redis_info(client: Any) -> dict[str, Any]:
    stats = client.info("commandstats")
    keep = ("cmdstat_get", "cmdstat_set", "cmdstat_mget", "cmdstat_ping")
    return {k: {"calls": v["calls"], "usec": v["usec"]} for k, v in stats.items() if k in keep}


class _ServerSampler:
    """redis-server's run-queue wait (all its threads) and the host's CPU pressure, per 100 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.runq_ms: list[float] = []
        self.psi_some_pct: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _server_run_delay(self) -> int:
        total = 0
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            total += _run_delay_ns(f"/proc/{self.pid}/task/{tid}/schedstat")
        return total

    @staticmethod
    def _psi_total_us() -> int:
        with open("/proc/pressure/cpu", encoding="ascii") as f:
            return int(f.readline().split("total=")[1])

    def _run(self) -> None:
        rd, psi, t = self._server_run_delay(), self._psi_total_us(), time.monotonic()
        while not self._stop.wait(0.1):
            rd2, psi2, t2 = self._server_run_delay(), self._psi_total_us(), time.monotonic()
            self.runq_ms.append((rd2 - rd) / 1e6)
            self.psi_some_pct.append(100 * (psi2 - psi) / 1e6 / (t2 - t))
            rd, psi, t = rd2, psi2, t2

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {
            "redis_runq_ms_per_100ms": _percentiles(self.runq_ms),
            "windows_redis_waited_over_50ms": sum(1 for v in self.runq_ms if v > 50),
            "cpu_pressure_some_pct": _percentiles(self.psi_some_pct),
        }


def _summarize_calls(path: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    errors: dict[str, int] = {}
    for r in rows:
        if r["error"]:
            key = r["error"].split(":")[0] + (" (timeout)" if "Timeout" in r["error"] else "")
            errors[key] = errors.get(key, 0) + 1
    slow = [r for r in rows if r["wall_ms"] > SLOW_S * 1e3]
    return {
        "calls": len(rows),
        "errors": errors,
        "timeouts": sum(1 for r in rows if "Timeout" in r["error"]),
        "wall_ms": _percentiles([r["wall_ms"] for r in rows]),
        "slow_calls": len(slow),
        "slow_wall_ms": _percentiles([r["wall_ms"] for r in slow]),
        "slow_cpu_ms": _percentiles([r["cpu_ms"] for r in slow]),
        "slow_runq_ms": _percentiles([r["runq_ms"] for r in slow]),
        "slow_gil_ms": _percentiles([r.get("gil_ms", 0.0) for r in slow]),
        "slow_examples": slow[:12],
    }


def _log_counts(text: str) -> dict[str, int]:
    return {
        "results_not_stored": text.count(" not stored"),  # "not stored:" / "not stored yet"
        "lookups_failed": text.count("result store lookup failed"),
        "l2_outages": text.count("L2 translation cache unreachable"),
        "l2_back": text.count("L2 translation cache reachable again"),
        "store_retried": text.count("stored on retry"),
    }


def _wait_assigned(procs: list[tuple[subprocess.Popen[bytes], Path]], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for proc, log in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited {proc.returncode}; see {log}")
        if all("assigned [" in log.read_text(errors="replace") for _, log in procs):
            time.sleep(5.0)
            return
        time.sleep(1.0)
    raise RuntimeError("workers not assigned in time")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from bench._common import cpu_model
    from topics.admin import ensure_topics
    from topics.catalog import catalog

    langs = [part.split("=")[0] for part in args.rate.split(",")]
    prefix = f"rprobe{uuid.uuid4().hex[:6]}."
    group = f"{prefix}workers"
    ensure_topics(args.bootstrap, catalog(langs, partitions=4, prefix=prefix))
    tmp = Path(args.logs or tempfile.mkdtemp(prefix="tolk-rprobe-"))
    tmp.mkdir(parents=True, exist_ok=True)
    client = redis.Redis.from_url(args.redis_url)
    procs = []
    for k in range(args.workers):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "TOLK_BOOTSTRAP": args.bootstrap,
            "TOLK_REDIS_URL": args.redis_url,
            "TOLK_TOPIC_PREFIX": prefix,
            "TOLK_GROUP_ID": group,
            "TOLK_WORKER_ID": f"rprobe-{k}",
            "TOLK_LANGUAGES": ",".join(langs),
            "TOLK_HEALTH_PORT": "0",
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "bench.redis_probe",
            "--as-worker",
            str(tmp / f"calls-{k}.jsonl"),
        ]
        cmd += ["worker", "--model", args.model, "--metrics-port", "0"]
        log = tmp / f"worker-{k}.log"
        with log.open("wb") as f:
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=f), log))
    load_env = {**os.environ, "PYTHONPATH": str(REPO), "TOLK_TOPIC_PREFIX": prefix}
    try:
        _wait_assigned(procs, args.start_timeout_s)
        before = _redis_info(client)
        client.slowlog_reset()
        sampler = _ServerSampler(_redis_pid())
        load1 = os.getloadavg()
        cmd = [sys.executable, "-m", "workers.cli", "load", "--rate", args.rate]
        cmd += ["--duration", str(args.seconds), "--out", str(tmp / "load"), "--metrics-port", "0"]
        subprocess.run(cmd, cwd=REPO, env=load_env, check=False, capture_output=True)
        load2 = os.getloadavg()
        server = sampler.stop()
        after = _redis_info(client)
        slowlog: Any = client.slowlog_get(10)
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    server_cmds = {
        k: {
            "calls": after[k]["calls"] - before.get(k, {"calls": 0})["calls"],
            "usec_per_call": round(
                (after[k]["usec"] - before.get(k, {"usec": 0})["usec"])
                / max(1, after[k]["calls"] - before.get(k, {"calls": 0})["calls"]),
                2,
            ),
        }
        for k in after
    }
    load_summary = json.loads((tmp / "load" / "summary.json").read_text())
    return {
        "bench": "redis_probe",
        "command": "python -m bench.redis_probe " + " ".join(args.argv),
        "cpu": cpu_model(),
        "loadavg_start": load1,
        "loadavg_end": load2,
        "load": load_summary,
        "server": {**server, "commandstats": server_cmds, "slowlog": [str(s) for s in slowlog]},
        "workers": [
            {
                "calls": _summarize_calls(tmp / f"calls-{k}.jsonl"),
                "log": _log_counts(log.read_text(errors="replace")),
            }
            for k, (_, log) in enumerate(procs)
        ],
        "logs": str(tmp),
    }


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--as-worker"]:
        instrument(argv[1])
        from workers.cli import app

        app(argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--rate", default="de=1,en=1")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bootstrap", default=os.environ.get("TOLK_BOOTSTRAP", "127.0.0.1:9092"))
    p.add_argument(
        "--redis-url", default=os.environ.get("TOLK_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--logs", default=None, help="directory for the workers' logs and call records")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = argv
    result = run(args)
    from bench._common import dump, write_json

    print(dump(result))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
