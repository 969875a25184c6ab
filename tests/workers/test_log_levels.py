"""`--log-level` of `tolk guard` and `tolk worker` (workers/log_levels.py): every level name,
in any case and in its short forms, sets that level on the root logger and reaches faust as a
name faust understands; an unknown one is refused with the names, not a traceback.

The commands run in-process up to the point where they would reach Kafka (`run_guard` and the
worker's broker check are replaced), with the root logger's handlers emptied for the test so
that `logging.basicConfig` really applies the level (under pytest it otherwise sees the
capture handler and does nothing, which would hide the bug: "warning" used to become
"WARNINGING", which `basicConfig` refuses with a ValueError).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from workers.cli import app
from workers.log_levels import parse_log_level

LEVELS = [  # (what a user types, the level it means)
    ("debug", logging.DEBUG),
    ("info", logging.INFO),
    ("warning", logging.WARNING),
    ("warn", logging.WARNING),
    ("error", logging.ERROR),
    ("critical", logging.CRITICAL),
    ("crit", logging.CRITICAL),
    ("fatal", logging.CRITICAL),
    ("WARNING", logging.WARNING),
    ("Critical", logging.CRITICAL),
    ("40", logging.ERROR),
]
ENV = {"TOLK_BOOTSTRAP": "127.0.0.1:1", "TOLK_TOPIC_PREFIX": "t-levels."}


@contextmanager
def bare_root() -> Iterator[logging.Logger]:
    """The root logger without handlers (as in a fresh process; pytest adds its capture
    handler for the test's call, so this runs inside the test); restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers, root.level
    root.handlers = []
    try:
        yield root
    finally:
        root.handlers = handlers
        root.setLevel(level)


def invoke(args: list[str]) -> tuple[Any, int]:
    """`tolk ARGS` in-process on a bare root logger: (result, the root level it left)."""
    with bare_root() as root:
        out = CliRunner().invoke(app, args, env=ENV)
        return out, root.level


@pytest.mark.parametrize(("typed", "number"), LEVELS)
def test_parse_log_level_every_name_and_alias(typed: str, number: int) -> None:
    name = parse_log_level(typed)
    assert logging.getLevelName(name) == number


def test_parse_log_level_refuses_unknown_names_with_the_choices() -> None:
    for bad in ("warninging", "verbose", "", "31"):
        with pytest.raises(ValueError, match="one of debug, info, warning, warn"):
            parse_log_level(bad)


@pytest.mark.parametrize(("typed", "number"), LEVELS)
def test_guard_log_level_sets_the_root_level_and_faust_understands_it(
    typed: str, number: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mode.utils.logging import level_number

    import workers.guard.app as guard_app

    seen: dict[str, Any] = {}

    def fake_run_guard(config: Any, *, loglevel: str = "info", **kw: Any) -> None:
        seen["loglevel"] = loglevel

    monkeypatch.setattr(guard_app, "run_guard", fake_run_guard)
    monkeypatch.setattr("topics.cluster.check_broker", lambda conf: None)
    out, level = invoke(["guard", "--log-level", typed, "--metrics-port", "0"])
    assert out.exit_code == 0, (out.output, out.exception)
    assert level == number
    assert level_number(seen["loglevel"]) == number  # what faust's Worker does with it


def test_guard_refuses_an_unknown_level_without_a_traceback() -> None:
    out, _ = invoke(["guard", "--log-level", "loud"])
    assert out.exit_code == 2
    assert "unknown log level 'loud'" in out.output
    assert not isinstance(out.exception, ValueError)


@pytest.mark.parametrize(("typed", "number"), LEVELS)
def test_worker_log_level_sets_the_root_level(
    typed: str, number: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import workers.cli as cli

    def stop_before_kafka(settings: Any) -> None:
        raise typer.Exit(7)

    monkeypatch.setattr(cli, "_check_broker_or_exit", stop_before_kafka)
    out, level = invoke(["worker", "--log-level", typed])
    assert out.exit_code == 7, (out.output, out.exception)
    assert level == number
