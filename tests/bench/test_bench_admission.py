"""bench/admission.py: the overload scenario's cases run and report per-language figures."""

from __future__ import annotations

import json
from pathlib import Path

from bench.admission import CASES, main


def test_reports_every_case_per_language(tmp_path: Path) -> None:
    out = tmp_path / "adm.json"
    res = main(["--duration", "40", "--seeds", "0", "--lights", "it", "--out", str(out)])
    assert json.loads(out.read_text())["cases"].keys() == res["cases"].keys()
    assert set(res["cases"]) == {f"it-{name}" for name in CASES}
    for runs in res["cases"].values():
        langs = runs["0"]
        assert set(langs) == {"de", "it"}
        de = langs["de"]
        assert de["offered"] >= de["ok"] + de["rejected_at_submit"]
        assert de["rejected_at_submit"] > 0  # 3x overload: German is shed
        it = langs["it"]  # a few requests in 20 s of window, or none (goodput None)
        assert it["goodput"] is None or 0.0 <= it["goodput"] <= 1.0
        assert it["offered"] >= it["ok"]
