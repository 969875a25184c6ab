"""A (re)started guard leaves the control topic alone unless a decision's shares are missing.

The defect this guards against: at start the guard wrote the shares of every rollout it knew,
which undid an operator's `tolk arms set` made since the last decision. Now it writes a
language's shares only when `events.shares_lost` says the decision's write never happened: the
language's control entry differs from the rollout state and was written before the decision.

* `shares_lost` on hand-made cases (pure);
* on the real broker: a rollout started for de and fr; an operator sets German by hand
  (`tolk arms set de stable=90 v2=10`); French gets a PROMOTE event whose shares were never
  written (a crash between the two). A `tolk guard` process started then keeps German's manual
  entry and writes French's promoted shares.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.kafka_fixtures import kafka_bootstrap  # noqa: F401
from tests.workers.polling import wait_for
from topics.admin import ensure_topics
from topics.catalog import arm_control_topic, catalog, rollout_events_topic
from workers.cli import app
from workers.guard.events import EventWriter, load_book, operator_event, shares_lost
from workers.guard.policy import RolloutState
from workers.kafka.arm_control import read_entries_since, read_share_table

ROOT = Path(__file__).resolve().parents[3]
STATE = RolloutState("v2-1", "de", "stable", "v2", share=25.0)  # stable 75, v2 25


@pytest.mark.parametrize(
    ("set_at", "entry", "lost"),
    [
        (1000, (3000, {"stable": 75.0, "v2": 25.0}), False),  # the decision's own write
        (1000, (500, {"stable": 95.0, "v2": 5.0}), True),  # older than the decision: lost
        (1000, (2000, {"stable": 90.0, "v2": 10.0}), False),  # an operator's, since: kept
        (1000, (500, {"stable": 75.0, "v2": 25.0}), False),  # already right: nothing to do
        (1000, None, True),  # no entry at all
        (1000, (2000, None), False),  # cleared by an operator since (`tolk arms clear`)
        (1000, (500, None), True),  # cleared before the decision
    ],
)
def test_shares_lost_only_when_the_entry_predates_the_decision(
    set_at: int, entry: tuple[int, dict[str, float] | None] | None, lost: bool
) -> None:
    assert shares_lost(STATE, set_at, entry) is lost


@pytest.mark.kafka
@pytest.mark.slow
def test_restarted_guard_keeps_a_manual_arms_set_and_restores_lost_shares(
    kafka_bootstrap: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"t-gshare-{run}."
    kafka = {"bootstrap.servers": kafka_bootstrap}
    ensure_topics(kafka_bootstrap, catalog(("de", "fr"), partitions=1, prefix=prefix), timeout=30)
    env = {"TOLK_BOOTSTRAP": kafka_bootstrap, "TOLK_TOPIC_PREFIX": prefix}
    cli = CliRunner()
    started = cli.invoke(
        app, ["rollout", "start", "--arm", "v2", "--languages", "de,fr", "--share", "25"], env=env
    )
    assert started.exit_code == 0, started.output
    book = load_book(kafka, rollout_events_topic(prefix))
    rollout_id = book.states["fr"].rollout_id
    # French: a promotion whose event was written and whose shares were not (a crash between)
    writer = EventWriter(kafka, rollout_events_topic(prefix), arm_control_topic(prefix))
    writer.write_event(
        operator_event(
            "PROMOTE", rollout_id=rollout_id, lang="fr", stable="stable", canary="v2",
            share_before=25.0, share_after=50.0, steps=(5.0, 25.0, 50.0, 100.0),
            decided_by="test", now_ms=int(time.time() * 1000),
        )
    )  # fmt: skip
    writer.close()
    time.sleep(0.05)  # the operator's entry is later than every event (ms clock)
    manual = cli.invoke(app, ["arms", "set", "de", "stable=90", "v2=10"], env=env)
    assert manual.exit_code == 0, manual.output
    before = read_entries_since(kafka, arm_control_topic(prefix))
    assert before["de"][1] == {"stable": 90.0, "v2": 10.0}
    assert before["fr"][1] == {"stable": 75.0, "v2": 25.0}

    log_path = tmp_path / "guard.log"
    guard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.cli",
            "guard",
            "--window-s",
            "2",
            "--app-id",
            f"guard-{run}",
            "--metrics-port",
            "0",
            "--datadir",
            str(tmp_path / "g"),
        ],  # fmt: skip
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: b"Ready" in log_path.read_bytes(), 120, "guard ready", interval=0.5)
        table = read_share_table(kafka, arm_control_topic(prefix))
    finally:
        guard.send_signal(signal.SIGTERM)
        try:
            guard.wait(20)
        except subprocess.TimeoutExpired:
            guard.kill()
    log = log_path.read_text(errors="replace")
    assert dict(table.entries["de"]) == {"stable": 90.0, "v2": 10.0}, log[-3000:]
    assert dict(table.entries["fr"]) == {"stable": 50.0, "v2": 50.0}, log[-3000:]
    assert f"rollout {rollout_id} fr: shares" in log
    assert f"rollout {rollout_id} de: shares" not in log
