"""replay.job on the real broker: BConTrasT turns replayed in mirror mode to two simulated
arms (`tests/replay/fake_arms.py`), every request answered by each arm, conversation order
kept, send lag measured, duplicates and a missing arm counted, a run interrupted after N
sends resumed without sending anything twice, and xSID commands replayed with their intents.

Each test uses its own topic prefix, so the shared broker's other users never see these
requests and the fake arms never see theirs.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from replay import run_dir as rd
from replay.job import ReplayConfig, run_replay
from replay.report import write_report
from tests.kafka_fixtures import unique_name
from tests.replay.fake_arms import FakeArm
from topics.admin import ensure_topics
from topics.catalog import catalog, request_topic

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis]

TURNS = 60


@pytest.fixture
def prefix(kafka_bootstrap: str) -> str:
    """A unique topic prefix whose request topics exist before any arm subscribes."""
    name = unique_name("replay") + "."
    ensure_topics(kafka_bootstrap, [s for s in catalog(["de", "en"], prefix=name)])
    return name


def arms(bootstrap: str, prefix: str, names: str, **kw) -> list[FakeArm]:
    topics = [request_topic(lang, prefix) for lang in ("de", "en")]
    return [FakeArm(bootstrap, topics, a, f"{prefix}workers.{a}", **kw) for a in names]


def config(bootstrap: str, prefix: str, tmp_path: Path, **kw) -> ReplayConfig:
    base = dict(
        bootstrap=bootstrap,
        topic_prefix=prefix,
        limit=TURNS,
        seed=7,
        speed=25.0,  # 2 s of log time per turn -> 80 ms
        arms=("A", "B"),
        wait_s=30.0,
        run_dir=tmp_path / "run",
        progress_every_s=1.0,
    )
    return ReplayConfig(**{**base, **kw})


def requests_of(run: Path) -> list[dict]:
    return rd.read_jsonl(run / rd.REQUESTS)


def assert_conversation_order(requests: list[dict]) -> None:
    by_conv: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        by_conv[r["conversation_id"]].append(r)
    for turns in by_conv.values():
        in_turn_order = sorted(turns, key=lambda r: r["turn"])
        sent = [r["sent_ms"] for r in in_turn_order]
        assert sent == sorted(sent), "a turn was sent before the previous turn"


def test_mirror_replay_to_two_arms(kafka_bootstrap, prefix, tmp_path, capsys):
    twice = {f"-{i:06d}" for i in (3, 17)}  # B answers these two requests twice
    a, b = (
        arms(kafka_bootstrap, prefix, "A")[0],
        arms(kafka_bootstrap, prefix, "B", answer_twice=lambda rid: rid[-7:] in twice)[0],
    )
    lines: list[str] = []
    try:
        summary = run_replay(config(kafka_bootstrap, prefix, tmp_path), echo=lines.append)
    finally:
        a.stop()
        b.stop()
    print(json.dumps(summary))
    assert summary["finished"] and summary["sent"] == TURNS
    assert summary["answered"] == {"A": TURNS, "B": TURNS}
    assert summary["unanswered"] == {"A": 0, "B": 0}
    assert summary["duplicates"] == {"A": 0, "B": 2}
    assert summary["missing_arms"] == [] and summary["problems"] == 0
    assert any("answered A=" in line for line in lines)  # progress lines

    run = tmp_path / "run"
    info = rd.read_run_info(run)
    assert info["finished"] is True and info["arms"] == ["A", "B"]
    assert info["reply_topic"] == f"{prefix}tolk.replay.{info['run_id']}"
    requests = requests_of(run)
    assert len({r["request_id"] for r in requests}) == TURNS
    assert_conversation_order(requests)
    # the reported send lag is the P99 of |sent - scheduled| over requests.jsonl; with 60
    # sends P99 is the worst one, which a busy shared CI machine can stretch, so the 50 ms
    # target is asserted on nine in ten sends here (docs/REPLAY.md has a 400-turn run: 4 ms)
    lags = sorted(abs(r["sent_ms"] - r["scheduled_ms"]) for r in requests)
    assert summary["send_lag_p99_ms"] == pytest.approx(lags[-1], abs=0.01)
    assert lags[int(0.9 * len(lags))] < 50
    # every arm saw each request once, in mirror mode, and each conversation's turns of one
    # target language (one topic, one partition) in turn order; across the two topics of a
    # conversation Kafka orders nothing, only the send order (above) is the job's
    for arm in (a, b):
        assert Counter(s.request_id for s in arm.seen) == Counter(r["request_id"] for r in requests)
        assert all(s.metadata["tolk.mirror"] == "1" for s in arm.seen)
        assert {s.metadata["tolk.replay_run"] for s in arm.seen} == {info["run_id"]}
        per_conv: dict[tuple[str | None, str], list[str]] = defaultdict(list)
        for s in sorted(arm.seen, key=lambda s: s.at):
            per_conv[(s.conversation_id, s.target_lang)].append(s.request_id)
        assert all(ids == sorted(ids) for ids in per_conv.values())
    replies = rd.read_jsonl(run / rd.REPLIES)
    assert len(replies) == 2 * TURNS + 2
    sent_at = {r["request_id"]: r["sent_ms"] for r in requests}
    assert all(r["received_ms"] >= sent_at[r["request_id"]] for r in replies)
    assert {r["arm"] for r in replies} == {"A", "B"}
    assert all(r["metadata"] == {"fake.arm": r["arm"]} for r in replies)


def test_resume_sends_nothing_twice(kafka_bootstrap, prefix, tmp_path):
    a, b = arms(kafka_bootstrap, prefix, "AB")
    try:
        first = run_replay(config(kafka_bootstrap, prefix, tmp_path, max_sends=20), echo=print)
        assert first["finished"] is False and first["stopped"] == "max_sends"
        assert first["sent"] == 20 and len(requests_of(tmp_path / "run")) == 20
        # settings given again on resume are ignored: run.json's apply
        second = run_replay(config(kafka_bootstrap, prefix, tmp_path, limit=5), echo=print)
    finally:
        a.stop()
        b.stop()
    assert second["finished"] is True and second["sent"] == TURNS
    assert second["answered"] == {"A": TURNS, "B": TURNS}
    assert second["duplicates"] == {"A": 0, "B": 0}
    requests = requests_of(tmp_path / "run")
    ids = [r["request_id"] for r in requests]
    assert len(ids) == len(set(ids)) == TURNS
    for arm in (a, b):
        assert sorted(s.request_id for s in arm.seen) == sorted(ids)  # none sent twice
    assert_conversation_order(requests)
    assert rd.read_run_info(tmp_path / "run")["finished"] is True
    with pytest.raises(rd.RunDirError, match="finished"):
        run_replay(config(kafka_bootstrap, prefix, tmp_path), echo=print)


def test_missing_arm_and_bad_rows_are_reported(kafka_bootstrap, prefix, tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [
        {
            "conversation_id": f"c{c}",
            "turn": t,
            "source_lang": "en",
            "target_lang": "de",
            "text": f"Where is order {c}-{t}?",
        }
        for c in range(3)
        for t in range(3)
    ]
    rows.append(
        {
            "conversation_id": "bad",
            "turn": 0,
            "source_lang": "en",
            "target_lang": "xx",
            "text": "unknown language",
        }
    )
    rows.append(
        {"conversation_id": "bad", "turn": 1, "source_lang": "en", "target_lang": "de", "text": ""}
    )
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (a,) = arms(kafka_bootstrap, prefix, "A")
    try:
        summary = run_replay(
            config(
                kafka_bootstrap,
                prefix,
                tmp_path,
                log_path=log,
                log_format="jsonl",
                limit=None,
                speed=None,
                rate=50.0,
                wait_s=3.0,
            ),
            echo=print,
        )
    finally:
        a.stop()
    assert summary["finished"] and summary["sent"] == 9 and summary["problems"] == 2
    assert summary["answered"] == {"A": 9, "B": 0}
    assert summary["unanswered"] == {"A": 0, "B": 9}
    assert summary["missing_arms"] == ["B"]
    assert any("arm 'B' sent no reply" in m for m in summary["messages"])
    problems = rd.read_jsonl(tmp_path / "run" / rd.PROBLEMS)
    assert [p["row"] for p in problems] == ["log.jsonl:10", "log.jsonl:11"]


def test_closed_loop_waits_for_both_arms(kafka_bootstrap, prefix, tmp_path):
    a, b = arms(kafka_bootstrap, prefix, "AB")
    try:
        summary = run_replay(
            config(
                kafka_bootstrap,
                prefix,
                tmp_path,
                limit=12,
                speed=None,
                rate=200.0,
                closed_loop=True,
            ),
            echo=print,
        )
    finally:
        a.stop()
        b.stop()
    assert summary["finished"] and summary["answered"] == {"A": 12, "B": 12}
    assert summary["closed_loop_timeouts"] == 0
    run = tmp_path / "run"
    requests = sorted(requests_of(run), key=lambda r: (r["conversation_id"], r["turn"]))
    last_answer: dict[str, float] = {}
    for reply in rd.read_jsonl(run / rd.REPLIES):
        rid = reply["request_id"]
        last_answer[rid] = max(last_answer.get(rid, 0.0), reply["received_ms"])
    for prev, cur in zip(requests, requests[1:], strict=False):
        if prev["conversation_id"] == cur["conversation_id"]:
            assert cur["sent_ms"] >= last_answer[prev["request_id"]]


def test_cli_run_prints_the_summary(kafka_bootstrap, prefix, tmp_path):
    from typer.testing import CliRunner

    from replay.cli import app

    (a,) = arms(kafka_bootstrap, prefix, "A")
    env = {"TOLK_BOOTSTRAP": kafka_bootstrap, "TOLK_TOPIC_PREFIX": prefix}
    args = [
        "run",
        "--limit",
        "6",
        "--rate",
        "50",
        "--arms",
        "A",
        "-l",
        "en",
        "--run-dir",
        str(tmp_path / "cli-run"),
        "--wait-s",
        "20",
    ]
    try:
        result = CliRunner().invoke(app, args, env=env)
    finally:
        a.stop()
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["sent"] == 6 and summary["answered"] == {"A": 6}
    requests = requests_of(tmp_path / "cli-run")
    assert {r["target_lang"] for r in requests} == {"en"}


def test_xsid_replay_carries_real_intent_labels_to_the_report(kafka_bootstrap, prefix, tmp_path):
    """Issue #28: `--format xsid` replays xSID's German commands into English with their real
    intent labels, and the report judges intent agreement on them."""
    from replay import report as report_mod
    from replay.datasets import data_file

    a, b = arms(kafka_bootstrap, prefix, "AB")
    cfg = config(
        kafka_bootstrap,
        prefix,
        tmp_path,
        log_path=data_file("xsid/de.valid.conll"),
        log_format="xsid",
        limit=40,
    )
    try:
        summary = run_replay(cfg, echo=print)
    finally:
        a.stop()
        b.stop()
    assert summary["finished"] and summary["sent"] == 40 and summary["problems"] == 0
    requests = requests_of(tmp_path / "run")
    assert all(r["intent"] and r["reference"] and r["target_lang"] == "en" for r in requests)
    assert len({r["intent"] for r in requests}) >= 2
    report = report_mod.build_report(tmp_path / "run", draws=200)
    group = report["groups"]["language en"]
    for arm in ("A", "B"):
        assert group["arms"][arm]["intent_agreement_n"] == 40
        assert 0.0 <= group["arms"][arm]["intent_agreement"] <= 1.0


def test_a_run_stops_sending_once_every_language_is_decided(kafka_bootstrap, prefix, tmp_path):
    """`--stop-when-decided within_slo,chrf` (issue #29): two arms that answer alike ("[A] x"
    and "[B] x": nearly the same chrF) are decided equivalent within a 0.2 margin after some
    dozens of pairs per language; the run then sends nothing more, waits for what it sent, and
    ends finished with the verdicts in run.json."""
    a, b = arms(kafka_bootstrap, prefix, "AB")
    lines: list[str] = []
    try:
        summary = run_replay(
            config(
                kafka_bootstrap,
                prefix,
                tmp_path,
                limit=400,
                stop_when_decided=("within_slo", "chrf"),
                margins={"within_slo": 0.2, "chrf": 0.2},
                decide_every_s=0.5,
            ),
            echo=lines.append,
        )
    finally:
        a.stop()
        b.stop()
    print(json.dumps(summary))
    assert summary["finished"] is True and summary["stopped"] == "decided"
    assert 60 <= summary["sent"] < 400  # stopped early, after real evidence
    assert summary["unanswered"] == {"A": 0, "B": 0}  # what was sent was waited for
    # the checks run in the send loop: they must not hold the sends up (a first sacrebleu
    # import inside the loop once cost 115 ms; see test_mirror_replay_to_two_arms on the P99).
    # the suite's two processes on two cores put the P90 at 56 ms on an Intel Xeon (2026-12-05),
    # at 95 ms on a slower AMD EPYC Zen 3 (2026-12-06) and at 224 ms on the same AMD host in a
    # CI run (2026-12-07: each check, ~12 ms alone, stalled the sends 40-200 ms while the other
    # test process compiled, and the loop, near saturation there, caught up ~4 ms a send):
    # 300 ms. A check that held up the sends would push every later send behind its schedule:
    # the lags add up far past it.
    lags = sorted(abs(r["sent_ms"] - r["scheduled_ms"]) for r in requests_of(tmp_path / "run"))
    assert lags[int(0.9 * len(lags))] < 300
    info = rd.read_run_info(tmp_path / "run")
    assert info["stopped_early"]["sent"] <= summary["sent"]
    assert info["stopped_early"]["verdicts"] == {
        lang: {"B vs A": {"within_slo": "equivalent", "chrf": "equivalent"}}
        for lang in ("de", "en")
    }
    assert info["stop_when_decided"]["metrics"] == ["within_slo", "chrf"]
    assert any(line.startswith("decided after") for line in lines)
    # the report, on everything the run sent, agrees
    report = write_report(tmp_path / "run", margins={"within_slo": 0.2, "chrf": 0.2})
    for lang in ("de", "en"):
        seq = report["groups"][f"language {lang}"]["comparisons"]["B vs A"]["sequential"]
        assert seq["within_slo"]["verdict"] == seq["chrf"]["verdict"] == "equivalent"
