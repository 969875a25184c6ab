"""replay.run_dir: the run directory survives a killed writer (a partial last line is cut and
ignored), run.json round-trips, and a resumed run finds where to read replies on; and the
`tolk replay` commands refuse bad arguments before touching a broker."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from replay import run_dir as rd
from replay.cli import app
from replay.job import ReplayConfig, run_replay


def test_partial_last_line_is_ignored_and_cut(tmp_path):
    path = tmp_path / rd.REPLIES
    path.write_bytes(
        b'{"request_id": "r1", "partition": 0, "offset": 4}\n{"request_id": "r2", "par'
    )
    assert [r["request_id"] for r in rd.read_jsonl(path)] == ["r1"]
    with rd.JsonlWriter(path) as out:  # appending first cuts the partial line
        out.write({"request_id": "r3", "partition": 0, "offset": 9})
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["r1", "r3"]


def test_reply_offsets_continue_after_the_highest_seen(tmp_path):
    with rd.JsonlWriter(tmp_path / rd.REPLIES) as out:
        for line in (
            {"request_id": "a", "partition": 0, "offset": 4},
            {"request_id": "b", "partition": 0, "offset": 2},
            {"request_id": "c", "partition": 1, "offset": 0},
            {"request_id": "no offset"},
            {"partition": 1, "offset": 7},  # no request id: skipped like a broken line
        ):
            out.write(line)
    replies = rd.read_replies(tmp_path)
    assert [r.request_id for r in replies] == ["a", "b", "c", "no offset"]
    assert rd.reply_offsets(replies) == {0: 5, 1: 1}
    assert rd.reply_offsets([]) == {}


def test_sent_and_reply_lines_round_trip_and_old_lines_read_with_defaults(tmp_path):
    sent = rd.SentLine(request_id="r1", target_lang="de", text="hi", reference="hallo", sent_ms=5.0)
    reply = rd.ReplyLine(request_id="r1", arm="A", status="OK", text="hallo", metadata={"k": "v"})
    with rd.JsonlWriter(tmp_path / rd.REQUESTS) as out:
        out.write(sent.to_json())
        out.write({"request_id": "r0", "future_field": 1})  # older or newer versions' lines
    with rd.JsonlWriter(tmp_path / rd.REPLIES) as out:
        out.write(reply.to_json())
    assert rd.read_sent(tmp_path) == [sent, rd.SentLine(request_id="r0")]
    assert rd.read_replies(tmp_path) == [reply]


def test_run_info_round_trip_and_errors(tmp_path):
    assert rd.read_run_info(tmp_path) is None
    info = {"run_id": "x", "finished": False, "arms": ["A", "B"], "text": "größe"}
    rd.write_run_info(tmp_path, info)
    assert rd.read_run_info(tmp_path) == info
    (tmp_path / rd.RUN_JSON).write_text("[1, 2]", encoding="utf-8")
    try:
        rd.read_run_info(tmp_path)
    except rd.RunDirError as exc:
        assert "JSON object" in str(exc)
    else:
        raise AssertionError("a run.json that is not an object must be refused")


def test_run_ids_sort_by_time_and_differ():
    first, second = rd.new_run_id(1_700_000_000), rd.new_run_id(1_700_000_001)
    assert re.fullmatch(r"\d{8}T\d{6}-[0-9a-f]{6}", first)
    assert first < second and rd.new_run_id(5) != rd.new_run_id(5)
    assert rd.cpu_model()


def test_cli_refuses_bad_arguments_before_any_broker():
    runner = CliRunner()
    cases = [
        (["run", "--speed", "2", "--rate", "5"], "not both"),
        (["run", "--closed-loop"], "needs --arms"),
        (["run", "--format", "xml"], "--format must be one of"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert message in result.output


def test_cli_report_needs_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "no run.json" in result.output


def test_a_run_without_a_usable_log_fails_before_writing_anything(tmp_path):
    with pytest.raises(ValueError, match="needs --log"):
        run_replay(ReplayConfig(log_format="jsonl", runs_root=tmp_path))
    with pytest.raises(FileNotFoundError, match="not found"):
        run_replay(
            ReplayConfig(log_path=tmp_path / "nope.jsonl", log_format="jsonl", runs_root=tmp_path)
        )
    assert list(tmp_path.iterdir()) == []


def test_resuming_with_a_changed_log_is_refused(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(
        '{"conversation_id": "c", "turn": 0, "source_lang": "en", '
        '"target_lang": "de", "text": "hi"}\n',
        encoding="utf-8",
    )
    run = tmp_path / "run"
    info = {
        "run_id": "r",
        "created_at_ms": 0,
        "arms": [],
        "reply_topic": "tolk.replay.r",
        "languages": [],
        "log": {"path": str(log), "format": "jsonl", "sha256": rd.sha256(log)},
        "pacing": {"speed": 1.0, "rate": None},
        "limit": None,
        "seed": 0,
        "wait_s": 1.0,
        "finished": False,
    }
    rd.write_run_info(run, info)
    log.write_text(log.read_text(encoding="utf-8") * 2, encoding="utf-8")
    with pytest.raises(rd.RunDirError, match="changed since the run started"):
        run_replay(ReplayConfig(run_dir=run))
