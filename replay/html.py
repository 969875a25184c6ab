"""Renders a replay report dict (`replay.report.build_report`) as Markdown and as one HTML page.

The page is self-contained: the plots are matplotlib PNGs inlined as `data:` URIs (no files
beside it, nothing fetched), so it can be mailed or attached to a CI run as it is. Plots:
- latency CDF per target language, one line per arm (the OK replies' latencies);
- per comparison (B vs A), one panel per metric: the B-A difference of each group with its
  95 % bootstrap interval, coloured by verdict (green better, red worse, grey none).
Markdown carries the same tables, without plots. Both only format: every number comes from
the report dict.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

DELTA_COLUMNS = 4  # metric panels per row of the deltas figure
VERDICT_COLOURS = {"better": "#1a7f37", "worse": "#cf222e", "no detectable difference": "#6e7781"}
ARM_COLUMNS = (
    ("requests", "requests"),
    ("OK", "status.OK"),
    ("ERROR", "status.ERROR"),
    ("withheld", "status.withheld"),
    ("REJECTED", "status.REJECTED"),
    ("EXPIRED", "status.EXPIRED"),
    ("unanswered", "status.unanswered"),
    ("duplicates", "status.duplicates"),
    ("P50 ms", "latency_p50_ms"),
    ("P95 ms", "latency_p95_ms"),
    ("P99 ms", "latency_p99_ms"),
    ("chrF", "chrf"),
    ("BLEU", "bleu"),
    ("off-target", "off_target_rate"),
    ("empty", "empty_rate"),
    ("truncated", "truncated_rate"),
    ("spans kept", "span_preservation"),
    ("intent agreement", "intent_agreement"),
    ("deferred", "deferred_share"),
)


def _get(d: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        d = d.get(key) if isinstance(d, dict) else None  # type: ignore[assignment]
    return d


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def _comparison_rows(comparison: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, m in comparison["metrics"].items():
        if not m["n"]:
            continue
        interval = f"[{_fmt(m['low'])}, {_fmt(m['high'])}]"
        rows.append(
            [
                name,
                _fmt(m["estimate"]),
                interval,
                str(m["n"]),
                _fmt(m["noise_estimate"]),
                m["verdict"] + (f" ({m['note']})" if m.get("note") else ""),
            ]
        )
    return rows


COMPARISON_HEADER = ["metric", "B - A", "95 % interval", "n", "A' - A", "verdict"]
SEQUENTIAL_HEADER = ["per segment", "mean B - A", "95 % CS (anytime)", "n", "margin", "verdict"]


def _sequential_rows(comparison: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, m in comparison.get("sequential", {}).items():
        if not m["n"]:
            continue
        rows.append(
            [
                name,
                _fmt(m["estimate"]),
                f"[{_fmt(m['lower'])}, {_fmt(m['upper'])}]",
                str(m["n"]),
                f"±{_fmt(m['margin'])}",
                m["verdict"],
            ]
        )
    return rows


def _header_lines(report: dict[str, Any]) -> list[str]:
    noise = report["noise_pair"]
    return [
        f"run `{report['run_id']}`: {report['requests']} requests, arms "
        f"{', '.join(report['arms'])}; baseline `{report['baseline']}`; noise pair "
        f"{' / '.join(noise) if noise else 'none'}; {report['problems']} log rows skipped.",
        f"Latency: {report['latency_definition']}. Intervals: paired bootstrap, "
        f"{report['bootstrap']['draws']} draws, seed {report['bootstrap']['seed']}. A verdict "
        "needs the interval to exclude 0 and, with a noise pair, |B - A| > |A' - A|.",
    ] + (
        [
            "Per segment: a paired anytime-valid confidence sequence (valid whenever the run "
            "is read); equivalent = the whole CS within the margin declared before the run "
            f"(SLO {report['sequential']['slo_ms']:.0f} ms)."
        ]
        if "sequential" in report
        else []
    )


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Replay report", ""]
    for line in _header_lines(report):
        lines += [line, ""]
    for gname, group in report["groups"].items():
        lines += [
            f"## {gname}",
            "",
            "| arm | " + " | ".join(c for c, _ in ARM_COLUMNS) + " |",
            "|---" * (len(ARM_COLUMNS) + 1) + "|",
        ]
        for arm, summary in group["arms"].items():
            cells = [_fmt(_get(summary, key)) for _, key in ARM_COLUMNS]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        for title, comparison in group["comparisons"].items():
            noise = " (noise pair)" if comparison["noise_pair"] else ""
            lines += [
                "",
                f"**{title}**{noise}",
                "",
                "| " + " | ".join(COMPARISON_HEADER) + " |",
                "|---" * len(COMPARISON_HEADER) + "|",
            ]
            lines += ["| " + " | ".join(row) + " |" for row in _comparison_rows(comparison)]
            if seq_rows := _sequential_rows(comparison):
                lines += [
                    "",
                    "| " + " | ".join(SEQUENTIAL_HEADER) + " |",
                    "|---" * len(SEQUENTIAL_HEADER) + "|",
                ]
                lines += ["| " + " | ".join(row) + " |" for row in seq_rows]
        lines.append("")
    return "\n".join(lines) + "\n"


# --- plots ------------------------------------------------------------------------------------


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def latency_cdf_png(report: dict[str, Any]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    languages = sorted({lang for per_arm in report["latencies"].values() for lang in per_arm})
    if not languages:
        return None
    fig, axes = plt.subplots(1, len(languages), figsize=(4.5 * len(languages), 3.2), squeeze=False)
    for ax, lang in zip(axes[0], languages, strict=True):
        for arm, per_lang in report["latencies"].items():
            values = np.asarray(per_lang.get(lang, []))
            if values.size:
                ax.step(
                    values, np.arange(1, values.size + 1) / values.size, where="post", label=arm
                )
        ax.set_title(f"latency CDF, target {lang}")
        ax.set_xlabel("ms (received - sent)")
        ax.set_ylabel("share of OK replies")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _png(fig)


def deltas_png(report: dict[str, Any], title: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for gname, group in report["groups"].items():
        comparison = group["comparisons"].get(title)
        for name, m in (comparison or {"metrics": {}})["metrics"].items():
            if m["n"] and m["estimate"] is not None and m["low"] is not None:
                entries.setdefault(name, []).append((gname, m))
    if not entries:
        return None
    cols = min(DELTA_COLUMNS, len(entries))
    rows_of_panels = -(-len(entries) // cols)
    height = 0.9 + 0.35 * max(len(v) for v in entries.values())
    fig, axes = plt.subplots(
        rows_of_panels, cols, figsize=(4.6 * cols, height * rows_of_panels), squeeze=False
    )
    for ax in axes.flat[len(entries) :]:
        ax.set_visible(False)
    for ax, (name, rows) in zip(axes.flat, entries.items(), strict=False):
        for y, (_, m) in enumerate(rows):
            colour = VERDICT_COLOURS.get(m["verdict"], "black")
            # the interval as a line and the estimate as a point: an estimate may lie outside
            # its interval (a running intersection of confidence sequences), which errorbar's
            # non-negative lengths cannot draw (it raised on one CI run)
            ax.hlines(y, m["low"], m["high"], color=colour)
            ax.plot([m["estimate"]], [y], "o", color=colour)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(rows)), [g for g, _ in rows], fontsize=7)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_title(name, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{title}: B - A with 95 % intervals", fontsize=10)
    fig.tight_layout()
    return _png(fig)


# --- the page ---------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _image(src: str | None, alt: str) -> str:
    if src is None:
        return f"<p>(no data for {html.escape(alt)})</p>"
    return f'<img class="plot" alt="{html.escape(alt)}" src="{src}">'


STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}
td,th{border:1px solid #d0d7de;padding:3px 7px;text-align:right}
td:first-child,th:first-child{text-align:left}
.better{color:#1a7f37;font-weight:bold}.worse{color:#cf222e;font-weight:bold}
img.plot{max-width:100%;display:block;margin:1em 0}"""


def page(report: dict[str, Any]) -> str:
    parts = [f"<h1>Replay report {html.escape(str(report['run_id']))}</h1>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in _header_lines(report)]
    parts.append("<h2>Latency</h2>" + _image(latency_cdf_png(report), "latency CDF"))
    titles = sorted({t for g in report["groups"].values() for t in g["comparisons"]})
    for title in titles:
        parts.append(f"<h2>{html.escape(title)}</h2>" + _image(deltas_png(report, title), title))
    for gname, group in report["groups"].items():
        parts.append(f"<h2>{html.escape(gname)}</h2>")
        rows = [
            [arm] + [_fmt(_get(s, key)) for _, key in ARM_COLUMNS]
            for arm, s in group["arms"].items()
        ]
        parts.append(_table(["arm"] + [c for c, _ in ARM_COLUMNS], rows))
        for title, comparison in group["comparisons"].items():
            noise = " (noise pair)" if comparison["noise_pair"] else ""
            parts.append(f"<h3>{html.escape(title + noise)}</h3>")
            table = _table(COMPARISON_HEADER, _comparison_rows(comparison))
            if seq_rows := _sequential_rows(comparison):
                table += _table(SEQUENTIAL_HEADER, seq_rows)
            for verdict in ("better", "worse"):
                table = table.replace(
                    f"<td>{verdict}</td>", f'<td class="{verdict}">{verdict}</td>'
                )
            parts.append(table)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>Replay report {html.escape(str(report['run_id']))}</title>"
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )
