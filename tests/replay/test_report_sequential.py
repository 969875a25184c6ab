"""The report's anytime-valid column (replay/sequential.py) on synthetic run directories: the
per-segment scores are sacrebleu's sentence chrF and the SLO indicator, identical arms come out
equivalent, a worse arm worse, a faster one better within the SLO, a request one arm never
answered a miss for it, and the margins and SLO are the caller's."""

from __future__ import annotations

import json

import pytest
import sacrebleu
from typer.testing import CliRunner

from replay import report as report_mod
from replay import sequential
from replay.cli import app
from tests.replay.synthetic_run import arm_replies, bcontrast_requests, drop_words, write_run

N = 400


def _text(share: float):
    return lambda req: drop_words(req["reference"], share, int(req["request_id"][1:]))


def _latency(base: float):
    return lambda req: base + (int(req["request_id"][1:]) * 37) % 100  # base .. base + 99 ms


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    requests = bcontrast_requests(N)
    replies = (
        arm_replies(requests, "A", _text(0.1), _latency(300))
        + arm_replies(requests, "A'", _text(0.1), _latency(300))
        + arm_replies(requests[:-1], "B", _text(0.45), _latency(200))  # B never answers the last
    )
    return write_run(tmp_path_factory.mktemp("run"), requests, replies, ["A", "A'", "B"])


@pytest.fixture(scope="module")
def report(run_dir):
    return report_mod.build_report(run_dir, noise_pair=("A", "A'"), slo_ms=350.0)


def test_identical_arms_are_equivalent_per_segment(run_dir, report):
    """~200 identical segments per language: the CS of a zero difference is about +-0.024
    wide (a bet risks at most 3/4 of the capital, so the wealth grows at most 1.75x a
    segment): equivalent within a 0.05 margin and the default 0.03, not within 0.02."""
    wide = report_mod.build_report(
        run_dir, margins=dict.fromkeys(sequential.DEFAULT_MARGINS, 0.05), slo_ms=350.0
    )
    for gname in ("language de", "language en"):
        seq = wide["groups"][gname]["comparisons"]["A' vs A"]["sequential"]
        for name in ("chrf", "within_slo", "off_target"):
            m = seq[name]
            assert m["n"] > 150 and m["estimate"] == 0.0, (gname, name)
            assert -0.05 < m["lower"] <= 0.0 <= m["upper"] < 0.05, (gname, name)
            assert m["verdict"] == "equivalent", (gname, name, m)
        assert seq["span_kept"]["estimate"] == 0.0 and seq["span_kept"]["verdict"] != "worse"
        default = report["groups"][gname]["comparisons"]["A' vs A"]["sequential"]["chrf"]
        assert default["margin"] == 0.03 and default["verdict"] == "equivalent"
        narrow = report_mod.build_report(run_dir, margins={"chrf": 0.02}, slo_ms=350.0)
        chrf = narrow["groups"][gname]["comparisons"]["A' vs A"]["sequential"]["chrf"]
        assert chrf["verdict"] == "inconclusive" and 0.02 < chrf["upper"] < 0.03


def test_a_worse_arm_is_worse_and_a_faster_one_better_within_the_slo(report):
    for gname in ("language de", "language en"):
        seq = report["groups"][gname]["comparisons"]["B vs A"]["sequential"]
        assert seq["chrf"]["verdict"] == "worse" and seq["chrf"]["upper"] < 0, gname
        # A: 300-399 ms, about half within 350 ms; B: 200-299 ms, all within
        assert seq["within_slo"]["verdict"] == "better", gname
        assert 0.3 < seq["within_slo"]["lower"] <= seq["within_slo"]["estimate"] < 0.7


def test_a_request_one_arm_never_answered_is_a_miss_for_it(report):
    requests = bcontrast_requests(N)
    lang = requests[-1]["target_lang"]
    group = report["groups"][f"language {lang}"]["comparisons"]["B vs A"]["sequential"]
    n_lang = sum(1 for r in requests if r["target_lang"] == lang)
    assert group["within_slo"]["n"] == n_lang  # the unanswered one is scored, not dropped
    assert group["chrf"]["n"] == n_lang - 1  # chrF pairs need both OK


def test_the_per_segment_chrf_is_sacrebleus_sentence_chrf():
    req = bcontrast_requests(3)[1]
    hyp = _text(0.3)(req)
    row = sacrebleu_row(hyp, req["reference"])
    ours = sequential.METRICS[0].score({"chrf": row}, 0.0)
    assert ours == pytest.approx(sacrebleu.sentence_chrf(hyp, [req["reference"]]).score / 100)


def sacrebleu_row(hyp: str, ref: str) -> list[float]:
    from replay import quality

    return list(quality.chrf_statistics([hyp], [ref])[0])


def test_margins_and_slo_are_the_callers(run_dir):
    wide = report_mod.build_report(run_dir, margins={"within_slo": 0.9}, slo_ms=350.0)
    seq = wide["groups"]["language de"]["comparisons"]["B vs A"]["sequential"]
    assert seq["within_slo"]["margin"] == 0.9 and seq["within_slo"]["verdict"] == "equivalent"
    assert wide["sequential"]["margins"]["chrf"] == sequential.DEFAULT_MARGINS["chrf"]
    lax = report_mod.build_report(run_dir, slo_ms=10_000.0)
    both_fast = lax["groups"]["language de"]["comparisons"]["A' vs A"]["sequential"]
    assert both_fast["within_slo"]["estimate"] == 0.0


def test_parse_margins():
    assert sequential.parse_margins(None) == sequential.DEFAULT_MARGINS
    assert sequential.parse_margins("chrf=0.05")["chrf"] == 0.05
    with pytest.raises(ValueError, match="METRIC=VALUE"):
        sequential.parse_margins("bleu=0.1")
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        sequential.parse_margins("chrf=2")
    with pytest.raises(ValueError, match=r"'chrf=two'.*\(0, 1\)"):
        sequential.parse_margins("chrf=two")


def test_the_cli_writes_the_column_and_refuses_an_unknown_margin(run_dir):
    runner = CliRunner()
    bad = runner.invoke(app, ["report", str(run_dir), "--margin", "speed=0.1"])
    assert bad.exit_code == 2 and "METRIC=VALUE" in bad.output
    ok = runner.invoke(app, ["report", str(run_dir), "--margin", "chrf=0.05", "--slo-ms", "350"])
    assert ok.exit_code == 0, ok.output
    written = json.loads((run_dir / "report.json").read_text())
    assert written["sequential"]["margins"]["chrf"] == 0.05
    assert written["sequential"]["slo_ms"] == 350.0
    md = (run_dir / "report.md").read_text()
    assert "95 % CS (anytime)" in md and "| within_slo |" in md and "equivalent" in md
