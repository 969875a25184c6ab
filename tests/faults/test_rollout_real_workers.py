"""Issue #14, Done-when 1 for real: two `tolk worker` processes on the real engine, `tolk guard`
in a process, a German-only slow canary rolled back while French promotes, on the real broker.

What runs (the shared broker and redis; topics under a unique prefix, groups of their own):

* the control topic says `stable=100` for both languages (the state before any rollout);
* two `python -m workers.cli worker` processes, `--arm stable` and `--arm v2`, the real engine
  on SmolLM2-135M with an 8-token output cap (`TOLK_POLICIES`), one OpenMP thread each
  (`OMP_NUM_THREADS=1`: two workers, the guard and the producer share two cores); the canary
  with `--drill-inject-latency de:1.0:15000` (every German reply of v2 held 15 s; French
  untouched). `--no-cache`: the exact-match cache's Redis tier outlives a run, so a second run
  would be served from it instead of the model;
* `python -m workers.cli guard` (the faust app as it runs in production), 20 s windows;
* three turns per language addressed to each arm by name (`model_version` "warmup@<arm>"), so
  neither engine meets its first batches inside a judged window;
* `tolk rollout start --arm v2 --languages de,fr --share 50 --steps 50,100`;
* an open-loop producer (a fixed schedule, not paced by replies) of English customer-support
  turns (BConTrasT agent turns) to German and French, 0.5 requests/s each, over 10
  conversations per language, each conversation sticking to its arm until its language's
  shares change.

Why these numbers. The canary needs `MIN_REQUESTS` (3) replies in every window, or the window
is inconclusive and the German rollback slips a whole window past its limit. At a 5 % start it
would get 0.5 replies per 20 s window; the two real engines on a loaded 2-core machine do not
keep up with the 15-30 requests/s that 5 % would need. So the rollout starts at 50 %: 5
canary replies per language and window, from conversations chosen so that exactly half of them
hash to the canary (`balanced_conversations`; with 10 random ids the split can be 3:7). The
guard tolerates this machine's noise (`--max-latency-ratio 2 --latency-slack-ms 1000`, a
French SLO of 10 s): with five samples a window's P95 is its slowest reply, and the two
processes' latencies differ by 2x for tens of seconds when the machine is loaded (measured:
load average 12-17 from other jobs, stable P95 2-15 s). The 15 s drill stays well past that
(bad while the stable's P95 is under 14 s). French promotes after 2 good windows (50 -> 100 %).

Asserted, with timings from the rollout events: German's canary share goes to 0 within
3 windows + 5 s of the start of its first bad window; French is never rolled back, completes
once and ends at 100 % canary; every request is answered exactly once, by one arm (duplicates
counted, equal in text); each request was answered by the arm its language's shares in force
at its send time choose for its conversation, so a German conversation changes arm only at the
rollback (a French one only at its promotion). The run prints one `ROLLOUT {...}` JSON line with
the timings and the windows (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import IO, Any

import pytest
from confluent_kafka import Producer

from replay.datasets import bcontrast
from schemas.codec import decode_result, encode_request
from tests.faults.harness import percentile
from tests.faults.private_stack import REPO, last_lines
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import TopicReader
from tests.workers.polling import wait_for
from topics.admin import ensure_topics
from topics.catalog import REPLIES, arm_control_topic, catalog, request_topic, rollout_events_topic
from workers.arms import choose_arm, split_arm
from workers.guard.events import SHARE_LEAD_MS, read_events
from workers.kafka.arm_control import publish_shares, read_share_table

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

LANGS = ("de", "fr")
WINDOW_S = 20.0
MIN_REQUESTS = 3
GRACE_S = 1.0
START_SHARE = 50.0
RATE_PER_LANG = 0.5  # requests per second per language, open loop
CONVERSATIONS = 10  # per language, half of them on the canary at START_SHARE
DRILL = "de:1.0:15000"  # every German reply of the canary 15 s late
# lang:weight:slo_p99_s:max_queue:max_new_tokens: the default SLOs, an 8-token output cap
POLICIES = "de:4:2:256:8,fr:3:10:256:8"
LATENCY_SLACK_MS = 1000.0
MAX_LATENCY_RATIO = 2.0


class ToolProcess:
    """`python -m workers.cli <args>` as a child process, its output in `log_path`."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout: float) -> None:
        regex = re.compile(pattern)
        end = time.monotonic() + timeout
        while not regex.search(self.text()):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(
                    f"no /{pattern}/ in {self.log_path.name} (exit {self.proc.poll()}):\n"
                    + last_lines(self.text())
                )
            time.sleep(0.5)

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def support_turns() -> list[str]:
    """Short English customer-support turns (BConTrasT dev, the agent's side), no repeats."""
    seen: dict[str, None] = {}
    for u in bcontrast("dev"):
        if u.speaker == "agent" and 15 <= len(u.source) <= 90:
            seen.setdefault(u.source, None)
    return list(seen)


def balanced_conversations(run: str, lang: str, n: int, share: float) -> list[str]:
    """`n` conversation ids of which half go to the canary at `share` percent (the workers'
    own `choose_arm`), canary and stable alternating: every stretch of consecutive turns has
    as many canary turns as it can, so no window falls short of `MIN_REQUESTS` by chance."""
    shares = {"stable": 100.0 - share, "v2": share}
    by_arm: dict[str, list[str]] = {"stable": [], "v2": []}
    k = 0
    while min(len(ids) for ids in by_arm.values()) < n // 2:
        conv = f"{run}-{lang}-conv-{k}"
        by_arm[str(choose_arm(shares, conv))].append(conv)
        k += 1
    return [c for pair in zip(by_arm["v2"], by_arm["stable"], strict=False) for c in pair][:n]


class OpenLoopSender:
    """Sends one German and one French turn every 1/rate s on a fixed schedule (a late send
    does not push the next one back), each with a conversation id (round robin over
    `balanced_conversations`); `sent` maps request id -> (lang, conversation, send time in
    epoch seconds)."""

    def __init__(self, bootstrap: str, prefix: str, run: str, rate: float) -> None:
        self.prefix, self.run, self.rate = prefix, run, rate
        self.turns = support_turns()
        self.conversations = {
            lang: balanced_conversations(run, lang, CONVERSATIONS, START_SHARE) for lang in LANGS
        }
        self.sent: dict[str, tuple[str, str, float]] = {}
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        i = 0
        while not self._stop.is_set():
            wait = start + i / self.rate - time.monotonic()
            if wait > 0:
                self.producer.poll(min(wait, 0.05))
                continue
            for n, lang in enumerate(LANGS):
                rid = f"{self.run}-{lang}-{i}"
                conv = self.conversations[lang][i % CONVERSATIONS]
                now = time.time()
                request = {
                    "request_id": rid, "conversation_id": conv, "source_lang": "en",
                    "target_lang": lang,
                    "text": self.turns[(2 * i + n) % len(self.turns)],
                    "created_at": int(now * 1000), "deadline": None,
                    "reply_topic": self.prefix + REPLIES, "metadata": {},
                }  # fmt: skip
                topic = self.prefix + request_topic(lang)
                self.producer.produce(topic, encode_request(request), key=conv.encode())
                self.sent[rid] = (lang, conv, now)
            i += 1

    def warm_up(self, arms: tuple[str, ...], per_arm: int) -> set[str]:
        """`per_arm` turns per language addressed to each arm by name (`model_version`
        "warmup@<arm>": only that arm answers), so both engines have run before the rollout's
        first window; their request ids."""
        rids = set()
        for arm in arms:
            for lang in LANGS:
                for k in range(per_arm):
                    rid = f"{self.run}-warm-{arm}-{lang}-{k}"
                    request = {
                        "request_id": rid, "conversation_id": None, "source_lang": "en",
                        "target_lang": lang, "text": self.turns[-1 - k],
                        "created_at": int(time.time() * 1000), "deadline": None,
                        "reply_topic": self.prefix + REPLIES, "model_version": f"warmup@{arm}",
                        "metadata": {},
                    }  # fmt: skip
                    topic = self.prefix + request_topic(lang)
                    self.producer.produce(topic, encode_request(request), key=rid.encode())
                    rids.add(rid)
        self.producer.flush(30)
        return rids

    def stop(self) -> int:
        """Stop sending; the number of requests not delivered to the broker."""
        self._stop.set()
        self._thread.join(10)
        return int(self.producer.flush(30))


def share_changes(events: list[dict[str, Any]], lang: str) -> list[tuple[float, dict[str, float]]]:
    """(time the shares take effect, epoch s; the shares) of every share change of `lang`."""
    out = []
    for e in events:
        if e["language"] == lang and e["share_after"] != e["share_before"]:
            share = float(e["share_after"])
            shares = {str(e["stable_arm"]): 100.0 - share, str(e["canary_arm"]): share}
            out.append(((e["decided_at"] + SHARE_LEAD_MS) / 1000, shares))
    return out


def check_arm_changes(
    sent: dict[str, tuple[str, str, float]],
    arm_of: dict[str, str],
    events: list[dict[str, Any]],
) -> dict[str, int]:
    """Every conversation's arm changes only across a share change of its language (the two
    requests straddle the time the new shares took effect, within `slack_s`) and only to the
    arm those shares choose for it; the number of changes per language."""
    slack_s = 1.0  # record timestamps vs this process's clock; the change's produce time
    by_conv: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for rid, (lang, conv, at) in sent.items():
        by_conv[(lang, conv)].append((at, arm_of[rid]))
    changes = {lang: 0 for lang in LANGS}
    for (lang, conv), turns in by_conv.items():
        turns.sort()
        for (t0, a0), (t1, a1) in zip(turns, turns[1:], strict=False):
            if a0 == a1:
                continue
            changes[lang] += 1
            across = [
                shares for eff, shares in share_changes(events, lang)
                if t0 - slack_s <= eff <= t1 + slack_s
            ]  # fmt: skip
            assert across, f"{conv} moved {a0} -> {a1} with no share change of {lang} between"
            assert any(choose_arm(s, conv) == a1 for s in across), (conv, a0, a1, across)
    return changes


def check_routing(
    sent: dict[str, tuple[str, str, float]],
    arm_of: dict[str, str],
    events: list[dict[str, Any]],
) -> int:
    """Every request was answered by the arm its language's shares in force at its send time
    choose for its conversation (stable alone before the rollout); a request sent within
    `slack_s` of a change may have either arm. The number of requests checked."""
    slack_s = 1.0
    checked = 0
    for rid, (lang, conv, at) in sent.items():
        changes = share_changes(events, lang)
        if any(abs(at - eff) <= slack_s for eff, _ in changes):
            continue
        in_force = [shares for eff, shares in changes if eff <= at]
        shares = in_force[-1] if in_force else {"stable": 100.0}
        assert arm_of[rid] == choose_arm(shares, conv), (rid, conv, arm_of[rid], shares)
        checked += 1
    return checked


def latency_summary(
    sent: dict[str, tuple[str, str, float]], got: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, float]]:
    """Per language and arm: replies, P50 and P95 of send -> reply completed, ms."""
    by: dict[str, list[float]] = defaultdict(list)
    for rid, (lang, _, at) in sent.items():
        for reply in got.get(rid, [])[:1]:
            arm = split_arm(reply["model_version"])[1]
            by[f"{lang}/{arm}"].append(reply["completed_at"] - at * 1000)
    return {
        k: {"n": len(v), "p50_ms": round(percentile(v, 50)), "p95_ms": round(percentile(v, 95))}
        for k, v in sorted(by.items())
    }


def test_real_workers_roll_german_back_while_french_promotes(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"t-rollreal-{run}."
    kafka = {"bootstrap.servers": kafka_bootstrap}
    ensure_topics(kafka_bootstrap, catalog(LANGS, partitions=2, prefix=prefix), timeout=30)
    env = {
        "TOLK_BOOTSTRAP": kafka_bootstrap,
        "TOLK_REDIS_URL": redis_url,
        "TOLK_TOPIC_PREFIX": prefix,
        "TOLK_GROUP_ID": f"tolk-rollreal-{run}",
        "TOLK_LANGUAGES": ",".join(LANGS),
        "TOLK_POLICIES": POLICIES,
        "TOLK_HEALTH_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    for lang in LANGS:  # before the rollout the stable arm serves everything
        publish_shares(kafka, arm_control_topic(prefix), lang, {"stable": 100.0})
    # the default faithfulness policy (withhold): a withheld answer is a quality outcome the
    # guard counts apart from errors (issue #28), so it does not roll French back
    worker_args = ["worker", "--model", "smollm2-135m", "--metrics-port", "0", "--no-cache"]
    arms = {
        "stable": ToolProcess(
            [*worker_args, "--arm", "stable"],
            {**env, "TOLK_WORKER_ID": f"stable-{run}"},
            tmp_path / "stable.log",
        ),
        "v2": ToolProcess(
            [*worker_args, "--arm", "v2", "--drill-inject-latency", DRILL],
            {**env, "TOLK_WORKER_ID": f"v2-{run}"},
            tmp_path / "v2.log",
        ),
    }
    guard_options = {
        "--decision": "windows",  # the drill of issue #14: the window rule
        "--window-s": WINDOW_S,
        "--min-requests": MIN_REQUESTS,
        "--good-windows": 2,
        "--bad-windows": 3,
        "--grace-s": GRACE_S,
        "--latency-slack-ms": LATENCY_SLACK_MS,
        "--max-latency-ratio": MAX_LATENCY_RATIO,
        "--app-id": f"guard-{run}",
        "--metrics-port": 0,
        "--datadir": tmp_path / "g",
    }
    guard = ToolProcess(
        ["guard", *(str(x) for option in guard_options.items() for x in option)],
        env,
        tmp_path / "guard.log",
    )
    reader = TopicReader(kafka_bootstrap, prefix + REPLIES)
    sender = OpenLoopSender(kafka_bootstrap, prefix, run, RATE_PER_LANG)

    def events() -> list[dict[str, Any]]:
        return read_events(kafka, rollout_events_topic(prefix))

    def finished() -> bool:
        done = {(e["language"], e["action"]) for e in events()}
        return {("de", "ROLLBACK"), ("fr", "COMPLETE")} <= done

    def replies() -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for _, value in reader.snapshot():
            reply = decode_result(value)
            out[reply["request_id"]].append(reply)
        return out

    t0 = time.monotonic()
    try:
        for proc in arms.values():  # model load and warm-up: minutes on a loaded machine
            proc.wait_for_line(r"\bassigned \[\(", timeout=240)
        guard.wait_for_line(r"Ready", timeout=90)
        warm = sender.warm_up(tuple(arms), per_arm=3)
        wait_for(lambda: set(replies()) >= warm, 120, "the warm-up turns answered", interval=0.5)
        started_s = time.monotonic() - t0
        cli = [sys.executable, "-m", "workers.cli"]
        start = subprocess.run(
            [*cli, "rollout", "start", "--arm", "v2", "--languages", ",".join(LANGS),
             "--share", str(START_SHARE), "--steps", f"{START_SHARE:g},100"],
            cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert start.returncode == 0, start.stdout + start.stderr
        sender.start()
        try:
            wait_for(finished, 180, "German rolled back and French complete", interval=1)
        except AssertionError as exc:
            decisions = [line for line in guard.text().splitlines() if " window " in line]
            raise AssertionError(
                f"{exc}; the guard's decisions:\n" + "\n".join(decisions)
            ) from None
        time.sleep(3.0)  # requests after the last change
        assert sender.stop() == 0, "requests not delivered to the broker"
        sent = sender.sent
        wait_for(lambda: set(replies()) >= set(sent), 90, "every request answered", interval=1)
        time.sleep(1.0)  # a late duplicate would show now
    finally:
        sender.stop()
        guard.stop()
        for proc in arms.values():
            proc.stop()
        reader.close()
    got = replies()
    evs = events()
    table = read_share_table(kafka, arm_control_topic(prefix))

    # German: rolled back within 3 windows + 5 s of the start of its first bad window
    de = [e for e in evs if e["language"] == "de" and e["window_start"] is not None]
    first_bad = next(e for e in de if e["verdict"] == "bad")
    rollback = next(e for e in de if e["action"] == "ROLLBACK")
    took_s = (rollback["decided_at"] - first_bad["window_start"]) / 1000
    limit_s = 3 * WINDOW_S + 5
    windows = [
        {
            "lang": e["language"], "start": e["window_start"], "action": e["action"],
            "verdict": e["verdict"], "canary": e["figures"].get("canary_requests"),
            "canary_p95_ms": e["figures"].get("canary_p95_ms"),
            "stable_p95_ms": e["figures"].get("stable_p95_ms"),
        }
        for e in evs if e["window_start"] is not None
    ]  # fmt: skip
    # every request answered, once, by one arm; duplicates equal in text
    lost = set(sent) - set(got)
    duplicates = sum(len(rs) - 1 for rs in got.values())
    arms_of = {rid: {str(split_arm(x["model_version"])[1]) for x in rs} for rid, rs in got.items()}
    two_arms = [rid for rid, answered_by in arms_of.items() if len(answered_by) > 1]
    unequal = [r for r, rs in got.items() if len({x["text"] for x in rs}) > 1]
    arm_of = {rid: min(arms_of[rid]) for rid in sent if rid in got}
    report = {
        "window_s": WINDOW_S, "start_share": START_SHARE, "rate_per_lang": RATE_PER_LANG,
        "min_requests": MIN_REQUESTS, "startup_s": round(started_s, 1),
        "first_bad_window_start": first_bad["window_start"],
        "rollback_decided_at": rollback["decided_at"], "rollback_after_s": round(took_s, 1),
        "limit_s": limit_s, "rollback_reasons": rollback["reasons"],
        "sent": len(sent), "answered": len(set(sent) & set(got)), "lost": len(lost),
        "duplicates": duplicates, "two_arms": len(two_arms),
        "by_arm": {a: sum(1 for x in arm_of.values() if x == a) for a in ("stable", "v2")},
        "latency": latency_summary(sent, got),
        "faithful": dict(Counter(
            str((rs[0].get("metadata") or {}).get("tolk.faithful", "clean")) for rs in got.values()
        )),
        "windows": windows,
        "load_avg_1m": os.getloadavg()[0],
    }  # fmt: skip
    print("ROLLOUT " + json.dumps(report), flush=True)
    assert took_s <= limit_s, report
    fr_actions = [e["action"] for e in evs if e["language"] == "fr"]
    assert fr_actions.count("COMPLETE") == 1 and "ROLLBACK" not in fr_actions, fr_actions
    assert dict(table.entries["de"]) == {"stable": 100.0, "v2": 0.0}
    assert dict(table.entries["fr"]) == {"stable": 0.0, "v2": 100.0}
    assert not lost and not two_arms and not unequal, report
    changes = check_arm_changes(sent, arm_of, evs)
    routed = check_routing(sent, arm_of, evs)
    print(
        f"ROLLOUT conversations that changed arm: {changes}; {routed} requests routed as "
        "their shares say"
    )
    assert changes["de"] > 0 and changes["fr"] > 0  # the changes happened, and only as allowed
    assert report["by_arm"]["v2"] > 0 and report["by_arm"]["stable"] > 0
    assert "ROLLBACK de" in guard.text()
