"""`tolk rollout start|status|promote|abort` on the real broker: events written and folded, shares
written to the control topic, an unknown language refused."""

from __future__ import annotations

import uuid

import pytest
from typer.testing import CliRunner

from tests.kafka_fixtures import kafka_bootstrap  # noqa: F401
from topics.admin import ensure_topics
from topics.catalog import arm_control_topic, catalog, rollout_events_topic
from workers.cli import app
from workers.guard.events import load_book, read_events
from workers.kafka.arm_control import read_share_table

pytestmark = pytest.mark.kafka


def test_start_promote_abort_and_status(kafka_bootstrap: str) -> None:  # noqa: F811
    prefix = f"t-rcli-{uuid.uuid4().hex[:8]}."
    ensure_topics(kafka_bootstrap, catalog(["de", "fr"], 1, prefix=prefix), timeout=30)
    env = {"TOLK_BOOTSTRAP": kafka_bootstrap, "TOLK_TOPIC_PREFIX": prefix}
    kafka = {"bootstrap.servers": kafka_bootstrap}
    events = rollout_events_topic(prefix)
    runner = CliRunner()

    def tolk(*args: str) -> str:
        out = runner.invoke(app, list(args), env=env)
        assert out.exit_code == 0, out.output
        return out.output

    assert "no rollouts" in tolk("rollout", "status")
    tolk("rollout", "start", "--arm", "v2", "--languages", "de,fr", "--share", "5")
    assert dict(read_share_table(kafka, arm_control_topic(prefix)).entries["de"]) == {
        "stable": 95.0,
        "v2": 5.0,
    }
    positions: dict[int, int] = {}  # how the guard follows the topic
    assert [e["action"] for e in read_events(kafka, events, positions=positions)] == ["START"] * 2
    assert read_events(kafka, events, positions=positions) == []
    assert "de: v2 5% -> 25%" in tolk("rollout", "promote", "-l", "de")
    assert [e["action"] for e in read_events(kafka, events, positions=positions)] == ["PROMOTE"]
    assert "fr: v2 5% -> 0%" in tolk("rollout", "abort", "-l", "fr")
    table = read_share_table(kafka, arm_control_topic(prefix))
    assert dict(table.entries["de"]) == {"stable": 75.0, "v2": 25.0}
    assert dict(table.entries["fr"]) == {"stable": 100.0, "v2": 0.0}
    status = tolk("rollout", "status")
    assert "de: stable -> v2 25% active" in status and "fr: stable -> v2 0% aborted" in status
    assert "last decision: ABORT (operator abort)" in status
    book = load_book(kafka, events)
    assert [e["action"] for e in book.history["de"]] == ["START", "PROMOTE"]
    assert (
        "fr: no active rollout"
        in runner.invoke(app, ["rollout", "promote", "-l", "fr"], env=env).output
    )
    bad = runner.invoke(
        app, ["rollout", "start", "--arm", "v2", "-l", "de", "--steps", "5,50"], env=env
    )
    assert bad.exit_code == 1 and "steps must end at 100" in bad.output
