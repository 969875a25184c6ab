"""The worker process of the fault and scale-out tests: `workers.worker.Worker` in a process.

Run as ``python -m tests.faults.worker_main '<json>'`` from the repository root (the harness's
`WorkerProcess` does). It is a real process, so the tests can SIGKILL it: no `finally`, no
flush, no commit, no leaving the group. The engine is `tests.workers.fakes.FakeEngine` with a
small delay per batch, so requests are in flight when a fault hits, without a model's start-up
cost or CPU time (the machine running the suite has two cores); or, with `model`, the real
engine on that preset (float32 on CPU, warmed before the worker starts).

Arguments (one JSON object): bootstrap, redis, group, languages, prefix, worker_id, delay_s,
session_timeout_ms, metrics_port (0 = none), group_instance_id (optional: static membership,
so a restarted process takes its partitions back at once instead of after the dead member's
session timeout), model, max_new_tokens and pack_weights (optional: the real engine, e.g.
"smollm2-135m", its output cap, default 32, and whether it probes and packs its projection
GEMMs, default true), settings (extra `Settings` fields; an unknown one is an error) and
hold_until (optional: a path; the process loads and warms its engine, prints ``READY``, and
joins the group only once that path exists: a test can add a worker mid-run without its
model's start-up, which takes a minute on two loaded cores, in the middle of the load).

The process prints ``ASSIGNED`` on stdout once its first partitions are assigned and runs the
worker on its main thread (SIGTERM drains and exits 0).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer

from tests.workers.fakes import FAKE_LANGUAGES, FakeEngine
from workers.engine.types import TranslationEngine
from workers.fairness.policy import LanguagePolicy
from workers.settings import Settings
from workers.worker import Worker


def build_settings(args: dict[str, Any]) -> Settings:
    langs = tuple(args["languages"])
    known = {f.name for f in dataclasses.fields(Settings)}
    extra = dict(args.get("settings", {}))
    unknown = sorted(set(extra) - known)
    if unknown:  # a typo in a test must not run the worker with defaults silently
        raise SystemExit(f"worker_main: Settings has no field(s) {unknown}")
    return Settings(
        bootstrap=args["bootstrap"],
        redis_url=args["redis"],
        group_id=args["group"],
        languages=langs,
        topic_prefix=args["prefix"],
        metrics_port=int(args.get("metrics_port", 0)),
        worker_id=args["worker_id"],
        session_timeout_ms=int(args.get("session_timeout_ms", 6000)),
        drain_timeout_s=5.0,
        policies={
            lang: LanguagePolicy(1.0, 30.0, 512, int(args.get("max_new_tokens", 32)))
            for lang in langs
        },
        **extra,
    )


def consumer_factory(instance_id: str | None) -> Any:
    if not instance_id:
        return Consumer
    return lambda conf: Consumer({**conf, "group.instance.id": instance_id})


def main(argv: list[str]) -> None:
    args = json.loads(argv[1])
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    settings = build_settings(args)
    engine: TranslationEngine
    if args.get("model"):
        from workers.engine.engine import Engine, EngineConfig

        real = Engine.from_config(
            EngineConfig(
                model=args["model"],
                kv_cache_tokens=8192,
                max_new_tokens=int(args.get("max_new_tokens", 32)),
                pack_weights=bool(args.get("pack_weights", True)),
            )
        )
        real.warm(settings.languages)
        engine = real
    else:
        langs = tuple(dict.fromkeys((*FAKE_LANGUAGES, *settings.languages)))
        engine = FakeEngine(languages=langs, delay_s=float(args.get("delay_s", 0.05)))
    if args.get("hold_until"):
        print("READY", flush=True)
        while not Path(args["hold_until"]).exists():
            time.sleep(0.05)
    worker = Worker(
        settings, engine, consumer_factory=consumer_factory(args.get("group_instance_id"))
    )

    def say_assigned() -> None:
        worker.assigned_event.wait()
        print("ASSIGNED", flush=True)

    threading.Thread(target=say_assigned, daemon=True).start()
    worker.run()


if __name__ == "__main__":
    main(sys.argv)
