"""`tolk replay run`: stream a conversation log to the request topics and collect every arm's
replies.

One process, one loop, no threads: each iteration sends what the `Pacer` says is due
(`replay/pacing.py`), serves the producer's delivery reports, and reads replies from the run's
own reply topic with a consumer poll whose timeout ends at the next due time, so a send is late
by the time a poll or a burst of replies takes, not by a sleep's granularity (the summary's
`send_lag_p99_ms` measures it; the target is 50 ms). Requests go out in mirror mode: the
metadata `{"tolk.mirror": "1", "tolk.replay_run": <run id>}` asks every arm to answer
(`workers/arms.py`), the key is the conversation id (one partition per conversation, so Kafka
keeps the order the pacer made), and the reply topic is `tolk.replay.<run id>`, created for the
run (one partition, kept 7 days so a run can be resumed and reported later). Replies are
matched by request id and attributed to the arm named in their `model_version`
(`<engine version>@<arm>`); a second reply of one arm to one request is a duplicate, counted.

The run ends when every expected arm (`--arms`, else every arm that answered anything) has
answered every request, or `wait_s` after the last send; it stops early, unfinished, at
`max_duration_s`, after `max_sends` sends in this session, or on Ctrl-C; with
`stop_when_decided` it stops sending once every language is decided and ends finished
(`replay/early_stop.py`). An unfinished run
is resumed by running again with its directory: the run's own settings (run.json) apply,
requests already in requests.jsonl are not sent again, the remaining schedule starts now, and
replies are read on from the last offset recorded in replies.jsonl. The run directory's format
is `replay/run_dir.py`'s; who answered what (`ReplyBook`), the progress line and the summary
are `replay/job_report.py`'s.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from replay import run_dir as rd
from replay.datasets import data_file
from replay.early_stop import DecisionWatch, stop_setting
from replay.job_report import NO_ARM, JobReport, ReplyBook
from replay.logs import KNOWN_LANGUAGES, LogFormat, read_log
from replay.pacing import Pacer, Planned, schedule, select_records
from schemas.wire import WireRequest, write_request
from topics.admin import ensure_topics
from topics.catalog import REQUEST_RETENTION_MS, TopicSpec, catalog, request_topic
from workers.arms import MIRROR_METADATA_KEY

MIRROR_KEY = MIRROR_METADATA_KEY  # the arms' rule (workers/arms.py)
RUN_KEY = "tolk.replay_run"
REPLY_TOPIC_PREFIX = "tolk.replay."
DEFAULT_LOG = "bcontrast_wmt20_chat/dev.json"
COMPLETE_GRACE_S = 5.0  # without --arms: wait at least this after the last send


@dataclass(frozen=True)
class ReplayConfig:
    """Everything one `tolk replay run` needs (the CLI builds it; tests build it directly)."""

    bootstrap: str = "127.0.0.1:9092"
    kafka_config: Mapping[str, Any] = field(default_factory=dict)  # security props, no bootstrap
    log_path: Path | None = None  # None: the repository's BConTrasT dev split
    log_format: LogFormat = "bcontrast"
    languages: tuple[str, ...] = ()  # target languages to replay; () = every language
    limit: int | None = None  # turns, whole conversations chosen by seed
    seed: int = 0
    speed: float | None = None  # log time / speed; default 1 when rate is None too
    rate: float | None = None  # open loop, requests per second
    closed_loop: bool = False  # turn k waits for every arm's answer to turn k-1
    arms: tuple[str, ...] = ()  # the arms expected to answer; () = whoever answers
    wait_s: float = 120.0  # after the last send, for missing replies
    deadline_s: float | None = None  # request deadline after its creation; None = none
    max_duration_s: float | None = None  # of this session
    max_sends: int | None = None  # of this session
    run_dir: Path | None = None  # existing and unfinished: resume it
    runs_root: Path = Path("replay-runs")  # where a new run's directory goes
    topic_prefix: str = ""  # in front of request and reply topic names (tests, tenants)
    known_languages: frozenset[str] = KNOWN_LANGUAGES
    progress_every_s: float = 5.0
    stop_when_decided: tuple[str, ...] = ()  # metrics (replay/early_stop.py); () = never
    margins: Mapping[str, float] | None = None  # the per-segment verdicts' (replay/sequential)
    slo_ms: float = 2000.0
    decide_every_s: float = 5.0


def reply_topic_name(run_id: str, prefix: str = "") -> str:
    return f"{prefix}{REPLY_TOPIC_PREFIX}{run_id}"


class ReplayJob(JobReport):  # the reply book and the summary: replay/job_report.py
    """One session of a replay run (a fresh run, or the continuation of an unfinished one)."""

    def __init__(self, config: ReplayConfig, echo: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stop_reason = "done"
        self.send_failed: list[str] = []
        self.undecodable = 0
        self.created_at: dict[str, int] = {}  # request id -> the request's created_at (epoch ms)
        self.decided = False

    # -- set-up --------------------------------------------------------------------------------

    def _open_run(self) -> None:
        cfg = self.config
        existing = rd.read_run_info(cfg.run_dir) if cfg.run_dir is not None else None
        if existing is not None:
            if existing.get("finished"):
                raise rd.RunDirError(f"{cfg.run_dir} holds a finished run; nothing to resume")
            self.info, self.resumed = existing, True
            self.run_dir = Path(cfg.run_dir or ".")
            return
        run_id = rd.new_run_id()
        self.run_dir = Path(cfg.run_dir) if cfg.run_dir is not None else cfg.runs_root / run_id
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise rd.RunDirError(f"{self.run_dir} is not empty and holds no run.json")
        if cfg.log_path is None and cfg.log_format != "bcontrast":
            raise ValueError(
                f"--format {cfg.log_format} needs --log (the default log is BConTrasT)"
            )
        log_path = Path(cfg.log_path) if cfg.log_path is not None else data_file(DEFAULT_LOG)
        if not log_path.is_file():
            raise FileNotFoundError(f"log {log_path} not found")
        speed = cfg.speed if cfg.speed is not None or cfg.rate is not None else 1.0
        self.resumed = False
        self.info = {
            "run_id": run_id,
            "created_at_ms": int(time.time() * 1000),
            "arms": list(cfg.arms),
            "reply_topic": reply_topic_name(run_id, cfg.topic_prefix),
            "languages": list(cfg.languages),
            "log": {"path": str(log_path), "format": cfg.log_format, "sha256": rd.sha256(log_path)},
            "pacing": {"speed": speed, "rate": cfg.rate, "closed_loop": cfg.closed_loop},
            "limit": cfg.limit,
            "seed": cfg.seed,
            "wait_s": cfg.wait_s,
            "deadline_s": cfg.deadline_s,
            "topic_prefix": cfg.topic_prefix,
            "stop_when_decided": stop_setting(cfg.stop_when_decided, cfg.margins, cfg.slo_ms),
            "finished": False,
            "tolk_commit": rd.tolk_commit(),
            "cpu_model": rd.cpu_model(),
        }
        rd.write_run_info(self.run_dir, self.info)

    def _plan(self) -> list[Planned]:
        info = self.info
        recorded = info["log"].get("sha256")
        if self.resumed and recorded and rd.sha256(Path(info["log"]["path"])) != recorded:
            raise rd.RunDirError(
                f"the log {info['log']['path']} changed since the run started: a resumed run "
                "must select the same turns"
            )
        contents = read_log(
            Path(info["log"]["path"]), info["log"]["format"], self.config.known_languages
        )
        self.problem_count = len(contents.problems)
        if not self.resumed:
            with rd.JsonlWriter(self.run_dir / rd.PROBLEMS) as problems:
                for p in contents.problems:
                    problems.write({"row": p.row, "reason": p.reason})
        selected = select_records(
            contents.records, info["languages"] or None, info["limit"], info["seed"]
        )
        pacing = info["pacing"]
        return schedule(selected, speed=pacing["speed"], rate=pacing["rate"])

    def request_id(self, planned: Planned) -> str:
        return f"{self.info['run_id']}-{planned.index:06d}"

    def _ensure_topics(self, targets: Sequence[str]) -> None:
        cfg = self.config
        specs = [
            s
            for s in catalog(targets, prefix=cfg.topic_prefix)
            if s.value_schema.endswith("TranslationRequest")
        ]
        specs.append(
            TopicSpec(
                name=self.info["reply_topic"],
                partitions=1,
                config={"retention.ms": str(REQUEST_RETENTION_MS), "cleanup.policy": "delete"},
                value_schema="tolk.TranslationResult",
            )
        )
        ensure_topics(cfg.bootstrap, specs, client_config=dict(cfg.kafka_config))

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self._open_run()
        self.watch = DecisionWatch.from_info(self.info)
        plan = self._plan()
        remaining = self._restore(plan)
        self._ensure_topics(sorted({p.record.target_lang for p in plan}))
        self._connect()
        # the session's clock: ms after the run's created_at_ms, monotonic within the session
        anchor_ms = time.time() * 1000 - self.info["created_at_ms"]
        mono0 = time.monotonic()
        self.clock = lambda: anchor_ms + (time.monotonic() - mono0) * 1000
        self.session_start = self.clock()
        shift = self.session_start - min((p.scheduled_ms for p in remaining), default=0.0)
        self.pacer = Pacer(
            remaining,
            closed_loop=bool(self.info["pacing"].get("closed_loop")),
            closed_loop_timeout_ms=self.info["wait_s"] * 1000,
            shift_ms=shift,
        )
        self.last_send_ms = self.session_start
        self.requests_out = rd.JsonlWriter(self.run_dir / rd.REQUESTS)
        self.replies_out = rd.JsonlWriter(self.run_dir / rd.REPLIES)
        finished = False
        try:
            finished = self._loop(len(plan))
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"
        finally:
            self._close(finished)
        return self._summary(len(plan), finished)

    def _restore(self, plan: list[Planned]) -> list[Planned]:
        """Load what earlier sessions of the run sent and received; the turns still to send."""
        by_id = {self.request_id(p): p for p in plan}
        old_requests = rd.read_sent(self.run_dir)
        self.old_replies = rd.read_replies(self.run_dir)
        self.book = ReplyBook(self.info["arms"])
        self.lags: list[float] = []
        for req in old_requests:
            rid = req.request_id
            if rid not in by_id:
                continue
            self.book.sent[rid] = by_id[rid].index
            self.created_at[rid] = req.created_at_ms
            self.lags.append(abs(req.sent_ms - req.scheduled_ms))
            if self.watch is not None:
                self.watch.sent_line(req)
        for reply in self.old_replies:
            self.book.add(reply.request_id, reply.arm or NO_ARM)
            if self.watch is not None:
                self.watch.replied_line(reply)
        return [p for p in plan if self.request_id(p) not in self.book.sent]

    def _connect(self) -> None:
        cfg = self.config
        common = {"bootstrap.servers": cfg.bootstrap, **cfg.kafka_config}
        self.producer = Producer(
            {
                **common,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 1,
                "allow.auto.create.topics": False,
            }
        )
        # assign(), no subscribe: the group id is required by librdkafka but never joined
        self.consumer = Consumer(
            {
                **common,
                "group.id": f"tolk-replay-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "allow.auto.create.topics": False,
            }
        )
        start_at = rd.reply_offsets(self.old_replies).get(0, OFFSET_BEGINNING)
        self.consumer.assign([TopicPartition(self.info["reply_topic"], 0, start_at)])

    def _loop(self, total: int) -> bool:
        """Send, collect, report progress; True when the run finished (not merely stopped)."""
        cfg = self.config
        sends = 0
        next_progress = self.session_start + cfg.progress_every_s * 1000
        next_decide = self.session_start + cfg.decide_every_s * 1000
        while True:
            now = self.clock()
            if (
                cfg.max_duration_s is not None
                and now - self.session_start > cfg.max_duration_s * 1e3
            ):
                self.stop_reason = "max_duration"
                return False
            for planned, due in [] if self.decided else self.pacer.due(now):
                self._send(planned, due)
                sends += 1
                if cfg.max_sends is not None and sends >= cfg.max_sends:
                    self.stop_reason = "max_sends"
                    return False
            self.producer.poll(0)
            if self.watch is not None and not self.decided and now >= next_decide:
                next_decide = now + cfg.decide_every_s * 1000
                if verdicts := self.watch.decided():  # anytime-valid: looking costs nothing
                    self.decided, self.stop_reason = True, "decided"
                    self.info["stopped_early"] = {"sent": len(self.book.sent), "verdicts": verdicts}
                    self.echo(f"decided after {len(self.book.sent)} requests: stop sending")
            if (self.pacer.done() or self.decided) and self._wait_over():
                return True
            nxt = self.pacer.next_due_ms()
            timeout_s = 0.05 if nxt is None else max(0.0, (nxt - self.clock()) / 1000)
            for msg in self.consumer.consume(num_messages=500, timeout=min(0.05, timeout_s)):
                self._take_reply(msg)
            if self.clock() >= next_progress:
                self.echo(self._progress_line(total))
                next_progress += cfg.progress_every_s * 1000

    def _wait_over(self) -> bool:
        """Everything sent: is every expected reply in, or the wait for the rest over?"""
        waited_s = (self.clock() - self.last_send_ms) / 1000
        wait_s = float(self.info["wait_s"])
        grace_s = 0.0 if self.book.expected else min(COMPLETE_GRACE_S, wait_s)
        return (self.book.complete() and waited_s >= grace_s) or waited_s >= wait_s

    def _close(self, finished: bool) -> None:
        self.producer.flush(30)
        for msg in self.consumer.consume(num_messages=10_000, timeout=0.5):
            self._take_reply(msg)
        self.consumer.close()
        self.requests_out.close()
        self.replies_out.close()
        self.info["finished"] = finished
        rd.write_run_info(self.run_dir, self.info)

    def _send(self, planned: Planned, due_ms: float) -> None:
        rec, rid = planned.record, self.request_id(planned)
        created_at = int(time.time() * 1000)
        deadline_s = self.info.get("deadline_s")
        value = write_request(
            WireRequest(
                request_id=rid,
                conversation_id=rec.conversation_id,
                source_lang=rec.source_lang,
                target_lang=rec.target_lang,
                text=rec.text,
                created_at=created_at,
                deadline=created_at + int(deadline_s * 1000) if deadline_s else None,
                reply_topic=str(self.info["reply_topic"]),
                model_version=None,
                metadata={MIRROR_KEY: "1", RUN_KEY: str(self.info["run_id"])},
            )
        )
        topic = request_topic(rec.target_lang, self.info.get("topic_prefix", ""))
        sent_ms = self.clock()
        while True:
            try:
                self.producer.produce(
                    topic,
                    value=value,
                    key=rec.conversation_id.encode(),
                    on_delivery=self._delivered(rid),
                )
                break
            except BufferError:  # local queue full: serve delivery reports, try again
                self.producer.poll(0.05)
        self.pacer.mark_sent(planned, sent_ms)
        self.book.sent[rid] = planned.index
        if self.watch is not None:
            self.watch.sent(rid, rec.target_lang, rec.reference, sent_ms)
        self.created_at[rid] = created_at
        self.last_send_ms = sent_ms
        self.lags.append(abs(sent_ms - due_ms))
        self.requests_out.write(
            rd.SentLine(
                request_id=rid,
                conversation_id=rec.conversation_id,
                turn=rec.turn,
                source_lang=rec.source_lang,
                target_lang=rec.target_lang,
                text=rec.text,
                reference=rec.reference,
                intent=rec.intent,
                sender=rec.sender,
                row=rec.row,
                scheduled_ms=due_ms,
                sent_ms=sent_ms,
                created_at_ms=created_at,
                topic=topic,
            ).to_json()
        )

    def _delivered(self, request_id: str) -> Callable[[Any, Any], None]:
        def report(err: Any, _msg: Any) -> None:
            if err is not None:
                self.send_failed.append(request_id)
                self.echo(f"[replay] request {request_id} not delivered: {err}")

        return report


def run_replay(config: ReplayConfig, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run (or resume) one replay session; the summary (also what the CLI prints as JSON)."""
    summary = ReplayJob(config, echo).run()
    for message in summary["messages"]:
        (echo or (lambda line: print(line, file=sys.stderr)))(f"[replay] {message}")
    return summary


def summary_json(summary: Mapping[str, Any]) -> str:
    return json.dumps(summary, indent=2, ensure_ascii=False)
