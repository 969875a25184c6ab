"""`--format wmt-csv` reads the CSV files the WMT chat shared tasks publish, unchanged.

The fixtures (tests/replay/wmt_chat/, README there) have the official headers: WMT 2022's
`doc_id, source_language, target_language, source_segment, pe_segment, translation_direction`,
its en-fr file's other order (`translation_direction` before `pe_segment`), its test files
without references, and WMT 2024's `source_language, target_language, source, reference,
doc_id, client_id, sender, tags`. The reader used to refuse all of them ("header lacks the
columns reference, sender"). Then one of them goes through `tolk replay run` on the real broker
to a stand-in arm: every row sent and answered, no row a problem.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from replay.logs import read_log
from tests.kafka_fixtures import unique_name
from tests.replay.fake_arms import FakeArm
from topics.admin import ensure_topics
from topics.catalog import catalog, request_topic

FIXTURES = Path(__file__).resolve().parent / "wmt_chat"


def _rows(name: str) -> list[tuple]:
    contents = read_log(FIXTURES / name, "wmt-csv")
    assert contents.problems == [], contents.problems
    return [
        (r.conversation_id, r.turn, r.source_lang, r.target_lang, r.text, r.reference, r.sender)
        for r in contents.records
    ]


def test_wmt22_en_de_official_columns() -> None:
    rows = _rows("wmt22-en-de.csv")
    doc = "en_de_#CLIENT-07#_default_2021-02-03-1"
    assert rows[0] == (
        doc, 0, "de", "en", 'Hallo, mein eReader zeigt "Fehler 12" an.',
        'Hello, my eReader shows "Error 12".', "customer",
    )  # fmt: skip
    assert rows[2] == (
        doc, 2, "en", "de", "Thanks for waiting, I will check your account now.",
        "Danke fürs Warten, ich prüfe jetzt dein Konto.", "agent",
    )  # fmt: skip
    assert [r[1] for r in rows] == [0, 1, 2, 3, 4, 0, 1]  # numbered per doc_id, file order
    assert {r[6] for r in rows} == {"customer", "agent"}
    assert all(r[5] for r in rows)  # every row has its post-edited reference


def test_wmt22_en_fr_other_column_order_reads_the_same_fields() -> None:
    rows = _rows("wmt22-en-fr.csv")
    assert rows[0][2:] == (
        "fr", "en", "Bonjour, ma liseuse ne s'allume plus.",
        "Hello, my e-reader no longer turns on.", "customer",
    )  # fmt: skip
    assert rows[2][4:] == (
        "Please hold the power button for 30 seconds, then release it.",
        "Veuillez maintenir le bouton d'alimentation pendant 30 secondes, puis relâchez-le.",
        "agent",
    )
    assert [r[1] for r in rows] == [0, 1, 2, 3]


def test_wmt22_test_file_without_references() -> None:
    rows = _rows("wmt22-test-en-de.csv")
    assert [(r[2], r[3], r[5], r[6]) for r in rows] == [
        ("de", "en", None, "customer"),
        ("en", "de", None, "agent"),
    ]


def test_wmt24_columns_source_reference_sender() -> None:
    rows = _rows("wmt24-en-de.csv")
    assert rows[1] == (
        "63a1c0ffee00000000000001", 1, "en", "de", "May I have the email address of your account?",
        "Darf ich die E-Mail-Adresse Ihres Kontos haben?", "agent",
    )  # fmt: skip
    assert len(rows) == 4


def test_todays_names_still_read_and_a_missing_text_column_is_named(tmp_path: Path) -> None:
    own = tmp_path / "own.csv"
    own.write_text(
        "\ufeffsender,doc_id,reference,source_language,target_language,source_segment\n"
        "agent,d1,Danke!,en,de,Thanks!\n",
        encoding="utf-8",
    )
    (record,) = read_log(own, "wmt-csv").records
    assert (record.text, record.reference, record.sender) == ("Thanks!", "Danke!", "agent")
    bad = tmp_path / "bad.csv"
    bad.write_text("doc_id,source_language,target_language,mt_segment\nd,en,de,x\n")
    contents = read_log(bad, "wmt-csv")
    assert contents.records == []
    assert contents.problems[0].reason == "header lacks the columns source_segment or source"


@pytest.mark.kafka
@pytest.mark.slow
def test_tolk_replay_run_replays_the_official_en_fr_file_unchanged(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from replay.cli import app

    prefix = unique_name("wmt22") + "."
    ensure_topics(kafka_bootstrap, list(catalog(["en", "fr"], prefix=prefix)))
    log = tmp_path / "test-bilingual-en-fr.with-ref.csv"
    shutil.copyfile(FIXTURES / "wmt22-en-fr.csv", log)  # byte for byte
    topics = [request_topic(lang, prefix) for lang in ("en", "fr")]
    arm = FakeArm(kafka_bootstrap, topics, "A", f"{prefix}workers.A")
    env = {"TOLK_BOOTSTRAP": kafka_bootstrap, "TOLK_TOPIC_PREFIX": prefix}
    args = ["run", "--log", str(log), "--format", "wmt-csv", "--rate", "50", "--arms", "A",
            "--run-dir", str(tmp_path / "run"), "--wait-s", "20"]  # fmt: skip
    try:
        result = CliRunner().invoke(app, args, env=env)
    finally:
        arm.stop()
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["problems"] == 0
    assert summary["sent"] == 4 and summary["answered"] == {"A": 4}
    assert sorted(s.target_lang for s in arm.seen) == ["en", "en", "fr", "fr"]
