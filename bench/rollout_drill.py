"""The parts of a canary drill with real processes: `tolk` commands as child processes, an
open-loop sender of support turns with conversation ids, a reply reader, and the checks that
every request went to the arm its shares chose.

Used by the real-worker rollout test (tests/faults/test_rollout_real_workers.py, issue #14:
the window rule at a 50 % start) and by `bench/guard_drill.py` (issue #29: the sequential rule
at a 5 % start, several runs). Nothing here decides anything: the guard does, in its own
process, and its rollout events are what the checks read.

* `ToolProcess`: ``python -m workers.cli <args>``, its output in a log file; `wait_for_line`
  fails with the log's tail when the process exits or the line does not come.
* `balanced_conversations`: conversation ids of which exactly the share's part hash to the
  canary at the start share (the workers' own `choose_arm`), spread evenly through the list,
  so a round robin over them gives the canary its share in every stretch of turns.
* `OpenLoopSender`: per language a fixed schedule at its rate (a late send does not push the
  next one back: open loop), English BConTrasT agent turns, round robin over the language's
  conversations; `sent` maps request id -> (language, conversation, epoch send time).
* `check_arm_changes` / `check_routing`: a conversation changes arm only across a share change
  of its language, to the arm the new shares choose; every request was answered by the arm the
  shares in force at its send time choose (AssertionError with the case otherwise).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from replay.datasets import bcontrast
from schemas.codec import decode_result, encode_request
from topics.catalog import REPLIES, request_topic
from workers.arms import choose_arm, split_arm
from workers.guard.events import SHARE_LEAD_MS
from workers.loadtest.report import nearest_rank

REPO = Path(__file__).resolve().parents[1]
STABLE, CANARY = "stable", "v2"


def last_lines(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


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
    """`n` conversation ids of which round(n x share / 100) (at least one) go to the canary at
    `share` percent, the canary's spread evenly through the list (at 50 %: every other one)."""
    shares = {STABLE: 100.0 - share, CANARY: share}
    on_canary = min(n, max(1, round(n * share / 100)))
    want = {CANARY: on_canary, STABLE: n - on_canary}
    by_arm: dict[str, list[str]] = {STABLE: [], CANARY: []}
    k = 0
    while any(len(by_arm[arm]) < want[arm] for arm in want):
        conv = f"{run}-{lang}-conv-{k}"
        by_arm[str(choose_arm(shares, conv))].append(conv)
        k += 1
    canary_at = {int(j * n / on_canary) for j in range(on_canary)}
    canary, stable = iter(by_arm[CANARY]), iter(by_arm[STABLE])
    return [next(canary) if i in canary_at else next(stable) for i in range(n)]


class OpenLoopSender:
    """Per language one turn every 1 / rate s on a fixed schedule, each with a conversation id
    (round robin over `conversations[lang]`); `sent` maps request id -> (lang, conversation,
    send time in epoch seconds)."""

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        run: str,
        rates: Mapping[str, float],
        conversations: Mapping[str, Sequence[str]],
    ) -> None:
        self.prefix, self.run, self.rates = prefix, run, dict(rates)
        self.turns = support_turns()
        self.conversations = {lang: list(conversations[lang]) for lang in self.rates}
        self.sent: dict[str, tuple[str, str, float]] = {}
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _request(self, rid: str, lang: str, text: str, **extra: Any) -> None:
        request = {
            "request_id": rid, "conversation_id": None, "source_lang": "en",
            "target_lang": lang, "text": text, "created_at": int(time.time() * 1000),
            "deadline": None, "reply_topic": self.prefix + REPLIES, "metadata": {}, **extra,
        }  # fmt: skip
        key = (request["conversation_id"] or rid).encode()
        self.producer.produce(self.prefix + request_topic(lang), encode_request(request), key=key)

    def _run(self) -> None:
        start = time.monotonic()
        count = dict.fromkeys(self.rates, 0)
        n = 0
        while not self._stop.is_set():
            due = {lang: start + count[lang] / rate for lang, rate in self.rates.items()}
            lang = min(due, key=due.__getitem__)
            wait = due[lang] - time.monotonic()
            if wait > 0:
                self.producer.poll(min(wait, 0.05))
                continue
            i = count[lang]
            rid = f"{self.run}-{lang}-{i}"
            convs = self.conversations[lang]
            conv = convs[i % len(convs)]
            now = time.time()
            self._request(rid, lang, self.turns[n % len(self.turns)], conversation_id=conv)
            self.sent[rid] = (lang, conv, now)
            count[lang] += 1
            n += 1

    def warm_up(self, arms: Sequence[str], per_arm: int) -> set[str]:
        """`per_arm` turns per language addressed to each arm by name (`model_version`
        "warmup@<arm>": only that arm answers), so both engines have run before the rollout's
        first window; their request ids."""
        rids = set()
        for arm in arms:
            for lang in self.rates:
                for k in range(per_arm):
                    rid = f"{self.run}-warm-{arm}-{lang}-{k}"
                    self._request(rid, lang, self.turns[-1 - k], model_version=f"warmup@{arm}")
                    rids.add(rid)
        self.producer.flush(30)
        return rids

    def stop(self) -> int:
        """Stop sending; the number of requests not delivered to the broker."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        return int(self.producer.flush(30))


class ReplyReader:
    """Every reply on a topic from its beginning, read on a thread, grouped by request id."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._replies: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"drill-reader-{time.monotonic_ns()}",
             "enable.auto.commit": False}
        )  # fmt: skip
        parts = self._consumer.list_topics(topic=topic, timeout=10).topics[topic].partitions
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        self._thread = threading.Thread(target=self._run, name="drill-replies", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.05)
            if msg is None or msg.error():
                continue
            reply = decode_result(msg.value() or b"")
            with self._lock:
                self._replies[str(reply["request_id"])].append(reply)

    def replies(self) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            return {rid: list(rs) for rid, rs in self._replies.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


def share_changes(events: list[dict[str, Any]], lang: str) -> list[tuple[float, dict[str, float]]]:
    """(time the shares take effect, epoch s; the shares) of every share change of `lang`."""
    out = []
    for e in events:
        if e["language"] == lang and e["share_after"] != e["share_before"]:
            share = float(e["share_after"])
            shares = {str(e["stable_arm"]): 100.0 - share, str(e["canary_arm"]): share}
            out.append(((e["decided_at"] + SHARE_LEAD_MS) / 1000, shares))
    return out


def arm_of_replies(got: Mapping[str, list[dict[str, Any]]]) -> dict[str, set[str]]:
    """Request id -> the arms that answered it."""
    return {rid: {str(split_arm(x["model_version"])[1]) for x in rs} for rid, rs in got.items()}


def check_arm_changes(
    sent: Mapping[str, tuple[str, str, float]],
    arm_of: Mapping[str, str],
    events: list[dict[str, Any]],
) -> dict[str, int]:
    """Every conversation's arm changes only across a share change of its language (the two
    requests straddle the time the new shares took effect, within `slack_s`) and only to the
    arm those shares choose for it; the number of changes per language."""
    slack_s = 1.0  # record timestamps vs this process's clock; the change's produce time
    by_conv: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for rid, (lang, conv, at) in sent.items():
        if rid in arm_of:
            by_conv[(lang, conv)].append((at, arm_of[rid]))
    changes = {lang: 0 for lang, _ in by_conv}
    share_changes_of = {lang: share_changes(events, lang) for lang in changes}  # read once
    for (lang, conv), turns in by_conv.items():
        turns.sort()
        for (t0, a0), (t1, a1) in zip(turns, turns[1:], strict=False):
            if a0 == a1:
                continue
            changes[lang] += 1
            across = [
                shares for eff, shares in share_changes_of[lang]
                if t0 - slack_s <= eff <= t1 + slack_s
            ]  # fmt: skip
            assert across, f"{conv} moved {a0} -> {a1} with no share change of {lang} between"
            assert any(choose_arm(s, conv) == a1 for s in across), (conv, a0, a1, across)
    return changes


def check_routing(
    sent: Mapping[str, tuple[str, str, float]],
    arm_of: Mapping[str, str],
    events: list[dict[str, Any]],
) -> int:
    """Every request was answered by the arm its language's shares in force at its send time
    choose for its conversation (stable alone before the rollout); a request sent within
    `slack_s` of a change may have either arm. The number of requests checked."""
    slack_s = 1.0
    checked = 0
    langs = {lang for lang, _, _ in sent.values()}
    share_changes_of = {lang: share_changes(events, lang) for lang in langs}  # read once
    for rid, (lang, conv, at) in sent.items():
        changes = share_changes_of[lang]
        if rid not in arm_of or any(abs(at - eff) <= slack_s for eff, _ in changes):
            continue
        in_force = [shares for eff, shares in changes if eff <= at]
        shares = in_force[-1] if in_force else {STABLE: 100.0}
        assert arm_of[rid] == choose_arm(shares, conv), (rid, conv, arm_of[rid], shares)
        checked += 1
    return checked


def latency_summary(
    sent: Mapping[str, tuple[str, str, float]], got: Mapping[str, list[dict[str, Any]]]
) -> dict[str, dict[str, float]]:
    """Per language and arm: replies, P50 and P95 of send -> reply completed, ms."""
    by: dict[str, list[float]] = defaultdict(list)
    for rid, (lang, _, at) in sent.items():
        for reply in got.get(rid, [])[:1]:
            arm = split_arm(reply["model_version"])[1]
            by[f"{lang}/{arm}"].append(reply["completed_at"] - at * 1000)
    return {
        k: {
            "n": len(v),
            "p50_ms": round(nearest_rank(sorted(v), 50)),
            "p95_ms": round(nearest_rank(sorted(v), 95)),
        }
        for k, v in sorted(by.items())
    }
