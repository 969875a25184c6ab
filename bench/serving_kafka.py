"""The serving benchmark's Kafka side: a `tolk worker` process, and the open-loop sender.

* `start_tolk_worker` runs `python -m workers.cli worker` (the `tolk worker` command, with
  this checkout's code) on fresh topics under a fresh prefix and consumer group, and returns
  once it logged its partition assignment (its start-up time is part of the result). The
  translation cache is off by default (`--no-cache`): the texts repeat across rates and
  repeats, and an exact-match hit would measure Redis, not serving. The output cap is the
  benchmark's (64 tokens, the same as llama-server's `n_predict`), set through
  `TOLK_POLICIES` with the default weights, SLOs and queue limits kept.
* `drive_bridge` sends a schedule through `workers.loadtest.bridge.KafkaBridge` (the load
  test's client: project `TranslationClient` on its own loop thread, latency from the
  scheduled send time) and turns every offered request into an `Outcome`: a request with no
  reply is a TIMEOUT, an answer the faithfulness checks withheld is WITHHELD.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.serving_stats import Outcome, stage_split
from workers.loadtest.bridge import Completion, KafkaBridge

__all__ = [
    "completion_outcome",
    "drive_bridge",
    "scrape_cascade_outcomes",
    "scrape_step_kinds",
    "start_hog",
    "start_tolk_worker",
    "step_kinds_between",
    "stop_process",
    "wait_tuned",
]

REPO = Path(__file__).resolve().parents[1]


def tolk_policies(languages: Sequence[str], max_new_tokens: int) -> str:
    """TOLK_POLICIES that keep the default weight, SLO and queue limit of each language and
    set only its output cap."""
    from workers.fairness.policy import DEFAULT_MAX_QUEUE, DEFAULT_POLICIES

    parts = []
    for lang in languages:
        p = DEFAULT_POLICIES.get(lang)
        weight, slo, queue = (
            (p.weight, p.slo_p99_s, p.max_queue) if p else (1.0, 5.0, DEFAULT_MAX_QUEUE)
        )
        parts.append(f"{lang}:{weight:g}:{slo:g}:{queue}:{max_new_tokens}")
    return ",".join(parts)


def start_tolk_worker(
    *,
    bootstrap: str,
    redis_url: str,
    prefix: str,
    languages: Sequence[str],
    model: str,
    max_new_tokens: int,
    worker_args: Sequence[str],
    log_path: Path,
    timeout_s: float = 900.0,
    metrics_port: int = 0,
    env_extra: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], float]:
    """(process, seconds from process start to its partition assignment); `metrics_port`: its
    Prometheus endpoint (0: none); `env_extra`: more environment (TOLK_CACHE_DIR, say)."""
    env = {
        **os.environ,
        **(env_extra or {}),
        "TOLK_BOOTSTRAP": bootstrap,
        "TOLK_REDIS_URL": redis_url,
        "TOLK_TOPIC_PREFIX": prefix,
        "TOLK_GROUP_ID": f"{prefix}workers",
        "TOLK_WORKER_ID": f"{prefix}worker",
        "TOLK_LANGUAGES": ",".join(languages),
        "TOLK_POLICIES": tolk_policies(languages, max_new_tokens),
        "TOLK_HEALTH_PORT": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", model]
    cmd += ["--metrics-port", str(metrics_port)]
    cmd += list(worker_args)
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    end = t0 + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"tolk worker exited {proc.returncode}; see {log_path}")
        if "assigned [" in log_path.read_text(errors="replace"):
            return proc, time.monotonic() - t0
        time.sleep(0.5)
    stop_process(proc)
    raise RuntimeError(f"tolk worker not assigned within {timeout_s:.0f} s; see {log_path}")


def wait_compiled(
    proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 900.0
) -> float | None:
    """Seconds until a worker that compiles its decode graphs in the background has them
    (None: it compiles nothing). The worker serves eagerly until then (workers/engine/
    compiled.py); a measurement of its steady state starts after this, as llama-server's does
    after its model load. A failed compilation (the worker stays eager) also ends the wait."""
    t0 = time.monotonic()
    end = t0 + timeout_s
    while time.monotonic() < end:
        text = log_path.read_text(errors="replace")
        start = text.find("compiling decode graphs in the background")
        if start < 0:
            return None
        after = text[start:]  # (the start-up probe may have compiled before: its lines are earlier)
        if "compiled decode graphs for batch sizes" in after or "graphs failed" in after:
            return time.monotonic() - t0
        if proc.poll() is not None:
            raise RuntimeError(f"tolk worker exited {proc.returncode}; see {log_path}")
        time.sleep(0.5)
    raise RuntimeError(f"tolk worker's decode graphs not compiled within {timeout_s:.0f} s")


def wait_tuned(
    proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 1800.0
) -> tuple[float, str] | None:
    """(seconds, the configuration it serves) once a worker whose tuner probes in the
    background (workers/engine/tuner.py: a start with no stored probe) has moved to the probe's
    choice or kept its own; None when its tuner did not probe (a stored probe, or flags)."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + timeout_s:
        text = log_path.read_text(errors="replace")
        start = text.find("config tuner: probing")
        if start < 0:
            if "consuming" in text and "chosen without measuring" not in text:
                return None
            if proc.poll() is not None:
                raise RuntimeError(f"tolk worker exited {proc.returncode}; see {log_path}")
            time.sleep(0.5)
            continue
        after = text[start:]
        for marker in ("config tuner: switched ", "config tuner: keeping "):
            at = after.find(marker)
            if at >= 0:
                line = after[at + len(marker) :].split("\n", 1)[0]
                # "int8 -> int8+compiled: why (now: ...)" or "int8+compiled (why)"
                label = line.split(":", 1)[0].split(" -> ")[-1].split(" (", 1)[0].strip()
                return time.monotonic() - t0, label
        if "the probe failed" in after:
            return time.monotonic() - t0, "probe failed"
        if proc.poll() is not None:
            raise RuntimeError(f"tolk worker exited {proc.returncode}; see {log_path}")
        time.sleep(0.5)
    raise RuntimeError(f"tolk worker's tuner did not settle within {timeout_s:.0f} s")


def start_hog(seconds: float) -> subprocess.Popen[bytes]:
    """A busy loop on one core for `seconds` (the issue #47 bench's "other work on the host")."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def _metric_samples(url: str) -> list[Any]:
    """The samples of the worker's /metrics page; [] when the endpoint does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return []
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape_step_kinds(url: str) -> dict[str, tuple[float, float]]:
    """The worker's model steps by kind from its /metrics: {kind: (steps, seconds)},
    cumulative; {} when the endpoint does not answer."""
    out: dict[str, list[float]] = {}
    for sample in _metric_samples(url):
        col = {"tolk_engine_kind_steps_total": 0, "tolk_engine_step_seconds_total": 1}.get(
            sample.name
        )
        if col is not None:
            out.setdefault(sample.labels["kind"], [0.0, 0.0])[col] = sample.value
    return {kind: (v[0], v[1]) for kind, v in out.items()}


def scrape_cascade_outcomes(url: str) -> dict[str, float]:
    """The cascade's outcomes so far (`tolk_cascade_outcomes_total`, summed over languages):
    {outcome: count}, cumulative; {} without a cascade or an answer."""
    out: dict[str, float] = {}
    for sample in _metric_samples(url):
        if sample.name == "tolk_cascade_outcomes_total":
            outcome = sample.labels["outcome"]
            out[outcome] = out.get(outcome, 0.0) + sample.value
    return out


def step_kinds_between(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Steps of each kind run between two scrapes and their mean time (ms)."""
    out: dict[str, dict[str, float]] = {}
    for kind, (steps, seconds) in after.items():
        n = steps - before.get(kind, (0.0, 0.0))[0]
        s = seconds - before.get(kind, (0.0, 0.0))[1]
        if n > 0:
            out[kind] = {"steps": int(n), "mean_ms": round(1e3 * s / n, 2)}
    return out


def stop_process(proc: subprocess.Popen[bytes] | None, wait_s: float = 60.0) -> None:
    """SIGTERM (a worker drains), then SIGKILL after `wait_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def completion_outcome(c: Completion) -> Outcome:
    """A finished request of the bridge as an outcome (see the module notes)."""
    status = "WITHHELD" if c.withheld else c.status
    replied = status not in ("TIMEOUT", "NOT_DELIVERED")
    ttft = c.latency_s - c.decode_s if status == "OK" and c.decode_s is not None else None
    return Outcome(
        lang=c.lang,
        status=status,
        latency_s=c.latency_s if replied else None,
        ttft_s=ttft,
        tokens_out=c.tokens_out,
        send_lag_s=c.send_lag_s,
        stages=stage_split(c.latency_s, c.worker_s) if status == "OK" else {},
    )


def drive_bridge(
    bridge: KafkaBridge,
    requests: Sequence[tuple[float, str, str, str]],
    *,
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    """Send `requests` ((offset_s, target, source, text), time-ordered) at their offsets from
    now, wait for the replies (up to `timeout_s` + 5 s after the last send); returns one
    outcome per offered request and the sending window (s)."""
    bridge.drain()  # nothing of an earlier run counts here
    t0 = time.monotonic() + 0.05
    for offset, tgt, src, text in requests:
        delay = t0 + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        bridge.send(tgt, src, text, t0 + offset)
    window = time.monotonic() - t0
    end = time.monotonic() + timeout_s + 5.0
    while bridge.outstanding and time.monotonic() < end:
        time.sleep(0.05)
    outcomes = [completion_outcome(c) for c in bridge.drain()]
    return outcomes + missing_as_timeouts(requests, outcomes), window


def missing_as_timeouts(
    requests: Sequence[tuple[float, str, str, str]], outcomes: Sequence[Outcome]
) -> list[Outcome]:
    """A TIMEOUT for every offered request that has no outcome (per language)."""
    offered: dict[str, int] = {}
    for _, tgt, _, _ in requests:
        offered[tgt] = offered.get(tgt, 0) + 1
    seen: Mapping[str, int] = {lang: sum(1 for o in outcomes if o.lang == lang) for lang in offered}
    return [
        Outcome(lang, "TIMEOUT", None)
        for lang, n in offered.items()
        for _ in range(max(0, n - seen[lang]))
    ]
