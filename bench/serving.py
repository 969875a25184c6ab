"""Serving benchmark: tolk against llama-server under the same open-loop load, per language.

    python -m bench.serving --rates 1,2,4 --mix de=0.5,en=0.5 --duration 120 --repeats 3 \\
        --out bench/out/serving.json            # + bench/out/serving.png
    python -m bench.serving --rate de=3,en=0.1 --duration 120   # overload: absolute rates

The kind of benchmark DistServe, vLLM's `bench serve` and MLPerf Server run, over Kafka:

* **Load**: per language an open-loop schedule (`--arrivals constant|poisson`, seeded) at
  the point's rate for `--duration` s. A sweep point is a total rate split by `--mix`;
  `--rate de=3,en=0.1` is one point of absolute per-language rates (the overload scenario).
  Texts: the load test's support mix per target language (`workers/loadtest/texts.py`).
* **Systems** (`--systems`), one after the other, each started fresh per repeat and warmed
  with a few requests first, never two at once on the machine:
  - `tolk`: a `tolk worker` process (default flags + `--worker-args`, default `--no-cache`)
    driven by the load test's Kafka client (bench/serving_kafka.py); measured once it consumes
    and, if it compiles its decode graphs in the background, once they are ready (its steady
    state; the time to both is in the JSON's `starts`);
  - `llama-http`: llama.cpp's llama-server (`bench/build_llama_server.sh`) on the same GGUF,
    same prompt text, stop rule and output cap, straight over HTTP;
  - `llama-http-draft`: the same with speculative decoding on `--llama-draft`'s model (`-md`),
    so one run holds llama-server with and without it (issue #43: the anchor is its best);
  - `llama-kafka`: the same server behind a minimal bolt-on Kafka consumer, driven by the
    same client as tolk (bench/serving_llamaserver.py).
* **Figures** per system, point and language (bench/serving_stats.py): P50/P95/P99 from the
  scheduled send (over all offered requests, misses infinite; over OK replies; and over all
  offered with withheld answers counted apart, at their reply's latency: a quality outcome,
  issue #28), TTFT, goodput (OK within `--slo` / offered: EXPIRED, REJECTED, ERROR, WITHHELD,
  TIMEOUT are misses), statuses; over `--repeats`: mean, min, max, t-interval. Then the
  highest swept rate within the SLO per system (strict, and with withheld answers counted
  apart) and tolk / anchor ratios (bench/serving_report.py).

JSON on stdout (and `--out`), a PNG of P99 and goodput against rate (`--plot`, default next
to `--out`). Needs the local stack (`bash compose/stack.sh up`); every run uses fresh topics.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench._common import JSON, dump, machine_info, parse_csv, write_json
from bench.serving_stats import (
    Outcome,
    language_figures,
    parse_lang_values,
    point_rates,
    schedule,
)

SYSTEMS = ("tolk", "llama-http", "llama-http-draft", "llama-kafka")
Request = tuple[float, str, str, str]  # (offset_s, target, source, text)
Driver = Callable[[Sequence[Request]], tuple[list[Outcome], float]]


def load_points(args: argparse.Namespace) -> list[dict[str, Any]]:
    """[{"point": label, "total_rate", "rates": {lang: rate}, "sweep": bool}]."""
    if args.rate:
        rates = parse_lang_values(args.rate, what="rate")
        return [{"point": args.rate, "total_rate": round(sum(rates.values()), 4),
                 "rates": rates, "sweep": False}]  # fmt: skip
    mix = parse_lang_values(args.mix, what="share")
    return [
        {
            "point": f"{total:g}",
            "total_rate": total,
            "rates": point_rates(total, mix),
            "sweep": True,
        }
        for total in (float(r) for r in parse_csv(args.rates))
    ]


def build_requests(
    rates: dict[str, float], duration_s: float, arrivals: str, seed: int, texts: dict[str, Any]
) -> list[Request]:
    """The schedule with a text per arrival, each language cycling through its texts."""
    cycles: dict[str, Iterator[Any]] = {lang: itertools.cycle(texts[lang]) for lang in rates}
    out = []
    for offset, lang in schedule(rates, duration_s, arrivals, seed):
        t = next(cycles[lang])
        out.append((offset, lang, t.source_lang, t.text))
    return out


def figures(outcomes: Sequence[Outcome], rates: dict[str, float], args: argparse.Namespace,
            window_s: float) -> dict[str, Any]:  # fmt: skip
    per = {
        lang: language_figures(
            [o for o in outcomes if o.lang == lang], slo_s=args.slo, rate=rate, window_s=window_s
        )
        for lang, rate in rates.items()
    }
    per["all"] = language_figures(
        outcomes, slo_s=args.slo, rate=sum(rates.values()), window_s=window_s
    )
    return per


def start_system(system: str, args: argparse.Namespace, stack: ExitStack, logs: Path,
                 langs: Sequence[str]) -> tuple[Driver, JSON]:  # fmt: skip
    """Start `system` (stopped when `stack` closes); returns its driver and start-up facts."""
    from bench import serving_llamaserver as llama
    from bench.serving_kafka import (
        drive_bridge,
        start_hog,
        start_tolk_worker,
        stop_process,
        wait_compiled,
        wait_tuned,
    )
    from workers.engine.loader import resolve_source
    from workers.loadtest.bridge import KafkaBridge

    prefix = f"srv{uuid.uuid4().hex[:8]}."
    info: JSON = {"topic_prefix": prefix}
    t0 = time.monotonic()
    if system == "tolk":
        from topics.admin import ensure_topics
        from topics.catalog import catalog

        ensure_topics(args.bootstrap, catalog(langs, prefix=prefix))
        port = llama.free_port()  # the worker's metrics endpoint
        env: dict[str, str] = {}
        if args.fresh_cache:  # a machine never seen: nothing converted, compiled or probed
            cache = Path(tempfile.mkdtemp(prefix="tolk-fresh-cache-"))
            stack.callback(shutil.rmtree, cache, True)
            env["TOLK_CACHE_DIR"] = str(cache)
        if args.hog_s > 0:
            stack.callback(stop_process, start_hog(args.hog_s), 1.0)
        proc, start_s = start_tolk_worker(
            bootstrap=args.bootstrap, redis_url=args.redis_url, prefix=prefix, languages=langs,
            model=args.model, max_new_tokens=args.max_new_tokens,
            worker_args=shlex.split(args.worker_args), log_path=logs / f"{prefix}worker.log",
            metrics_port=port, env_extra=env,
        )  # fmt: skip
        info["metrics_url"] = f"http://127.0.0.1:{port}/metrics"
        stack.callback(stop_process, proc)
        info["start_to_assigned_s"] = round(start_s, 1)
        compiled_s = wait_compiled(proc, logs / f"{prefix}worker.log")
        if compiled_s is not None:  # steady state: measured once the graphs serve
            info["assigned_to_compiled_s"] = round(compiled_s, 1)
        tuned = wait_tuned(proc, logs / f"{prefix}worker.log")
        if tuned is not None:  # measured on the configuration the tuner settled on
            info["assigned_to_tuned_s"] = round(tuned[0], 1)
            info["tuned_config"] = tuned[1]
        info["worker_cmd"] = f"tolk worker --model {args.model} {args.worker_args}".strip()
    else:
        binary = llama.find_llama_server()
        if binary is None:
            raise RuntimeError(f"llama-server not built: bash {llama.BUILD_SCRIPT}")
        gguf = resolve_source(args.model)[1]
        server = llama.LlamaServer(
            binary, gguf, threads=args.llama_threads, parallel=args.llama_parallel,
            ctx_per_slot=args.llama_ctx_per_slot, cache_reuse=args.llama_cache_reuse,
            log_path=logs / f"{prefix}llama-server.log",
            extra=llama_draft_args(args) if system == "llama-http-draft" else [],
        )  # fmt: skip
        stack.enter_context(server)
        info.update(llama_server_cmd=" ".join(server.cmd), gguf=str(gguf))
        info["start_to_healthy_s"] = round(time.monotonic() - t0, 1)
        arch = llama.gguf_arch(gguf)
        if system in ("llama-http", "llama-http-draft"):
            prompts = llama.PromptTexts(arch)

            def http(reqs: Sequence[Request]) -> tuple[list[Outcome], float]:
                return llama.run_http(
                    server.url,
                    reqs,
                    prompts,
                    max_new_tokens=args.max_new_tokens,
                    timeout_s=args.timeout,
                )

            return http, info
        from topics.admin import ensure_topics
        from topics.catalog import catalog

        ensure_topics(args.bootstrap, catalog(langs, prefix=prefix))
        proc2 = llama.start_consumer(
            bootstrap=args.bootstrap, prefix=prefix, languages=langs, url=server.url, arch=arch,
            parallel=args.llama_parallel, max_new_tokens=args.max_new_tokens,
            timeout_s=args.timeout, log_path=logs / f"{prefix}bolt-on.log",
        )  # fmt: skip
        stack.callback(stop_process, proc2, 10.0)
    bridge = KafkaBridge(args.bootstrap, topic_prefix=prefix, deadline_s=args.deadline,
                         timeout_s=args.timeout)  # fmt: skip
    bridge.start()
    stack.callback(bridge.close, 0.0)

    def kafka(reqs: Sequence[Request]) -> tuple[list[Outcome], float]:
        return drive_bridge(bridge, reqs, timeout_s=args.timeout)

    return kafka, info


def run(args: argparse.Namespace) -> JSON:
    from bench.serving_kafka import (
        scrape_cascade_outcomes,
        scrape_step_kinds,
        step_kinds_between,
    )
    from workers.loadtest.texts import support_mix

    points = load_points(args)
    langs = sorted({lang for p in points for lang in p["rates"]})
    systems = parse_csv(args.systems)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)} (known: {', '.join(SYSTEMS)})")
    if "llama-http-draft" in systems and not args.llama_draft:
        raise SystemExit("llama-http-draft needs --llama-draft MODEL (a preset or a .gguf)")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="tolk-serving-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[JSON] = []
    starts: list[JSON] = []
    for rep in range(args.repeats):
        seed = args.seed + rep
        texts = {lang: support_mix(lang, seed=seed) for lang in langs}
        warm = build_requests(dict.fromkeys(langs, 1.0), args.warmup, "constant", seed, texts)
        for system in systems:
            with ExitStack() as stack:
                try:
                    drive, info = start_system(system, args, stack, logs, langs)
                except RuntimeError as exc:
                    print(f"[serving] {system}: not run: {exc}", file=sys.stderr)
                    starts.append({"system": system, "repeat": rep, "error": str(exc)})
                    continue
                starts.append({"system": system, "repeat": rep, **info})
                if warm:
                    drive(warm)
                for pi, p in enumerate(points):
                    time.sleep(args.settle)
                    reqs = build_requests(p["rates"], args.duration, args.arrivals,
                                          seed * 1000 + pi, texts)  # fmt: skip
                    load = [round(x, 2) for x in os.getloadavg()]
                    metrics_url = info.get("metrics_url")
                    steps_before = scrape_step_kinds(metrics_url) if metrics_url else {}
                    cascade_before = scrape_cascade_outcomes(metrics_url) if metrics_url else {}
                    outcomes, window = drive(reqs)
                    row = {"system": system, "repeat": rep, "point": p["point"],
                           "total_rate": p["total_rate"], "rates": p["rates"],
                           "window_s": round(window, 2), "loadavg_at_start": load,
                           "languages": figures(outcomes, p["rates"], args, window)}  # fmt: skip
                    if metrics_url:  # the worker's model steps in the point, by kind
                        row["engine_steps"] = step_kinds_between(
                            steps_before, scrape_step_kinds(metrics_url)
                        )
                        cascade = {  # a cascade worker's outcomes in the point (issue #44)
                            k: int(v - cascade_before.get(k, 0.0))
                            for k, v in scrape_cascade_outcomes(metrics_url).items()
                        }
                        if any(cascade.values()):
                            row["cascade_outcomes"] = cascade
                    runs.append(row)
                    print(f"[serving] {summary_line(row)}", file=sys.stderr, flush=True)
    return report(args, points, runs, starts, logs)


def summary_line(row: JSON) -> str:
    parts = [f"{row['system']} rep {row['repeat']} point {row['point']}:"]
    for lang, f in row["languages"].items():
        parts.append(
            f"{lang} P50 {_s(f['p50_s'])} P95 {_s(f['p95_s'])} P99 {_s(f['p99_s'])} "
            f"(withheld apart {_s(f.get('p99_served_s'))}) goodput {f['goodput']} "
            f"{f['statuses']};"
        )
    return " ".join(parts) + f" load {row['loadavg_at_start']}"


def _s(x: float | None) -> str:
    return "miss" if x is None else f"{x:.2f}"


def report(args: argparse.Namespace, points: list[dict[str, Any]], runs: list[JSON],
           starts: list[JSON], logs: Path) -> JSON:  # fmt: skip
    from bench.serving_report import max_rates, plot, ratios, summarize

    summary = summarize(runs)
    sweep = [p["point"] for p in points if p["sweep"]]
    result: JSON = {
        "bench": "serving",
        "command": "python -m bench.serving " + " ".join(args.argv),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "argv")},
        "definitions": {
            "latency": "scheduled send -> reply (open loop, no coordinated omission)",
            "p*_s": "nearest rank over all offered requests, a miss counted infinite (null: "
            "the percentile fell on a miss)",
            "p*_ok_s": "nearest rank over OK replies only",
            "p*_served_s": "nearest rank over all offered requests, an answer the "
            "faithfulness checks withheld counted at its reply's latency (a quality outcome, "
            "counted apart), every other miss infinite",
            "ttft": "latency - the reply's decode time",
            "goodput": f"OK within {args.slo:g} s / offered (EXPIRED, REJECTED, ERROR, "
            "WITHHELD, TIMEOUT, NOT_DELIVERED are misses)",
            "interval": "over repeats: mean, min, max, Student-t 95% interval of the mean",
        },
        "points": points,
        "starts": starts,
        "runs": runs,
        "summary": summary,
        "max_rate_within_slo": max_rates(runs, args.slo, sweep) if sweep else None,
        "max_rate_within_slo_served": (
            max_rates(runs, args.slo, sweep, "p99_served_s") if sweep else None
        ),
        "ratios_tolk_over": ratios(summary),
        "logs": str(logs),
    }
    png = (
        Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png") if args.out else None)
    )
    if png is not None and sweep:
        cpu = result["machine"]["cpu_model"]
        title = (
            f"{args.model}, {args.arrivals} arrivals, {args.duration:g} s x {args.repeats}, {cpu}"
        )
        result["plot"] = str(plot(summary, png, slo_s=args.slo, title=title))
    return result


def llama_draft_args(args: argparse.Namespace) -> list[str]:
    """llama-server's flags for `--llama-draft` (none without one); the `llama-http-draft`
    system's only difference from `llama-http`."""
    if not args.llama_draft:
        return []
    from workers.engine.loader import resolve_source

    path = Path(args.llama_draft)
    gguf = path if path.suffix == ".gguf" else resolve_source(args.llama_draft)[1]
    return ["-md", str(gguf), "--draft-max", str(args.llama_draft_max), "-tbd", "2", "-td", "2"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--systems", default="tolk,llama-http,llama-kafka", help=f"of {','.join(SYSTEMS)}"
    )
    p.add_argument("--rates", default="1,2,4", help="total requests/s of the sweep points")
    p.add_argument("--mix", default="de=0.5,en=0.5", help="each language's share of a total")
    p.add_argument("--rate", default=None, help="one point of absolute rates: de=3,en=0.1")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of sending per point")
    p.add_argument("--arrivals", choices=("constant", "poisson"), default="constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slo", type=float, default=2.0, help="end-to-end SLO, s (goodput, max rate)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="output cap, both systems")
    p.add_argument("--timeout", type=float, default=60.0, help="client wait per request, s")
    p.add_argument("--deadline", type=float, default=30.0, help="tolk request deadline, s")
    p.add_argument(
        "--warmup",
        type=float,
        default=4.0,
        help="seconds of 1 req/s per language before a system's points (not counted)",
    )
    p.add_argument("--settle", type=float, default=2.0, help="idle seconds before each point")
    p.add_argument("--model", default="gemma3-270m", help="preset or .gguf (both systems)")
    p.add_argument("--worker-args", default="--no-cache", help="extra `tolk worker` flags")
    p.add_argument(
        "--fresh-cache", action="store_true",
        help="each tolk start with an empty TOLK_CACHE_DIR (a machine never seen)",
    )  # fmt: skip
    p.add_argument(
        "--hog-s", type=float, default=0.0,
        help="a busy loop on one core for the first N s of each tolk start (issue #47)",
    )  # fmt: skip
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--llama-parallel", type=int, default=4, help="llama-server -np (slots)")
    p.add_argument("--llama-cache-reuse", type=int, default=256)
    p.add_argument(
        "--llama-draft",
        default=None,
        help="the llama-http-draft system's draft model (a preset or a GGUF path), passed to "
        "llama-server as -md with --draft-max --llama-draft-max",
    )
    p.add_argument("--llama-draft-max", type=int, default=16)
    p.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    p.add_argument("--bootstrap", default=os.environ.get("TOLK_BOOTSTRAP", "127.0.0.1:9092"))
    p.add_argument(
        "--redis-url", default=os.environ.get("TOLK_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument("--logs", default=None, help="directory for the systems' logs (default: tmp)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> JSON:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(dump(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
