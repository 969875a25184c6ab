"""`tolk replay`: the replay commands, a typer sub-app mounted by `workers/cli.py`.

    tolk replay run [--log PATH --format F] [-l de,en] [--limit N --seed S]
                    [--speed X | --rate R] [--closed-loop] [--arms A,B] [--wait-s 120]
                    [--run-dir DIR]                     replay a log to the arms, collect replies
    tolk replay report RUN_DIR                          the A/B report of a run (replay.report):
                                                        report.json, .md, .html in RUN_DIR

Thin commands: the settings are read here, once (`workers.settings.Settings`: bootstrap,
security, topic prefix), and handed to `replay.job` as a `ReplayConfig`; heavy imports happen
inside the commands so `tolk --help` stays instant. `run` prints a progress line every few
seconds on stderr and the summary as JSON on stdout. Exit codes: 0 the run finished and every
expected arm answered something, 1 it finished with an arm that never answered (the message
names it), 2 bad arguments or an unusable broker / log / run directory, 3 stopped unfinished
(`--max-duration-s`, `--max-sends`, Ctrl-C): run again with `--run-dir` to resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Replay logged conversations to the arms and compare them.", no_args_is_help=True
)


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


@app.command()
def run(
    log: Annotated[Path | None, typer.Option(help="The log; default: BConTrasT dev.")] = None,
    log_format: Annotated[
        str, typer.Option("--format", help="bcontrast | wmt-csv | jsonl | xsid (docs/REPLAY.md).")
    ] = "bcontrast",
    languages: Annotated[
        str | None, typer.Option("--languages", "-l", help="Target languages to replay.")
    ] = None,
    limit: Annotated[
        int | None, typer.Option(help="At most N turns (whole conversations).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Which conversations, when limited.")] = 0,
    speed: Annotated[
        float | None, typer.Option(help="Log time / X (2 = twice as fast); default 1.")
    ] = None,
    rate: Annotated[float | None, typer.Option(help="Open loop: R requests per second.")] = None,
    closed_loop: Annotated[
        bool, typer.Option(help="Turn k waits until every arm answered turn k-1.")
    ] = False,
    arms: Annotated[str | None, typer.Option(help="The arms expected to answer: A,B.")] = None,
    wait_s: Annotated[float, typer.Option(help="Wait for missing replies after the last send.")] = (
        120.0
    ),
    deadline_s: Annotated[
        float | None, typer.Option(help="Request deadline after creation (default: none).")
    ] = None,
    max_duration_s: Annotated[
        float | None, typer.Option(help="Stop (resumable) after this long.")
    ] = None,
    max_sends: Annotated[
        int | None, typer.Option(help="Stop (resumable) after N sends in this session.")
    ] = None,
    stop_when_decided: Annotated[
        str | None,
        typer.Option(
            help="chrf,within_slo: stop sending once every language is decided in these "
            "(anytime-valid, needs --arms; docs/REPLAY.md)."
        ),
    ] = None,
    margin: Annotated[
        str | None,
        typer.Option(help="With --stop-when-decided: margins, chrf=0.05,... (default 0.03 each)"),
    ] = None,
    slo_ms: Annotated[
        float, typer.Option(help="With --stop-when-decided: the within-SLO indicator's SLO.")
    ] = 2000.0,
    run_dir: Annotated[
        Path | None, typer.Option(help="The run directory; an unfinished one is resumed.")
    ] = None,
    runs_root: Annotated[Path, typer.Option(help="Where a new run's directory goes.")] = Path(
        "replay-runs"
    ),
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers.")
    ] = None,
) -> None:
    """Stream a conversation log to the request topics in mirror mode and collect every arm's
    replies into a run directory."""
    from replay.early_stop import parse_stop_metrics
    from replay.job import ReplayConfig, run_replay, summary_json
    from replay.logs import LOG_FORMATS
    from replay.run_dir import RunDirError
    from replay.sequential import parse_margins
    from topics.admin import TopicAdminError
    from topics.cluster import KafkaConnectionError, check_broker
    from workers.settings import Settings

    if log_format not in LOG_FORMATS:
        _fail(f"--format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    if speed is not None and rate is not None:
        _fail("give --speed or --rate, not both")
    arm_names = _csv(arms)
    if closed_loop and not arm_names:
        _fail("--closed-loop needs --arms (it waits for every arm's answer)")
    try:
        stop_metrics, margins = parse_stop_metrics(stop_when_decided), parse_margins(margin)
    except ValueError as exc:
        _fail(str(exc))
    if stop_metrics and len(arm_names) < 2:
        _fail("--stop-when-decided needs --arms with two or more arms (the first: baseline)")
    settings = Settings.from_env(bootstrap=bootstrap) if bootstrap else Settings.from_env()
    config = ReplayConfig(
        bootstrap=settings.bootstrap,
        kafka_config=settings.kafka_security(),
        log_path=log,
        log_format=log_format,  # type: ignore[arg-type]  # checked against LOG_FORMATS
        languages=_csv(languages),
        limit=limit,
        seed=seed,
        speed=speed,
        rate=rate,
        closed_loop=closed_loop,
        arms=arm_names,
        wait_s=wait_s,
        deadline_s=deadline_s,
        max_duration_s=max_duration_s,
        max_sends=max_sends,
        stop_when_decided=stop_metrics,
        margins=margins,
        slo_ms=slo_ms,
        run_dir=run_dir,
        runs_root=runs_root,
        topic_prefix=settings.topic_prefix,
    )
    try:
        check_broker(settings.kafka_common())
        summary = run_replay(config)
    except (
        OSError,  # a missing log, an unwritable run directory (DataNotFoundError too)
        RunDirError,
        TopicAdminError,
        KafkaConnectionError,
        ValueError,
    ) as exc:
        _fail(str(exc))
    typer.echo(summary_json(summary))
    if not summary["finished"]:
        typer.echo(f"stopped unfinished; resume with --run-dir {summary['run_dir']}", err=True)
        raise typer.Exit(3)
    raise typer.Exit(1 if summary["missing_arms"] else 0)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory of `tolk replay run`.")],
    margin: Annotated[
        str | None,
        typer.Option(help="Per-segment equivalence margins: chrf=0.05,... (default 0.03 each)"),
    ] = None,
    slo_ms: Annotated[float, typer.Option(help="The within-SLO indicator's SLO.")] = 2000.0,
) -> None:
    """Write the A/B report of a run (JSON, Markdown, HTML) into its directory."""
    from replay.report import write_report  # part T's module
    from replay.sequential import parse_margins

    if not (run_dir / "run.json").is_file():
        _fail(f"{run_dir} is not a replay run directory (no run.json)")
    try:
        margins = parse_margins(margin)
    except ValueError as exc:
        _fail(str(exc))
    write_report(run_dir, margins=margins, slo_ms=slo_ms)
    for name in ("report.json", "report.md", "report.html"):
        typer.echo(f"wrote {run_dir / name}")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
