"""The serving benchmark's pure parts (bench/serving*.py): arrival schedules, goodput with
misses, percentiles and intervals, the llama-server request and reply, the summary, ratios and
plot. No services, no model."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from bench.serving import build_requests, load_points, parse_args
from bench.serving_kafka import (
    completion_outcome,
    missing_as_timeouts,
    step_kinds_between,
    tolk_policies,
)
from bench.serving_llamaserver import PromptTexts, completion_body, parse_completion
from bench.serving_report import max_rates, plot, ratios, summarize
from bench.serving_stats import (
    Outcome,
    arrival_times,
    interval,
    language_figures,
    max_rate_within_slo,
    parse_lang_values,
    percentile,
    point_rates,
    schedule,
    stage_split,
)
from workers.loadtest.bridge import Completion
from workers.loadtest.texts import LoadText

# -- arrivals ---------------------------------------------------------------------------------


def test_constant_arrivals_have_the_rate_and_even_gaps() -> None:
    times = arrival_times(2.0, 60.0, "constant", random.Random(1))
    assert len(times) == 120
    gaps = {round(b - a, 9) for a, b in zip(times, times[1:], strict=False)}
    assert gaps == {0.5}
    assert 0.0 <= times[0] < 0.5 and times[-1] < 60.0


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    a = arrival_times(5.0, 2000.0, "poisson", random.Random("s"))
    b = arrival_times(5.0, 2000.0, "poisson", random.Random("s"))
    c = arrival_times(5.0, 2000.0, "poisson", random.Random("t"))
    assert a == b and a != c
    assert abs(len(a) / 2000.0 - 5.0) < 0.15  # 10 000 events: sd ~1 %
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    cv = math.sqrt(sum((g - 0.2) ** 2 for g in gaps) / len(gaps)) / 0.2
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1 (constant: 0)


def test_schedule_is_per_language_and_time_ordered() -> None:
    one = schedule({"de": 1.0}, 30.0, "poisson", 7)
    two = schedule({"de": 1.0, "en": 3.0}, 30.0, "poisson", 7)
    assert [t for t, lang in two if lang == "de"] == [t for t, _ in one]  # de's own stream
    assert [t for t, _ in two] == sorted(t for t, _ in two)
    assert 60 < sum(1 for _, lang in two if lang == "en") < 120
    with pytest.raises(ValueError):
        arrival_times(1.0, 10.0, "bursty", random.Random(0))


def test_load_points_sweep_and_absolute() -> None:
    sweep = load_points(parse_args(["--rates", "1,4", "--mix", "de=3,en=1"]))
    assert [p["total_rate"] for p in sweep] == [1.0, 4.0]
    assert sweep[1]["rates"] == {"de": 3.0, "en": 1.0} and sweep[1]["sweep"]
    over = load_points(parse_args(["--rate", "de=3,en=0.1"]))
    assert over == [{"point": "de=3,en=0.1", "total_rate": 3.1,
                     "rates": {"de": 3.0, "en": 0.1}, "sweep": False}]  # fmt: skip
    assert point_rates(2.0, {"de": 1, "en": 1}) == {"de": 1.0, "en": 1.0}
    for bad in ("de", "de=0", "de=1,de=2", "de=x", ""):
        with pytest.raises(ValueError):
            parse_lang_values(bad)


def test_build_requests_cycles_each_languages_texts() -> None:
    texts = {"de": [LoadText("en", "a"), LoadText("en", "b")], "en": [LoadText("de", "x")]}
    reqs = build_requests({"de": 3.0, "en": 1.0}, 2.0, "constant", 0, texts)
    assert [r[3] for r in reqs if r[1] == "de"] == ["a", "b", "a", "b", "a", "b"]
    assert {(r[2], r[3]) for r in reqs if r[1] == "en"} == {("de", "x")}


# -- goodput, percentiles, intervals ---------------------------------------------------------


def _ok(lat: float, lang: str = "de") -> Outcome:
    return Outcome(lang, "OK", lat, lat / 2, 5)


def test_goodput_counts_every_miss_against_offered() -> None:
    outcomes = [_ok(0.5), _ok(1.0), _ok(3.0)]  # one OK beyond the 2 s SLO
    outcomes += [Outcome("de", s, 0.01) for s in ("EXPIRED", "REJECTED", "ERROR", "WITHHELD")]
    outcomes += [Outcome("de", "TIMEOUT", None)]
    f = language_figures(outcomes, slo_s=2.0, rate=1.0, window_s=8.0)
    assert f["offered"] == 8 and f["ok"] == 3 and f["good"] == 2
    assert f["goodput"] == 0.25
    assert f["statuses"]["WITHHELD"] == 1 and f["statuses"]["TIMEOUT"] == 1
    assert f["p50_ok_s"] == 1.0 and f["p99_ok_s"] == 3.0
    assert f["p50_s"] is None  # more than half missed: the median is a miss
    assert f["ttft_p50_s"] == 0.5


def test_dropping_work_never_raises_goodput_or_lowers_the_offered_tail() -> None:
    served = [_ok(0.2 + 0.01 * i) for i in range(98)] + [_ok(2.5), _ok(3.0)]
    shed = served[:98] + [Outcome("de", "REJECTED", 0.001)] * 2  # turn the slow two away
    a = language_figures(served, slo_s=2.0, rate=1.0, window_s=100.0)
    b = language_figures(shed, slo_s=2.0, rate=1.0, window_s=100.0)
    assert b["goodput"] <= a["goodput"] == 0.98
    assert a["p99_s"] == 2.5 and b["p99_s"] is None  # the offered P99 is a miss
    assert b["p99_ok_s"] < a["p99_ok_s"]  # the OK-only tail does improve: why p99_s exists


def test_withheld_answers_are_counted_apart_in_the_served_tail() -> None:
    """A withheld answer (a quality decision, issue #28) counts at its reply's latency in
    `p*_served_s` and as a miss everywhere else; a service miss stays infinite in both."""
    oks = [_ok(0.2 + 0.01 * i) for i in range(97)]
    withheld = [Outcome("de", "WITHHELD", 0.4), Outcome("de", "WITHHELD", 0.5)]
    f = language_figures(oks + withheld + [_ok(0.3)], slo_s=2.0, rate=1.0, window_s=100.0)
    assert f["p99_s"] is None  # over offered, withheld is a miss: the tail falls on one
    assert f["p99_served_s"] == pytest.approx(1.15)  # counted apart: the tail is an OK reply
    assert f["withheld"] == 0.02 and f["goodput"] == 0.98  # goodput still counts it a miss
    rejected = [Outcome("de", "REJECTED", 0.001)] * 2
    late = language_figures(oks[:96] + withheld + rejected, slo_s=2.0, rate=1.0, window_s=100.0)
    assert late["p99_served_s"] is None  # a service miss in the tail stays a miss
    slow_withheld = [Outcome("de", "WITHHELD", 5.0)] * 2
    g = language_figures(oks + slow_withheld + [_ok(0.3)], slo_s=2.0, rate=1.0, window_s=100.0)
    assert g["p99_served_s"] == 5.0  # a withheld answer's own latency counts in that tail


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    random.Random(0).shuffle(xs)
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0
    assert percentile(xs, 100) == 100.0 and percentile([], 50) is None
    assert percentile([1.0, math.inf], 50) == 1.0 and percentile([1.0, math.inf], 99) is None


def test_interval_mean_min_max_t() -> None:
    iv = interval([1.0, 2.0, 3.0])
    assert (iv["mean"], iv["min"], iv["max"], iv["n"]) == (2.0, 1.0, 3.0, 3)
    half = 4.303 * 1.0 / math.sqrt(3)
    assert iv["ci95"] == [round(2.0 - half, 4), round(2.0 + half, 4)]
    assert interval([1.5])["ci95"] is None and interval([1.5])["mean"] == 1.5
    unbounded = interval([1.0, None, 2.0])
    assert unbounded["mean"] is None and unbounded["values"] == [1.0, None, 2.0]
    assert interval([])["n"] == 0


def test_max_rate_within_slo_stops_at_the_first_failing_rate() -> None:
    assert max_rate_within_slo({1: [0.5, 0.9], 2: [1.9], 4: [2.5], 8: [1.0]}, 2.0) == 2
    assert max_rate_within_slo({1: [0.5, None], 2: [1.0]}, 2.0) is None
    assert max_rate_within_slo({1: [2.1]}, 2.0) is None


# -- the Kafka side's outcomes ----------------------------------------------------------------


def _completion(status: str, latency: float, **kw: object) -> Completion:
    return Completion("de", "r", status, 0.0, latency, 0.01, 4, 10, None, **kw)  # type: ignore[arg-type]


def test_completion_outcome_withheld_timeout_ttft() -> None:
    ok = completion_outcome(_completion("OK", 1.5, decode_s=0.5))
    assert ok.status == "OK" and ok.latency_s == 1.5 and ok.ttft_s == pytest.approx(1.0)
    withheld = completion_outcome(_completion("ERROR", 1.0, withheld=True))
    assert withheld.status == "WITHHELD" and withheld.ttft_s is None
    timeout = completion_outcome(_completion("TIMEOUT", 60.0))
    assert timeout.latency_s is None and not timeout.ok


def test_stage_split_accounts_for_the_whole_latency() -> None:
    worker = {"queue": 0.05, "prefill": 0.1, "decode": 0.3, "total": 0.5}
    st = stage_split(0.62, worker)
    assert st["finish"] == pytest.approx(0.05) and st["outside"] == pytest.approx(0.12)
    assert sum(st.values()) == pytest.approx(0.62)
    assert stage_split(0.62, {"decode": 0.3}) == {}  # no total: nothing to split
    # clocks of two processes: a total above the latency gives no negative stage
    assert stage_split(0.4, worker)["outside"] == 0.0


def test_completion_outcome_carries_stages_and_figures_show_them() -> None:
    worker_s = {"queue": 0.01, "prefill": 0.1, "decode": 0.4, "total": 0.55}
    ok = completion_outcome(_completion("OK", 0.6, decode_s=0.4, worker_s=worker_s))
    assert ok.stages["outside"] == pytest.approx(0.05)
    assert completion_outcome(_completion("ERROR", 0.6, worker_s=worker_s)).stages == {}
    fig = language_figures([ok, Outcome("de", "TIMEOUT", None)], slo_s=2.0, rate=1.0, window_s=1.0)
    assert fig["stages_s"]["decode"]["p50"] == pytest.approx(0.4)
    assert set(fig["stages_s"]) == {"queue", "prefill", "decode", "finish", "outside"}


def test_step_kinds_between_two_scrapes() -> None:
    before = {"decode": (100.0, 2.0), "mixed": (4.0, 0.3)}
    after = {"decode": (150.0, 3.25), "mixed": (4.0, 0.3), "prefill": (2.0, 0.18)}
    got = step_kinds_between(before, after)
    assert got == {
        "decode": {"steps": 50, "mean_ms": 25.0},
        "prefill": {"steps": 2, "mean_ms": 90.0},
    }


def test_a_cascade_workers_outcomes_are_scraped_summed_over_languages() -> None:
    """bench.serving reads a cascade worker's deferral share in each point from its /metrics."""
    import socket

    from prometheus_client import CollectorRegistry, start_http_server

    from bench.serving_kafka import scrape_cascade_outcomes
    from workers.metrics import WorkerMetrics

    metrics = WorkerMetrics(registry=CollectorRegistry())
    outcomes = metrics.stages.cascade_outcomes_total
    outcomes.labels(lang="de", outcome="small").inc(2)
    outcomes.labels(lang="en", outcome="small").inc()
    outcomes.labels(lang="de", outcome="deferred").inc()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        got = scrape_cascade_outcomes(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        thread.join(5)
    assert got == {"small": 3.0, "deferred": 1.0}
    assert scrape_cascade_outcomes(f"http://127.0.0.1:{port}/metrics") == {}  # gone: nothing


def test_missing_replies_become_timeouts_per_language() -> None:
    reqs = [(0.0, "de", "en", "a"), (0.1, "de", "en", "b"), (0.2, "en", "de", "c")]
    missing = missing_as_timeouts(reqs, [Outcome("de", "OK", 0.3)])
    assert sorted((o.lang, o.status) for o in missing) == [("de", "TIMEOUT"), ("en", "TIMEOUT")]


def test_tolk_policies_keep_default_weights_and_set_the_cap() -> None:
    from workers.fairness.policy import parse_policies

    spec = tolk_policies(["de", "en", "xx"], 64)
    parsed = parse_policies(spec)
    assert parsed["de"].weight == 4.0 and parsed["de"].slo_p99_s == 2.0
    assert parsed["en"].weight == 3.0 and parsed["xx"].weight == 1.0
    assert {p.max_new_tokens for p in parsed.values()} == {64}


# -- llama-server --------------------------------------------------------------------------------

COMPLETION = {
    "content": " Hello, how are you?\nGerman: extra",
    "tokens_predicted": 7,
    "tokens_evaluated": 312,
    "tokens_cached": 300,
    "stop": True,
    "stop_type": "word",
    "stopping_word": "\n",
    "timings": {
        "cache_n": 300,
        "prompt_n": 12,
        "prompt_ms": 41.5,
        "predicted_n": 7,
        "predicted_ms": 88.25,
    },  # fmt: skip
}


def test_parse_completion_ok() -> None:
    r = parse_completion(200, json.dumps(COMPLETION).encode())
    assert r.status == "OK" and r.text == "Hello, how are you?"  # newline rule, trimmed
    assert (r.tokens_in, r.tokens_out, r.cached_tokens) == (312, 7, 300)
    assert (r.prompt_ms, r.predicted_ms, r.stop_type) == (41.5, 88.25, "word")


def test_parse_completion_errors() -> None:
    err = {"error": {"code": 400, "message": "the request exceeds the context", "type": "x"}}
    r = parse_completion(400, json.dumps(err))
    assert r.status == "ERROR" and "exceeds the context" in (r.error or "")
    assert parse_completion(503, b"<html>busy</html>").status == "ERROR"
    assert parse_completion(200, {"error": "loading model"}).status == "ERROR"


def test_completion_body_and_prompt_text_are_tolks() -> None:
    prompts = PromptTexts("gemma3")
    text = prompts("Hallo, wie geht es?", "de", "en")
    assert text.startswith("Translate each text into English.")
    assert text.endswith("German: Hallo, wie geht es?\nEnglish:")
    body = completion_body(text, 64, prompts.stop_at_newline)
    assert body["stop"] == ["\n"] and body["n_predict"] == 64 and body["cache_prompt"] is True
    assert body["temperature"] == 0.0 and body["prompt"] == text


# -- summary, ratios, plot --------------------------------------------------------------------


def _run(system: str, rep: int, total: float, p99: float | None, goodput: float) -> dict:
    fig = {"p50_s": 0.4, "p95_s": 0.8, "p99_s": p99, "p50_ok_s": 0.4, "p99_ok_s": p99 or 9.0,
           "goodput": goodput, "statuses": {"OK": 10}}  # fmt: skip
    return {"system": system, "repeat": rep, "point": f"{total:g}", "total_rate": total,
            "rates": {"de": total}, "languages": {"de": fig, "all": fig}}  # fmt: skip


def test_summary_ratios_max_rate_and_plot(tmp_path: Path) -> None:
    runs = [_run("tolk", r, t, p, 1.0) for r in (0, 1) for t, p in ((1, 0.9), (2, 1.5), (4, 2.5))]
    runs += [_run("llama-http", r, t, p, 0.9) for r in (0, 1) for t, p in ((1, 1.8), (2, None))]
    summary = summarize(runs)
    de = summary["tolk"]["2"]["languages"]["de"]
    assert de["p99_s"]["mean"] == 1.5 and de["p99_s"]["n"] == 2 and de["statuses"] == {"OK": 20}
    assert max_rates(runs, 2.0, ["1", "2", "4"]) == {"tolk": 2.0, "llama-http": 1.0}
    # judged on the served tail (withheld counted apart): the runs' own p99_served_s figures
    for run in runs:
        for fig in run["languages"].values():
            fig["p99_served_s"] = 0.5 if run["system"] == "tolk" else fig["p99_s"]
    served = max_rates(runs, 2.0, ["1", "2", "4"], "p99_served_s")
    assert served == {"tolk": 4.0, "llama-http": 1.0}
    r = ratios(summary)["llama-http"]
    assert r["1"]["de"]["p99_s"] == 0.5 and r["1"]["de"]["goodput"] == pytest.approx(1.111, 1e-3)
    assert r["2"]["de"]["p99_s"] is None  # the anchor's P99 was a miss
    png = plot(summary, tmp_path / "s.png", slo_s=2.0, title="t")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


class _FakeClient:
    """The bridge's client without Kafka: OK with a decode time, a withheld answer, a
    timeout."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def translate(self, text: str, **kw: object) -> object:
        from workers.client.types import TranslationReply, TranslationTimeout

        if text == "slow":
            raise TranslationTimeout("r-slow", 1.0)
        withheld = text == "bad"
        return TranslationReply(
            request_id=f"r-{text}", status="ERROR" if withheld else "OK",
            text="" if withheld else text.upper(), error=None, model_version="m",
            source_lang="en", target_lang="de",
            timings={"queue_ms": 1.0, "prefill_ms": 2.0, "decode_ms": 30.0, "total_ms": 40.0},
            tokens_in=3, tokens_out=2, cached_prefix_tokens=0, worker_id="w", completed_at=0,
            conversation_id=None,
            metadata={"tolk.faithful": "withheld"} if withheld else {},
        )  # fmt: skip


def test_drive_bridge_keeps_every_offered_request() -> None:
    from bench.serving_kafka import drive_bridge
    from workers.loadtest.bridge import KafkaBridge

    bridge = KafkaBridge("unused:9092", client_factory=lambda: _FakeClient())  # type: ignore[arg-type,return-value]
    bridge.start()
    try:
        reqs = [(0.0, "de", "en", "good"), (0.05, "de", "en", "bad"), (0.1, "en", "de", "slow")]
        outcomes, window = drive_bridge(bridge, reqs, timeout_s=2.0)
    finally:
        bridge.close()
    by = {o.status: o for o in outcomes}
    assert sorted(by) == ["OK", "TIMEOUT", "WITHHELD"] and len(outcomes) == 3
    ok = by["OK"]
    assert ok.latency_s is not None and ok.ttft_s == pytest.approx(ok.latency_s - 0.03)
    assert by["TIMEOUT"].lang == "en" and by["TIMEOUT"].latency_s is None
    assert 0.1 <= window < 1.0


def test_wait_tuned_reads_the_configuration_the_tuner_settled_on(tmp_path: Path) -> None:
    """bench.serving measures a first start once its tuner settled (workers/engine/tuner.py)
    and records which configuration that was; bench.first_start's flags name it again."""
    import subprocess
    import sys

    from bench.first_start import flags_of
    from bench.serving_kafka import wait_tuned

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    log = tmp_path / "worker.log"
    try:
        log.write_text("auto config chose int8+compiled: fastest ...\nworker w consuming ['t']\n")
        assert wait_tuned(proc, log, timeout_s=5) is None  # a stored probe: no tuner probe
        log.write_text(
            "auto config chose int8: chosen without measuring (...)\n"
            "config tuner: probing (first start)\nworker w consuming ['t']\n"
            "config tuner: switched int8 -> int8+compiled: first start (now: int8+compiled: x)\n"
        )
        seconds, label = wait_tuned(proc, log, timeout_s=5) or (None, None)
        assert label == "int8+compiled" and seconds is not None
        log.write_text(
            "config tuner: probing (x)\nconfig tuner: keeping float32 (float32: fastest)\n"
        )
        assert (wait_tuned(proc, log, timeout_s=5) or (0, ""))[1] == "float32"
    finally:
        proc.kill()
        proc.wait()
    assert flags_of("int8+compiled") == "--quantize int8 --compile-decode"
    assert flags_of("float32") == "--quantize none --no-compile-decode"


def test_first_start_anchors_on_the_faster_llama_server_build_per_rate() -> None:
    """Issue #47 compares a first start with "the faster of the two" llama-server builds: per
    rate the build with the lower P50 is the anchor, and its figures say which build it was."""
    from bench.first_start import faster_per_rate

    builds = {
        "avx512": {"1": {"p50_s": 0.26, "p99_ok_s": 0.7}, "2": {"p50_s": 0.20, "p99_ok_s": 0.9}},
        "native": {"1": {"p50_s": 0.24, "p99_ok_s": 0.8}, "2": {"p50_s": None, "p99_ok_s": None}},
    }
    anchor = faster_per_rate(builds)
    assert anchor["1"] == {"p50_s": 0.24, "p99_ok_s": 0.8, "build": "native"}
    assert anchor["2"]["build"] == "avx512" and anchor["2"]["p50_s"] == 0.20


def test_llama_server_speculates_with_the_draft_model_asked_for(tmp_path: Path) -> None:
    """Issue #43's anchor is llama-server's best, with and without `-md` (a draft model)."""
    from bench.serving import llama_draft_args, parse_args

    assert llama_draft_args(parse_args([])) == []
    draft = tmp_path / "draft.gguf"
    args = parse_args(["--llama-draft", str(draft), "--llama-draft-max", "8"])
    flags = llama_draft_args(args)
    assert flags[:4] == ["-md", str(draft), "--draft-max", "8"]


def test_llama_http_draft_refuses_to_start_without_a_draft_model() -> None:
    """The speculating anchor without a draft would be plain llama-server under another name."""
    from bench.serving import parse_args, run

    with pytest.raises(SystemExit, match="needs --llama-draft"):
        run(parse_args(["--systems", "tolk,llama-http-draft", "--rates", "1"]))


def test_repeated_starts_of_an_explicit_configuration_count_by_their_median() -> None:
    """bench.first_start --explicit-repeats: one start of the best configuration is as noisy as
    one first start; the median of several is the figure, each start's P50 kept beside it."""
    from bench.first_start import median_of_starts

    runs = [
        {"1": {"p50_s": p50, "p99_ok_s": p99, "statuses": {"OK": 60}}}
        for p50, p99 in ((0.121, 0.40), (0.154, 0.52), (0.133, 0.45))
    ]
    merged = median_of_starts(runs)["1"]
    assert merged["p50_s"] == 0.133 and merged["p99_ok_s"] == 0.45
    assert merged["p50_runs"] == [0.121, 0.154, 0.133]
    missed = median_of_starts([{"1": {"p50_s": None, "p99_ok_s": None}}])["1"]
    assert missed["p50_s"] is None and missed["p50_runs"] == []


def test_a_paired_first_start_is_judged_against_the_explicit_starts_right_after_it() -> None:
    """bench.first_start --paired: the host's pace moves by more than 10 % over an hour, so a
    first start is compared with the fastest explicit start of its own pair, rate by rate."""
    from bench.first_start import paired_ratios

    steps = {"decode": {"steps": 900, "mean_ms": 22.0}}
    row = {
        "rates": {
            "1": {"p50_s": 0.130, "engine_steps": steps},
            "2": {"p50_s": 0.120},
            "4": {"p50_s": None},
        }
    }
    pair = {
        "int8+compiled": {
            "1": {"p50_s": 0.125, "engine_steps": {"decode": {"steps": 950, "mean_ms": 20.0}}},
            "2": {"p50_s": 0.100},
            "4": {"p50_s": 0.2},
        },
        "int8": {
            "1": {"p50_s": 0.140, "engine_steps": {"decode": {"steps": 950, "mean_ms": 30.0}}},
            "2": {"p50_s": None},
        },
    }
    paired_ratios(row, pair)
    assert row["paired"] is pair
    one, two, four = row["rates"]["1"], row["rates"]["2"], row["rates"]["4"]
    assert one["p50_over_paired"] == 1.04 and one["within_paired"]
    assert two["p50_over_paired"] == 1.2 and not two["within_paired"]
    assert "p50_over_paired" not in four  # a first start that missed its P50 gets no ratio
    # decode steps against the start its P50 is read against (the fastest), not the slowest
    assert one["decode_ms_over_paired"] == 1.1
    assert two["decode_ms_over_paired"] is None  # no engine steps reported: no ratio


def test_each_first_start_is_read_against_its_own_anchor_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench.first_start --paired --anchor-each: llama-server runs after each start's explicit
    starts (not once at the end), and each start's ratio uses its own anchor."""
    from bench import first_start, serving

    order: list[str] = []
    anchors = iter(
        [{"1": {"p50_s": 0.40, "p99_ok_s": 2.0}}, {"1": {"p50_s": 0.30, "p99_ok_s": 1.0}}]
    )
    first_p50s = iter([0.32, 0.33])

    def fake_llama(args: object, binary: str) -> dict[str, dict[str, float]]:
        order.append("llama")
        return next(anchors)

    def fake_explicit(args: object, label: str) -> dict[str, dict[str, float]]:
        order.append("explicit")
        return {"1": {"p50_s": 0.3, "p99_ok_s": 1.0}}

    def fake_first(ns: object) -> dict[str, list[dict[str, float]]]:
        order.append("first")
        return {"starts": [{}]}

    monkeypatch.setattr(first_start, "run_llama_server", fake_llama)
    monkeypatch.setattr(first_start, "explicit_start", fake_explicit)
    monkeypatch.setattr(serving, "run", fake_first)
    monkeypatch.setattr(
        first_start, "by_rate", lambda result: {"1": {"p50_s": next(first_p50s), "p99_ok_s": 1.0}}
    )
    args = first_start.parse_args(
        ["--starts", "2", "--rates", "1", "--explicit", "int8+compiled", "--paired", "--anchor",
         "--anchor-each"]
    )  # fmt: skip
    got = first_start.run(args)
    assert order == ["first", "explicit", "llama", "first", "explicit", "llama"]
    one, two = (row["rates"]["1"] for row in got["starts"])
    assert one["p50_over_llama"] == 0.8 and two["p50_over_llama"] == 1.1  # 0.32/0.40, 0.33/0.30
    assert one["p99_ok_over_llama"] == 0.5 and two["p99_ok_over_llama"] == 1.0
    assert got["llama_http"] == {}  # no end-of-run anchor
