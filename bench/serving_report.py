"""The serving benchmark's summary over repeats, the tolk / llama-server ratios, and the plot.

Input: the runs of `bench/serving.py` (one per system x repeat x load point, each with the
figures of `serving_stats.language_figures` per language and for all languages pooled).
Output: per system, point and language each figure's interval over the repeats
(`serving_stats.interval`), the highest swept total rate whose P99 (over offered requests,
misses infinite) stays within the SLO in every repeat and language (and the same with
withheld answers counted apart, at their latency: `p99_served_s`), and tolk's figures
divided by each anchor's (mean over repeats; < 1 is tolk faster for latencies, > 1 is tolk
better for goodput). The PNG shows P99 and goodput against the total rate, one line per
system and language; a P99 that fell on a miss is drawn at the top of the axis with an x.

The README's performance table is generated here, never copied by hand (issue #46):

    python -m bench.serving_report --markdown docs/results/serving.json --readme README.md

prints the table of a `bench.serving` result (tolk against llama-server, pooled over
languages) and, with `--readme`, writes it between the README's `serving-summary` markers;
tests/bench/test_serving_report.py fails when the README's table is not what this prints for
the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._common import safe_ratio
from bench.serving_stats import interval, max_rate_within_slo

__all__ = ["markdown_summary", "plot", "ratios", "replace_block", "summarize"]

START_MARK = "<!-- serving-summary:start"
END_MARK = "<!-- serving-summary:end -->"
ANCHOR_NAMES = {"llama-http": "llama-server"}

FIGURES = (
    "p50_s", "p95_s", "p99_s", "p50_ok_s", "p95_ok_s", "p99_ok_s", "p50_served_s",
    "p99_served_s", "goodput", "withheld", "ttft_p50_s", "ttft_p99_s", "throughput_ok_per_s",
    "mean_tokens_out",
)  # fmt: skip
RATIO_FIGURES = ("p50_s", "p95_s", "p99_s", "p50_ok_s", "p99_ok_s", "p99_served_s", "goodput")


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """{system: {point: {"total_rate", "rates", "languages": {lang: {figure: interval}}}}}."""
    grouped: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    meta: dict[str, Mapping[str, Any]] = {}
    for run in runs:
        if "languages" not in run:
            continue
        grouped.setdefault(run["system"], {}).setdefault(run["point"], []).append(run)
        meta[run["point"]] = run
    out: dict[str, Any] = {}
    for system, points in grouped.items():
        out[system] = {}
        for point, reps in points.items():
            langs = list(reps[0]["languages"])
            out[system][point] = {
                "total_rate": meta[point]["total_rate"],
                "rates": meta[point]["rates"],
                "repeats": len(reps),
                "languages": {
                    lang: {
                        **{f: interval(r["languages"][lang].get(f) for r in reps) for f in FIGURES},
                        "statuses": _sum_statuses(r["languages"][lang]["statuses"] for r in reps),
                    }
                    for lang in langs
                },
            }
    return out


def _sum_statuses(items: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for statuses in items:
        for k, v in statuses.items():
            total[k] = total.get(k, 0) + int(v)
    return dict(sorted(total.items()))


def max_rates(
    runs: Sequence[Mapping[str, Any]],
    slo_s: float,
    sweep_points: Sequence[str],
    figure: str = "p99_s",
) -> dict[str, float | None]:
    """Per system: the highest swept total rate within the SLO (serving_stats), judged on
    `figure` (`p99_s`: every miss infinite; `p99_served_s`: withheld answers counted apart)."""
    by_system: dict[str, dict[float, list[float | None]]] = {}
    for run in runs:
        if "languages" not in run or run["point"] not in sweep_points:
            continue
        p99s = by_system.setdefault(run["system"], {}).setdefault(float(run["total_rate"]), [])
        p99s += [f.get(figure) for lang, f in run["languages"].items() if lang != "all"]
    return {system: max_rate_within_slo(p99s, slo_s) for system, p99s in by_system.items()}


def ratios(summary: Mapping[str, Any], system: str = "tolk") -> dict[str, Any]:
    """{anchor: {point: {lang: {figure: system mean / anchor mean}}}} for every other system."""
    mine = summary.get(system)
    if not mine:
        return {}
    out: dict[str, Any] = {}
    for anchor, points in summary.items():
        if anchor == system:
            continue
        out[anchor] = {}
        for point, theirs in points.items():
            if point not in mine:
                continue
            out[anchor][point] = {
                lang: {
                    f: safe_ratio(mine[point]["languages"][lang][f]["mean"], figs[f]["mean"])
                    for f in RATIO_FIGURES
                }
                for lang, figs in theirs["languages"].items()
                if lang in mine[point]["languages"]
            }
    return out


def plot(summary: Mapping[str, Any], path: Path, *, slo_s: float, title: str) -> Path | None:
    """P99 (offered) and goodput against the total rate; None when there is nothing to draw."""
    if not summary:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p99, ax_good) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    finite = [
        f["p99_s"]["mean"]
        for points in summary.values()
        for p in points.values()
        for f in p["languages"].values()
        if f["p99_s"]["mean"] is not None
    ]
    top = max([slo_s * 2, *finite]) * 1.1  # a P99 that fell on a miss is drawn here
    for si, (system, points) in enumerate(sorted(summary.items())):
        color = f"C{si}"
        langs = sorted({lang for p in points.values() for lang in p["languages"] if lang != "all"})
        for li, lang in enumerate(langs):
            xs, p99, good, missed = [], [], [], []
            for p in sorted(points.values(), key=lambda p: p["total_rate"]):
                figs = p["languages"].get(lang)
                if figs is None:
                    continue
                xs.append(p["total_rate"])
                mean = figs["p99_s"]["mean"]
                p99.append(mean if mean is not None else top)
                if mean is None:
                    missed.append((p["total_rate"], top))
                good.append(figs["goodput"]["mean"] or 0.0)
            label = f"{system} {lang}"
            style, marker = styles[li % len(styles)]
            ax_p99.plot(xs, p99, style, color=color, marker=marker, label=label)
            ax_good.plot(xs, good, style, color=color, marker=marker, label=label)
            if missed:
                ax_p99.plot(*zip(*missed, strict=True), "x", color=color, markersize=10)
    ax_p99.axhline(slo_s, color="grey", linewidth=0.8)
    ax_p99.set_xlabel("offered load, requests/s (all languages)")
    ax_p99.set_ylabel("P99 latency, s (x at the top: the P99 was a miss)")
    ax_p99.set_ylim(0, top * 1.05)
    ax_p99.legend(fontsize=7)
    ax_good.set_xlabel("offered load, requests/s (all languages)")
    ax_good.set_ylabel(f"goodput: share of offered answered OK within {slo_s:g} s")
    ax_good.set_ylim(0, 1.05)
    ax_good.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean(figures: Mapping[str, Any], name: str) -> float | None:
    value = figures.get(name, {}).get("mean")
    return None if value is None else float(value)


def _seconds(value: float | None) -> str:
    return "missed" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown_summary(
    result: Mapping[str, Any], source: str, *, system: str = "tolk", anchor: str = "llama-http"
) -> str:
    """The performance table of one `bench.serving` result: per load point, `system`'s and
    `anchor`'s P50 and P99 of OK replies and goodput (all languages pooled, mean over the
    repeats), and their ratios; a caption naming the machine, the command and `source`."""
    summary = result["summary"]
    mine, theirs = summary.get(system), summary.get(anchor)
    if not mine or not theirs:
        raise ValueError(f"{source}: needs the systems {system!r} and {anchor!r} in one run")
    settings = result.get("settings", {})
    machine = result.get("machine", {})
    name = ANCHOR_NAMES.get(anchor, anchor)
    slo = settings.get("slo", 2.0)
    lines = [
        f"| offered load ({settings.get('mix', '')}, open loop) | {system} P50 / P99 of OK (s) "
        f"| {name} P50 / P99 of OK (s) | {system} / {name}: P50, P99 of OK "
        f"| goodput at {slo:g} s, {system} / {name} |",
        "|---|---|---|---|---|",
    ]
    for point in sorted(mine, key=lambda p: mine[p]["total_rate"]):
        if point not in theirs:
            continue
        a = mine[point]["languages"]["all"]
        b = theirs[point]["languages"]["all"]
        p50 = (_mean(a, "p50_s"), _mean(b, "p50_s"))
        p99 = (_mean(a, "p99_ok_s"), _mean(b, "p99_ok_s"))
        good = (_mean(a, "goodput"), _mean(b, "goodput"))
        lines.append(
            f"| {mine[point]['total_rate']:g} req/s | {_seconds(p50[0])} / {_seconds(p99[0])} "
            f"| {_seconds(p50[1])} / {_seconds(p99[1])} "
            f"| {_ratio(safe_ratio(*p50))}, {_ratio(safe_ratio(*p99))} "
            f"| {(good[0] or 0) * 100:.0f} % / {(good[1] or 0) * 100:.0f} % |"
        )
    repeats = settings.get("repeats", 1)
    lines += [
        "",
        f"{settings.get('model', 'the default model')}, {settings.get('duration', 0):g} s per "
        f"point, {repeats} repeat{'s' if repeats != 1 else ''} (means), "
        f"{machine.get('cpu_model', 'CPU not recorded')}, {machine.get('logical_cpus', '?')} "
        f"vCPU, {machine.get('date_utc', 'date not recorded')} UTC; from `{source}`, made by "
        f"`{result.get('command', '?')}`.",
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str, source: str) -> str:
    """`text` with the part between the `serving-summary` markers replaced by `block`."""
    pattern = re.compile(re.escape(START_MARK) + r".*?" + re.escape(END_MARK), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no {START_MARK} ... {END_MARK} block to replace")
    start = f"{START_MARK}: python -m bench.serving_report --markdown {source} -->"
    return pattern.sub(lambda _: f"{start}\n{block}\n{END_MARK}", text, count=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_report", description=__doc__)
    parser.add_argument("--markdown", required=True, help="a bench.serving JSON result")
    parser.add_argument("--readme", help="write the table into this file's marked block")
    parser.add_argument("--system", default="tolk")
    parser.add_argument("--anchor", default="llama-http")
    args = parser.parse_args(argv)
    result = json.loads(Path(args.markdown).read_text())
    table = markdown_summary(result, args.markdown, system=args.system, anchor=args.anchor)
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(replace_block(readme.read_text(), table, args.markdown))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
