"""Helpers shared by the benchmarks: timing, medians, peak RSS, machine info, JSON output and
the parent/worker subprocess protocol.

Every benchmark runs each system in its own subprocess (`--worker ...`) so that peak RSS is the
worker's own (`ru_maxrss` only grows, so one process per system x model) and so that one
system's allocator, thread pools or OpenMP settings never leak into another's numbers. A worker
prints exactly one JSON object on its last stdout line; logs go to stderr.

Nothing here imports torch at import time: `--help` stays instant.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

JSON = dict[str, Any]


def parse_csv(value: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_ints(value: str) -> list[int]:
    return [int(v) for v in parse_csv(value)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize(values: Sequence[float], digits: int = 4) -> JSON:
    """Median plus spread of repeated measurements (all raw values kept for the record)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": round(median(vals), digits),
        "min": round(min(vals), digits),
        "max": round(max(vals), digits),
        "n": len(vals),
        "values": [round(v, digits) for v in vals],
    }


def safe_ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, digits)


@contextmanager
def timer() -> Iterator[Callable[[], float]]:
    """`with timer() as elapsed: ...; elapsed()` -> seconds since entry (perf_counter)."""
    t0 = time.perf_counter()
    yield lambda: time.perf_counter() - t0


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024  # macOS reports bytes
    return round(kib / scale, 1)


def cpu_model() -> str:
    """The CPU as a reader needs it to compare figures: model name, vendor, family and model
    number (a VM may report only "AMD EPYC"; family 25 is Zen 3/4, 26 Zen 5)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "vendor_id", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    vendor = fields.get("vendor_id")
    if vendor:
        family, model = fields.get("cpu family", "?"), fields.get("model", "?")
        name += f" ({vendor}, family {family} model {model})"
    return name


def cpu_flags() -> list[str]:
    """The SIMD flags that decide which kernels torch / llama.cpp can use."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "fma")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def machine_info(threads: int | None = None) -> JSON:
    """Where the numbers were taken. Heavy libraries are reported only if already imported."""
    info: JSON = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "threads": threads,
    }
    for mod, key in (("torch", "torch"), ("transformers", "transformers")):
        m = sys.modules.get(mod)
        if m is not None:
            info[key] = getattr(m, "__version__", None)
    return info


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


def write_json(obj: Any, path: str | os.PathLike[str] | None) -> None:
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump(obj) + "\n")


def emit_worker_result(obj: JSON) -> None:
    """The worker's single result line (the parent reads the last JSON line of stdout)."""
    obj.setdefault("peak_rss_mb", peak_rss_mb())
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def run_worker(
    module: str,
    args: Sequence[str],
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> JSON:
    """Run `python -m module *args` and return its JSON result line.

    A crash, timeout or missing result becomes `{"error": ...}` so one broken system never
    loses the rest of the run. stderr passes through to ours (progress logs).
    """
    cmd = [sys.executable, "-m", module, *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s", "cmd": cmd}
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(proc.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result: JSON = json.loads(line)
            except json.JSONDecodeError:
                continue
            result.setdefault("worker_wall_s", wall)
            if proc.returncode != 0:
                result.setdefault("error", f"worker exited {proc.returncode}")
            return result
    return {"error": f"worker exited {proc.returncode} without a result", "cmd": cmd}


def thread_env(threads: int) -> dict[str, str]:
    """Environment that pins OpenMP / BLAS pools to `threads` in a worker subprocess."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}
