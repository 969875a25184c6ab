"""First starts on a machine never seen: where the default worker ends up, and how fast it serves.

    python -m bench.first_start --starts 5 --hog-s 60 --rates 1,2 --duration 60 \\
        --explicit "int8,int8+compiled,float32+compiled" --anchor --out bench/out/first_start.json

Issue #47's check of the auto configuration (workers/engine/tuner.py, autoprobe.py). In one run:

1. `--starts` first starts of the default `tolk worker` (no --quantize / --compile-decode), each
   from an **empty cache directory** (TOLK_CACHE_DIR: nothing converted, compiled or probed)
   with a **busy loop on one core for the first `--hog-s` seconds** (`bench.serving_kafka.
   start_hog`, other work on the host while it starts). Each is measured by the serving bench
   (`bench.serving`, open loop at each of `--rates` req/s for `--duration` s) once its tuner
   settled: the seconds to consuming, to the settled configuration, which one, its P50 / P99;
2. the **explicit configurations** (`--explicit`, each as `tolk worker --quantize W
   [--compile-decode]`, the cache warm) under the same load, `--explicit-repeats` starts each
   (default 1), the median P50 its figure and every start's kept (the spread to read a first
   start against);
3. with `--anchor`, llama.cpp's llama-server (`llama-http`, bench/build_llama_server.sh) on the
   same GGUF and load: each binary of `--anchor-bin` (default: the one the serving bench finds),
   e.g. the project's AVX-512 build and a `GGML_NATIVE=ON` one, and per rate the faster P50 of
   them as the anchor (issue #47: "the faster of the two"); with `--anchor-each` (and
   `--paired`) it runs after each first start's explicit starts instead of once at the end, and
   each first start is read against its own (on the 2-vCPU Zen 3 llama-server's P50 at 1 req/s
   moved from 0.38 to 0.33 s between two runs an hour apart, more than Done-when 2's margin);
4. per first start and rate: its P50 over the best explicit configuration's (issue #47's
   Done-when 1: within 1.10) and over llama-server's (Done-when 2: P50 <= 0.8x, P99 of OK
   replies <= 1.0x). With `--paired` each first start is followed by one start of each
   explicit configuration and judged against those (`p50_over_paired`): in one run without it
   the first starts at 1 req/s served P50 0.107-0.139 s, the host's pace moving by more than
   the 10 % allowed between a first start and explicit starts an hour later.

Every system serves the **same load** (`--seed`: the same texts at the same offsets), so a
first start and an explicit configuration differ only in the worker.

JSON on stdout (and `--out`). Needs the local stack. A first start compiles the decode graphs
of each gated format that could still win (minutes each on two cores): ~10-25 min per start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from bench._common import JSON, dump, machine_info, parse_csv, write_json

WITHIN = 1.10  # a first start's served P50 over the best explicit configuration's


def flags_of(label: str) -> str:
    """`tolk worker` flags of a candidate label: "int8+compiled" -> "--quantize int8
    --compile-decode"."""
    weights, _, compiled = label.partition("+")
    quantize = "none" if weights == "float32" else weights
    return f"--quantize {quantize} {'--compile-decode' if compiled else '--no-compile-decode'}"


def serving_args(args: argparse.Namespace, *extra: str) -> argparse.Namespace:
    from bench import serving

    argv = [
        "--rates", args.rates, "--mix", args.mix, "--duration", str(args.duration),
        "--model", args.model, "--repeats", "1", "--seed", str(args.seed), *extra,
    ]  # fmt: skip
    ns = serving.parse_args(argv)
    ns.argv = argv
    return ns


def by_rate(result: JSON) -> dict[str, JSON]:
    """{rate: {"p50_s", "p99_ok_s", "p99_s", "statuses", "stages_s", "engine_steps"}} over all
    languages of a serving result's runs (and "cascade_outcomes" where a cascade worker
    served)."""
    out = {}
    for row in result["runs"]:
        figures = row["languages"]["all"]
        out[f"{row['total_rate']:g}"] = {
            "p50_s": figures.get("p50_s"),
            "p99_ok_s": figures.get("p99_ok_s"),
            "p99_s": figures.get("p99_s"),
            "statuses": figures.get("statuses"),
            # where the time went (queue / prefill / decode P50 and P99) and the engine's steps:
            # what tells a slow first start's cause from the explicit start's
            "stages_s": figures.get("stages_s"),
            "engine_steps": row.get("engine_steps"),
        }
        if "cascade_outcomes" in row:  # a cascade worker's (bench.cascade --serving)
            out[f"{row['total_rate']:g}"]["cascade_outcomes"] = row["cascade_outcomes"]
    return out


def run_llama_server(args: argparse.Namespace, binary: str) -> dict[str, JSON]:
    """llama-server under the run's load; `binary` ("" = the serving bench's own search) is
    handed to it as $LLAMA_SERVER_BIN. Each rate's figures name the binary they came from."""
    from bench import serving

    saved = os.environ.get("LLAMA_SERVER_BIN")
    if binary:
        os.environ["LLAMA_SERVER_BIN"] = binary
    try:
        figures = by_rate(serving.run(serving_args(args, "--systems", "llama-http")))
    finally:
        if saved is None:
            os.environ.pop("LLAMA_SERVER_BIN", None)
        else:
            os.environ["LLAMA_SERVER_BIN"] = saved
    print(f"[first_start] llama-server {binary or 'default'}: {figures}", file=sys.stderr)
    return figures


def faster_per_rate(builds: dict[str, dict[str, JSON]]) -> dict[str, JSON]:
    """Per rate, the figures of the build with the lower P50, tagged with the build's name."""
    out: dict[str, JSON] = {}
    for name, rates in builds.items():
        for rate, figures in rates.items():
            p50 = figures.get("p50_s")
            if p50 is None:
                continue
            best = out.get(rate)
            if best is None or p50 < best["p50_s"]:
                out[rate] = {**figures, "build": name}
    return out


def median_of_starts(runs: list[dict[str, JSON]]) -> dict[str, JSON]:
    """Several starts of one configuration under the same load as one: per rate the median P50
    and P99 of OK, each start's P50 kept (`p50_runs`: the spread a first start is read against)."""
    out: dict[str, JSON] = {}
    for rate in runs[0]:
        rows = [r[rate] for r in runs if rate in r]
        p50s = [f["p50_s"] for f in rows if f.get("p50_s") is not None]
        p99s = [f["p99_ok_s"] for f in rows if f.get("p99_ok_s") is not None]
        out[rate] = {
            **rows[0],
            "p50_s": statistics.median(p50s) if p50s else None,
            "p99_ok_s": statistics.median(p99s) if p99s else None,
            "p50_runs": p50s,
        }
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def paired_ratios(row: JSON, pair: dict[str, dict[str, JSON]]) -> None:
    """A first start against the explicit starts run right after it (`--paired`): per rate
    its P50 over the fastest of them (`p50_over_paired`, `within_paired`). The host's pace moves
    by more than 10 % over an hour (first starts at 1 req/s: 0.107-0.139 s in one run), so a
    first start is read against its neighbour in time, not against starts an hour later."""
    row["paired"] = pair
    for rate, figures in row["rates"].items():
        served = [f[rate] for f in pair.values() if f.get(rate, {}).get("p50_s")]
        if not served or figures.get("p50_s") is None:
            continue
        fastest = min(served, key=lambda f: f["p50_s"])
        figures["p50_over_paired"] = ratio(figures["p50_s"], fastest["p50_s"])
        figures["within_paired"] = (figures["p50_over_paired"] or 99) <= WITHIN
        # the engine's own pace against that start's: a P50 ratio off by more than its decode
        # steps are tells the host's load or the arrivals' luck from a slower process
        figures["decode_ms_over_paired"] = ratio(
            decode_ms(figures.get("engine_steps")), decode_ms(fastest.get("engine_steps"))
        )


def decode_ms(engine_steps: JSON | None) -> float | None:
    """The mean decode-only step (ms) of a serving run's `engine_steps`, None without one."""
    decode = (engine_steps or {}).get("decode") or {}
    return decode.get("mean_ms") if decode.get("steps") else None


def llama_ratios(rates: dict[str, JSON], anchor: dict[str, JSON]) -> None:
    """Per rate, a first start's P50 and P99 of OK replies over the anchor's (Done-when 2:
    <= 0.8 and <= 1.0); a rate the anchor lacks gets none."""
    for rate, figures in rates.items():
        if rate in anchor:
            figures["p50_over_llama"] = ratio(figures["p50_s"], anchor[rate]["p50_s"])
            figures["p99_ok_over_llama"] = ratio(figures["p99_ok_s"], anchor[rate]["p99_ok_s"])


def explicit_start(args: argparse.Namespace, label: str) -> dict[str, JSON]:
    """One start of the explicit configuration `label` (cache warm) under the run's load."""
    from bench import serving

    ns = serving_args(args, "--systems", "tolk", f"--worker-args=--no-cache {flags_of(label)}")
    return by_rate(serving.run(ns))


def run(args: argparse.Namespace) -> JSON:
    from bench import serving

    labels = parse_csv(args.explicit)
    explicit_runs: dict[str, list[dict[str, JSON]]] = {label: [] for label in labels}
    starts: list[JSON] = []
    for i in range(args.starts):
        ns = serving_args(
            args, "--systems", "tolk", "--fresh-cache", "--hog-s", str(args.hog_s),
            "--worker-args=--no-cache",
        )  # fmt: skip
        result = serving.run(ns)
        (info,) = result["starts"]
        row = {
            "start": i,
            "start_to_consuming_s": info.get("start_to_assigned_s"),
            "consuming_to_settled_s": info.get("assigned_to_tuned_s"),
            "config": info.get("tuned_config"),
            "rates": by_rate(result),
        }
        if args.paired:  # the explicit starts right after it: its neighbours in time
            pair = {label: explicit_start(args, label) for label in labels}
            for label, figures in pair.items():
                explicit_runs[label].append(figures)
            paired_ratios(row, pair)
            if args.anchor and args.anchor_each:  # its own anchor, the next in time
                row["llama_http"] = faster_per_rate(
                    {b or "default": run_llama_server(args, b) for b in args.anchor_bin}
                )
        starts.append(row)
        print(f"[first_start] {row}", file=sys.stderr, flush=True)
    explicit: dict[str, JSON] = {}
    for label in labels:
        if not args.paired:
            explicit_runs[label] = [
                explicit_start(args, label) for _ in range(args.explicit_repeats)
            ]
        explicit[label] = median_of_starts(explicit_runs[label])
        print(f"[first_start] explicit {label}: {explicit[label]}", file=sys.stderr, flush=True)
    anchors: dict[str, dict[str, JSON]] = {}
    for binary in args.anchor_bin if args.anchor and not args.anchor_each else []:
        anchors[binary or "default"] = run_llama_server(args, binary)
    anchor = faster_per_rate(anchors)
    best: dict[str, str] = {}
    for rate in parse_csv(args.rates):
        rate = f"{float(rate):g}"
        served = {k: v[rate]["p50_s"] for k, v in explicit.items() if v[rate]["p50_s"] is not None}
        if served:
            best[rate] = min(served, key=lambda k: served[k])
    for row in starts:
        for rate, figures in row["rates"].items():
            if rate in best:
                figures["p50_over_best"] = ratio(
                    figures["p50_s"], explicit[best[rate]][rate]["p50_s"]
                )
                figures["within"] = (figures["p50_over_best"] or 99) <= WITHIN
        llama_ratios(row["rates"], row.get("llama_http", anchor))
    return {
        "bench": "first_start",
        "command": "python -m bench.first_start " + " ".join(args.argv),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "argv")},
        "definitions": {
            "start_to_consuming_s": "process start -> partition assignment (serving begins)",
            "consuming_to_settled_s": "-> the tuner moved to the probe's choice or kept its own",
            "p50_s": f"all languages, open loop for {args.duration:g} s a rate, measured once "
            "settled",
            "p50_over_best": f"over the fastest explicit configuration's P50 (pass <= {WITHIN})",
            "p50_over_paired": "with --paired: over the fastest P50 of the explicit starts run "
            f"right after this first start (pass <= {WITHIN})",
            "decode_ms_over_paired": "with --paired: its mean decode step over that start's "
            "(the engine's pace; a P50 ratio far from it is the host's load or the arrivals)",
            "p50_over_llama": "over llama-server's P50 at the same rate (issue #47: <= 0.8); "
            "with --anchor-each over the run beside this start (its row's llama_http)",
            "p99_ok_over_llama": "P99 of OK replies over llama-server's (issue #47: <= 1.0)",
        },
        "starts": starts,
        "explicit": explicit,
        "best_explicit": best,
        "llama_http": anchor,
        "llama_http_builds": anchors,
        "all_within": all(
            f.get("within_paired" if args.paired else "within")
            for r in starts
            for f in r["rates"].values()
        )
        if starts
        else None,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--hog-s", type=float, default=60.0, help="busy loop on one core, first N s")
    p.add_argument("--rates", default="1,2", help="total requests/s, one point each")
    p.add_argument("--mix", default="de=0.5,en=0.5")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--explicit", default="int8,int8+compiled,float32,float32+compiled")
    p.add_argument(
        "--explicit-repeats", type=int, default=1,
        help="starts of each explicit configuration (warm cache); the median P50 is its figure",
    )  # fmt: skip
    p.add_argument(
        "--paired", action="store_true",
        help="after each first start, one start of each --explicit configuration; each first "
        "start is judged against those (its neighbours in time; --explicit-repeats unused)",
    )  # fmt: skip
    p.add_argument("--anchor", action="store_true", help="llama-server under the same load")
    p.add_argument(
        "--anchor-each", action="store_true",
        help="with --paired: llama-server after each first start's explicit starts, each first "
        "start read against its own (the host's pace drifts within a run)",
    )  # fmt: skip
    p.add_argument(
        "--anchor-bin",
        action="append",
        default=None,
        help="a llama-server binary for --anchor (repeat for several builds; the faster P50 "
        "per rate is the anchor); default: $LLAMA_SERVER_BIN or <repo>/.llama-server",
    )
    p.add_argument("--seed", type=int, default=0, help="the load's texts and arrival times")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.anchor_bin = args.anchor_bin or [""]
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result: Any = run(args)
    print(dump(result))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
