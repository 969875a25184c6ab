"""The canary guard's drill with real workers at a 5 % start (issue #29, Done-when 2).

    python -m bench.guard_drill --runs 3 --out bench/out/guard-drill.json

Per run, on the local stack (`bash compose/stack.sh up`), topics under a fresh prefix:

* two `tolk worker` processes, `--arm stable` and `--arm v2`, the real engine (SmolLM2-135M
  by default, an 8-token output cap, one OpenMP thread each, `--no-cache`); the canary with
  `--drill-inject-latency de:1.0:15000` (every German reply held 15 s; French untouched);
* `tolk guard` with its **defaults**: sequential decisions, 30 s windows, margins 0.05 on
  the rate of bad replies and of replies over the SLO, alpha 0.05 split over the languages,
  `min_step_s` 60; the languages' default SLOs (de 2 s, fr 3 s);
* warm-up turns addressed to each arm, then `tolk rollout start --arm v2 --languages de,fr
  --share 5` (default steps 5, 25, 50, 100) and an open-loop sender of English support
  turns (`--rate de=1,fr=5`, requests/s) over `--conversations` per language of which
  exactly 5 % hash to the canary at the start;
* the run ends when German and French are both decided (rolled back or complete) or after
  `--max-minutes`; then every request is waited for.

Figures per run, from the guard's rollout events (`decided_at`, the canary's step counts):
German's rollback time after the rollout's START and the canary replies it took; French's
promotions (time, share, canary replies of the step); false rollbacks; sent / answered /
lost / duplicates, routing checked against the shares in force; P50/P95 per language and arm.

Why `--faithful-policy flag` by default: the guard counts withheld answers as bad, and
SmolLM2 with an 8-token cap withholds some answers on both arms alike; non-inferiority within
0.05 at a base rate of ~10 % needs several hundred canary replies a step, at 1 % about 150. A
flagged answer is sent, so what is bad here is what fails (errors, expired deadlines). The
sequential rule's counts of withheld answers are exercised by bench/guard_sim.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench._common import dump, machine_info, write_json
from bench.rollout_drill import (
    CANARY,
    REPO,
    STABLE,
    OpenLoopSender,
    ReplyReader,
    ToolProcess,
    arm_of_replies,
    balanced_conversations,
    check_arm_changes,
    check_routing,
    latency_summary,
)

DONE = {"ROLLBACK", "COMPLETE"}


def parse_rates(text: str) -> dict[str, float]:
    """'de=1,fr=5' -> {'de': 1.0, 'fr': 5.0}."""
    out = {}
    for part in text.split(","):
        lang, _, rate = part.partition("=")
        out[lang.strip()] = float(rate)
    return out


def step_counts(event: Mapping[str, Any]) -> dict[str, int]:
    """The step's counts an event carries (sequential mode)."""
    figs = event.get("figures") or {}
    names = ("canary_requests", "canary_bad", "canary_slow", "stable_requests")
    return {n: int(figs.get(f"step_{n}", 0)) for n in names}


def summarize_events(events: list[dict[str, Any]], started_ms: int) -> dict[str, Any]:
    """Per language: its share changes (seconds after START, share, the step's counts at the
    decision, the reasons) and how it ended."""
    out: dict[str, Any] = {}
    for lang in sorted({str(e["language"]) for e in events}):
        mine = [e for e in events if e["language"] == lang and e["window_start"] is not None]
        changes = [
            {
                "action": e["action"], "after_s": round((e["decided_at"] - started_ms) / 1000, 1),
                "share_before": e["share_before"], "share_after": e["share_after"],
                **step_counts(e), "reasons": e["reasons"],
            }
            for e in mine if e["share_after"] != e["share_before"]
        ]  # fmt: skip
        ends = [e["action"] for e in mine if e["action"] in DONE]
        out[lang] = {"outcome": ends[0] if ends else "undecided", "windows": len(mine),
                     "changes": changes}  # fmt: skip
    return out


def one_run(args: argparse.Namespace, k: int, logs: Path) -> dict[str, Any]:
    """One drill (see the module docstring); its figures."""
    from topics.admin import ensure_topics
    from topics.catalog import REPLIES, arm_control_topic, catalog, rollout_events_topic
    from workers.guard.events import read_events
    from workers.kafka.arm_control import publish_shares

    run = uuid.uuid4().hex[:8]
    prefix = f"drill-{run}."
    langs = tuple(args.rates)
    kafka = {"bootstrap.servers": args.bootstrap}
    ensure_topics(args.bootstrap, catalog(langs, partitions=2, prefix=prefix), timeout=30)
    env = {
        "TOLK_BOOTSTRAP": args.bootstrap, "TOLK_REDIS_URL": args.redis_url,
        "TOLK_TOPIC_PREFIX": prefix, "TOLK_GROUP_ID": f"tolk-drill-{run}",
        "TOLK_LANGUAGES": ",".join(langs), "TOLK_POLICIES": args.policies,
        "TOLK_HEALTH_PORT": "0", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    for lang in langs:  # before the rollout the stable arm serves everything
        publish_shares(kafka, arm_control_topic(prefix), lang, {STABLE: 100.0})
    worker = ["worker", "--model", args.model, "--metrics-port", "0", "--no-cache"]
    worker += ["--faithful-policy", args.faithful_policy]
    procs = {
        STABLE: ToolProcess([*worker, "--arm", STABLE], {**env, "TOLK_WORKER_ID": f"s-{run}"},
                            logs / f"{k}-stable.log"),
        CANARY: ToolProcess([*worker, "--arm", CANARY, "--drill-inject-latency", args.drill],
                            {**env, "TOLK_WORKER_ID": f"c-{run}"}, logs / f"{k}-v2.log"),
        "guard": ToolProcess(["guard", "--app-id", f"guard-{run}", "--metrics-port", "0",
                              "--datadir", str(logs / f"{k}-guard-data")], env,
                             logs / f"{k}-guard.log"),
    }  # fmt: skip
    reader = ReplyReader(args.bootstrap, prefix + REPLIES)
    conversations = {
        lang: balanced_conversations(run, lang, args.conversations, args.share) for lang in langs
    }
    sender = OpenLoopSender(args.bootstrap, prefix, run, args.rates, conversations)

    def events() -> list[dict[str, Any]]:
        return read_events(kafka, rollout_events_topic(prefix))

    t0 = time.monotonic()
    failure, startup_s, undelivered = None, 0.0, -1
    try:
        for arm in (STABLE, CANARY):
            procs[arm].wait_for_line(r"\bassigned \[\(", timeout=300)
        procs["guard"].wait_for_line(r"Ready", timeout=120)
        warm = sender.warm_up((STABLE, CANARY), per_arm=3)
        if not _wait(lambda: set(reader.replies()) >= warm, 180):
            raise RuntimeError("the warm-up turns were not answered within 180 s")
        startup_s = time.monotonic() - t0
        start = subprocess.run(
            [sys.executable, "-m", "workers.cli", "rollout", "start", "--arm", CANARY,
             "--languages", ",".join(langs), "--share", f"{args.share:g}"],
            cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if start.returncode != 0:
            raise RuntimeError(start.stdout + start.stderr)
        sender.start()
        ended = _wait(
            lambda: {str(e["language"]) for e in events() if e["action"] in DONE} >= set(langs),
            args.max_minutes * 60,
        )
        if not ended:
            failure = f"not every language decided within {args.max_minutes} min"
        time.sleep(3.0)  # requests after the last change
        undelivered = sender.stop()
        _wait(lambda: set(reader.replies()) >= set(sender.sent), 180)
        time.sleep(1.0)  # a late duplicate would show now
    except Exception as exc:  # a process that did not start, a broker error: said in the JSON
        failure = f"{type(exc).__name__}: {exc}"[-3000:]
    finally:
        sender.stop()
        for proc in procs.values():
            proc.stop()
        reader.close()
    return _figures(args, sender.sent, reader.replies(), events(), startup_s, undelivered, failure)


def _wait(done: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if done():
            return True
        time.sleep(1.0)
    return bool(done())


def _figures(
    args: argparse.Namespace,
    sent: dict[str, tuple[str, str, float]],
    got: dict[str, list[dict[str, Any]]],
    events: list[dict[str, Any]],
    startup_s: float,
    undelivered: int,
    failure: str | None,
) -> dict[str, Any]:
    starts = [e for e in events if e["action"] == "START"]
    started_ms = int(min(e["decided_at"] for e in starts)) if starts else 0
    arms_of = arm_of_replies(got)
    arm_of = {rid: min(arms_of[rid]) for rid in sent if rid in got}
    out: dict[str, Any] = {
        "startup_s": round(startup_s, 1),
        "languages": summarize_events(events, started_ms),
        "sent": len(sent), "answered": len(set(sent) & set(got)), "undelivered": undelivered,
        "lost": len(set(sent) - set(got)), "duplicates": sum(len(r) - 1 for r in got.values()),
        "two_arms": sum(1 for arms in arms_of.values() if len(arms) > 1),
        "by_arm": {a: sum(1 for x in arm_of.values() if x == a) for a in (STABLE, CANARY)},
        "latency": latency_summary(sent, got),
        "load_avg_1m": round(os.getloadavg()[0], 2), "failure": failure,
    }  # fmt: skip
    try:
        out["arm_changes"] = check_arm_changes(sent, arm_of, events)
        out["routed_as_shares_say"] = check_routing(sent, arm_of, events)
    except AssertionError as exc:
        out["routing_error"] = str(exc)
    return out


def verdict(runs: list[dict[str, Any]], bad_lang: str, good_lang: str) -> dict[str, Any]:
    """Over the runs: rolled back / promoted as the drill expects, false rollbacks, times."""

    def first(run: dict[str, Any], lang: str, action: str) -> float | None:
        changes = run["languages"].get(lang, {}).get("changes", [])
        return next((c["after_s"] for c in changes if c["action"] == action), None)

    return {
        "runs": len(runs),
        f"{bad_lang}_rolled_back": sum(r["languages"].get(bad_lang, {}).get("outcome") == "ROLLBACK"
                                       for r in runs),
        f"{good_lang}_completed": sum(r["languages"].get(good_lang, {}).get("outcome")
                                      == "COMPLETE" for r in runs),
        "false_rollbacks": sum(first(r, good_lang, "ROLLBACK") is not None for r in runs),
        f"{bad_lang}_rollback_after_s": [first(r, bad_lang, "ROLLBACK") for r in runs],
        f"{good_lang}_complete_after_s": [first(r, good_lang, "COMPLETE") for r in runs],
        "lost": sum(r["lost"] for r in runs), "duplicates": sum(r["duplicates"] for r in runs),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--share", type=float, default=5.0, help="the canary's start share, percent")
    p.add_argument("--rate", dest="rates", type=parse_rates, default=parse_rates("de=1,fr=5"))
    p.add_argument("--conversations", type=int, default=200, help="per language")
    p.add_argument("--drill", default="de:1.0:15000", help="the canary's injected latency")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default="de:4:2:256:8,fr:3:3:256:8",
                   help="TOLK_POLICIES: the default SLOs, an 8-token output cap")  # fmt: skip
    p.add_argument("--faithful-policy", default="flag")
    p.add_argument("--max-minutes", type=float, default=40.0, help="per run")
    p.add_argument("--bootstrap", default=os.environ.get("TOLK_BOOTSTRAP", "127.0.0.1:9092"))
    p.add_argument(
        "--redis-url", default=os.environ.get("TOLK_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument("--logs", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="guard-drill-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(args.runs):
        runs.append(one_run(args, k, logs))
        print(f"[drill] run {k}: {dump(runs[-1]['languages'])}", file=sys.stderr, flush=True)
    bad_lang = args.drill.split(":")[0]
    good = [lang for lang in args.rates if lang != bad_lang]
    result = {
        "bench": "guard_drill", "machine": machine_info(threads=1), "logs": str(logs),
        "settings": {k: v for k, v in vars(args).items() if k not in ("logs", "out")},
        "summary": verdict(runs, bad_lang, good[0]) if good else {}, "runs": runs,
    }  # fmt: skip
    print(dump(result))
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
