"""The load test's pure parts: rate parsing, the text mix, nearest-rank percentiles, summary."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from workers.loadtest.bridge import Completion
from workers.loadtest.cli import parse_rates
from workers.loadtest.report import language_summary, nearest_rank, write_summary
from workers.loadtest.texts import support_mix


def test_parse_rates() -> None:
    assert parse_rates("de=2, FR=0.5") == {"de": 2.0, "fr": 0.5}
    for bad in ("", "de", "de=0", "de=-1", "de=x", "=2", "de=1,de=2"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_support_mix_is_real_texts_for_the_language_and_seeded() -> None:
    de = support_mix("de", with_bcontrast=False)
    assert len(de) >= 30 and len({t.text for t in de}) == len(de)
    assert all(t.source_lang != "de" for t in de)  # nothing is "translated" into itself
    assert "Hi there, how can I help today?" in {t.text for t in de}
    en = support_mix("en", with_bcontrast=False)
    assert en and all(t.source_lang == "de" for t in en)
    assert support_mix("fr", seed=1, with_bcontrast=False) == support_mix(
        "fr", seed=1, with_bcontrast=False
    )
    assert support_mix("fr", seed=1, with_bcontrast=False) != support_mix(
        "fr", seed=2, with_bcontrast=False
    )


def test_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert nearest_rank(values, 50) == 50.0
    assert nearest_rank(values, 95) == 95.0
    assert nearest_rank(values, 99) == 99.0
    assert nearest_rank([3.0], 99) == 3.0
    assert nearest_rank([1.0, 2.0, 3.0], 50) == 2.0  # ceil(1.5) = 2nd
    assert str(nearest_rank([], 50)) == "nan"


def _c(lang: str, latency: float, status: str = "OK") -> Completion:
    return Completion(lang, f"r{latency}", status, 0.0, latency, 0.001, 3, 10, None)


def test_summary_uses_ok_replies_only_and_counts_every_status(tmp_path: Path) -> None:
    withheld = dataclasses.replace(_c("de", 0.5, "ERROR"), withheld=True)
    done = [_c("de", x / 10) for x in range(1, 21)] + [_c("de", 9.0, "TIMEOUT"), _c("fr", 0.2)]
    done += [_c("de", 0.4, "ERROR"), withheld]
    row = language_summary("de", [c for c in done if c.lang == "de"], 2.0, 10.0)
    assert row["sent"] == 23 and row["ok"] == 20
    assert row["statuses"] == {"ERROR": 1, "OK": 20, "TIMEOUT": 1, "WITHHELD": 1}
    assert row["p50_ms"] == 1000.0 and row["p95_ms"] == 1900.0 and row["p99_ms"] == 2000.0
    assert row["throughput_per_s"] == 2.0 and row["offered_per_s"] == 2.3
    summary = write_summary(tmp_path, done, {"de": 2.0, "fr": 1.0, "it": 1.0}, 10.0, {"x": 1})
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    by_lang = {r["lang"]: r for r in summary["languages"]}
    assert by_lang["it"]["sent"] == 0 and by_lang["it"]["p50_ms"] is None
    assert (tmp_path / "summary.csv").read_text().count("\n") == 4  # header + 3 languages


def test_importing_the_locust_user_leaves_threading_unpatched() -> None:
    """Any module of workers.loadtest may import locust: gevent must not patch the process
    (under pytest-xdist a patched `threading` broke the worker's queue)."""
    import subprocess
    import sys

    code = (
        "import os; os.environ.pop('LOCUST_SKIP_MONKEY_PATCH', None)\n"
        "import workers.loadtest.locustfile\n"
        "from gevent import monkey\n"
        "print(monkey.is_module_patched('threading'))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "LOCUST_SKIP_MONKEY_PATCH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr


class _LateBridge:
    """A bridge whose every send holds the host up (a busy machine): the schedule runs late."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.due: list[float] = []

    def send(self, lang: str, source_lang: str, text: str, scheduled_at: float) -> None:
        import time

        time.sleep(self.hold_s)  # blocks the greenlet, as a loaded CPU would
        self.due.append(scheduled_at)

    def drain(self) -> list[Completion]:
        return []


def test_a_late_host_still_sends_the_whole_schedule_and_no_more() -> None:
    """Open loop: the count is `ceil(rate * duration)` with due times `k / rate`, however
    late the sends go out (CI once sent 18 of a 16-send schedule when the stop came late)."""
    import time

    import gevent
    from locust.env import Environment

    from workers.loadtest.locustfile import language_user
    from workers.loadtest.texts import LoadText

    bridge = _LateBridge(hold_s=0.15)
    texts = [LoadText(source_lang="en", text="Where is my parcel?")]
    user_class = language_user("de", 10.0, texts, bridge, duration_s=0.45)  # type: ignore[arg-type]
    user = user_class(Environment(user_classes=[user_class]))
    started = time.monotonic()
    greenlet = gevent.spawn(user.open_loop)
    while not user_class.finished and time.monotonic() - started < 10:
        gevent.sleep(0.01)
    gevent.sleep(0.3)  # idling after the schedule sends nothing more
    greenlet.kill()
    assert user_class.finished
    assert user_class.sent == len(bridge.due) == 5
    gaps = [b - a for a, b in zip(bridge.due, bridge.due[1:], strict=False)]
    assert all(abs(g - 0.1) < 1e-6 for g in gaps), gaps  # due times kept the rate, not the lag
    assert time.monotonic() - started > 0.7  # the sends really did run late
