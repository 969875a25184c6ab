"""`tolk guard`, `tolk rollout start|status|promote|abort` and `tolk arms set|clear|show`: the
commands that move the arms' shares (canary rollouts, and shares set by hand).

Thin commands over `workers.guard`: `rollout start` writes a START event per language to
`tolk.rollout.events` and the first shares to `tolk.control.arms`; `promote` and `abort`
write an operator event and the new shares; `status` folds the events (`events.load_book`)
and prints, per language, the arms, the share, the recent windows and the last decision.
`guard` runs the faust app (`workers.guard.app`). Heavy imports stay inside the commands.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import typer

rollout_app = typer.Typer(
    help="Canary rollouts per language (the guard moves the shares).", no_args_is_help=True
)
arms_app = typer.Typer(help="A/B arms: shares per language (control topic).", no_args_is_help=True)

BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers.")
]
LanguagesArg = Annotated[str, typer.Option("--languages", "-l", help="Comma list of languages.")]


def _target(bootstrap: str | None) -> tuple[Any, str, str]:
    from topics.catalog import arm_control_topic, rollout_events_topic
    from workers.settings import Settings

    overrides: dict[str, Any] = {"bootstrap": bootstrap} if bootstrap else {}
    settings = Settings.from_env(**overrides)
    prefix = settings.topic_prefix
    return settings, rollout_events_topic(prefix), arm_control_topic(prefix)


def _langs(text: str) -> list[str]:
    from workers.settings import parse_languages

    return list(parse_languages(text))


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(1) from None


@rollout_app.command("start")
def rollout_start(
    arm: Annotated[str, typer.Option(help="The canary arm.")],
    languages: LanguagesArg,
    share: Annotated[float, typer.Option(help="The canary's first share, percent.")] = 5.0,
    stable: Annotated[str, typer.Option(help="The stable arm.")] = "stable",
    steps: Annotated[str, typer.Option(help="Promotion steps, percent.")] = "5,25,50,100",
    bootstrap: BootstrapOpt = None,
) -> None:
    """Start a canary: `tolk rollout start --arm v2 --languages de,fr --share 5`."""
    from workers.arms import validate_arm_name
    from workers.guard.events import EventWriter, operator_event
    from workers.guard.policy import RolloutState, validate_steps
    from workers.kafka.arm_control import default_updated_by

    settings, events_topic, control_topic = _target(bootstrap)
    try:
        validate_arm_name(arm)
        validate_arm_name(stable)
        step_list = validate_steps([float(s) for s in steps.split(",") if s.strip()])
        if not 0 < share <= 100:
            raise ValueError(f"share must be within (0, 100], got {share:g}")
        writer = EventWriter(settings.kafka_common(), events_topic, control_topic)
        rollout_id = f"{arm}-{uuid.uuid4().hex[:8]}"
        by = default_updated_by()
        for lang in _langs(languages):
            event = operator_event(
                "START",
                rollout_id=rollout_id,
                lang=lang,
                stable=stable,
                canary=arm,
                share_before=0.0,
                share_after=share,
                steps=step_list,
                decided_by=by,
                now_ms=int(time.time() * 1000),
            )
            writer.write_event(event)
            writer.write_shares(RolloutState(rollout_id, lang, stable, arm, share), updated_by=by)
            typer.echo(f"{lang}: {stable}={100 - share:g} {arm}={share:g} (rollout {rollout_id})")
        writer.close()
    except (ValueError, RuntimeError) as exc:
        _fail(exc)


def _operator(action: str, languages: str | None, bootstrap: str | None) -> None:
    from workers.guard.events import EventWriter, load_book, operator_event
    from workers.guard.policy import next_step
    from workers.kafka.arm_control import default_updated_by

    settings, events_topic, control_topic = _target(bootstrap)
    try:
        book = load_book(settings.kafka_common(), events_topic)
        langs = _langs(languages) if languages else sorted(book.active())
        writer = EventWriter(settings.kafka_common(), events_topic, control_topic)
        by = default_updated_by()
        for lang in langs:
            state = book.states.get(lang)
            if state is None or not state.active:
                typer.echo(f"{lang}: no active rollout", err=True)
                continue
            share = next_step(state.steps, state.share) if action == "PROMOTE" else 0.0
            event = operator_event(
                action,
                rollout_id=state.rollout_id,
                lang=lang,
                stable=state.stable,
                canary=state.canary,
                share_before=state.share,
                share_after=share,
                steps=state.steps,
                decided_by=by,
                now_ms=int(time.time() * 1000),
                reason=f"operator {action.lower()}",
            )
            writer.write_event(event)
            book.apply(event)
            writer.write_shares(book.states[lang], updated_by=by)
            typer.echo(f"{lang}: {state.canary} {state.share:g}% -> {share:g}%")
        writer.close()
    except (ValueError, RuntimeError) as exc:
        _fail(exc)


@rollout_app.command("promote")
def rollout_promote(
    languages: Annotated[str | None, typer.Option("--languages", "-l")] = None,
    bootstrap: BootstrapOpt = None,
) -> None:
    """Step the canary up now (every active language, or those given)."""
    _operator("PROMOTE", languages, bootstrap)


@rollout_app.command("abort")
def rollout_abort(
    languages: Annotated[str | None, typer.Option("--languages", "-l")] = None,
    bootstrap: BootstrapOpt = None,
) -> None:
    """Set the canary's share to 0 now and stop judging (every active language, or those)."""
    _operator("ABORT", languages, bootstrap)


@rollout_app.command("status")
def rollout_status(
    windows: Annotated[int, typer.Option(help="Recent windows shown per language.")] = 5,
    bootstrap: BootstrapOpt = None,
) -> None:
    """Per language: stable, canary, share, phase, recent windows, last decision."""
    from workers.guard.events import load_book

    settings, events_topic, _ = _target(bootstrap)
    book = load_book(settings.kafka_common(), events_topic)
    if not book.states:
        typer.echo("no rollouts")
    for lang in sorted(book.states):
        s = book.states[lang]
        typer.echo(
            f"{lang}: {s.stable} -> {s.canary} {s.share:g}% {s.phase} "
            f"(rollout {s.rollout_id}, good {s.good_streak}, bad {s.bad_streak})"
        )
        judged = [e for e in book.history.get(lang, []) if e.get("window_start") is not None]
        for e in judged[-windows:]:
            f = e.get("figures", {})
            typer.echo(
                f"  window {e['window_start']}: {e['verdict']:<12} "
                f"canary n={f.get('canary_requests', 0):g} p99={f.get('canary_p99_ms', -1):g}"
                f" ms; stable n={f.get('stable_requests', 0):g} "
                f"p99={f.get('stable_p99_ms', -1):g} ms -> {e['action']}"
            )
            if "bad_diff_upper" in f:  # sequential mode: the step's evidence so far
                typer.echo(
                    f"    step: canary n={f.get('step_canary_requests', 0):g}, stable "
                    f"n={f.get('step_stable_requests', 0):g}; canary - stable, bad rate in "
                    f"[{f['bad_diff_lower']:+.3f}, {f['bad_diff_upper']:+.3f}], over-SLO rate "
                    f"in [{f['slow_diff_lower']:+.3f}, {f['slow_diff_upper']:+.3f}] "
                    f"(level {f.get('alpha_per_test', 0):g} each)"
                )
        last = book.last_decision(lang)
        if last is not None:
            typer.echo(f"  last decision: {last['action']} ({'; '.join(last['reasons'])})")


WHAT, SETTING = "guard metrics (/metrics)", "tolk guard --metrics-port"  # in messages


def guard(
    window_s: Annotated[float, typer.Option(help="Tumbling window length, seconds.")] = 30.0,
    min_requests: Annotated[int, typer.Option(help="Canary replies for a verdict.")] = 10,
    bad_windows: Annotated[int, typer.Option(help="Consecutive bad windows: rollback.")] = 3,
    good_windows: Annotated[int, typer.Option(help="Consecutive good windows: promote.")] = 3,
    min_share: Annotated[float, typer.Option(help="No verdict below this share.")] = 1.0,
    decision: Annotated[
        str,
        typer.Option(
            help="sequential: anytime-valid confidence sequences over each step; windows: "
            'streaks of window verdicts (docs/OPERATIONS.md, "Canary rollouts").'
        ),
    ] = "sequential",
    alpha: Annotated[
        float, typer.Option(help="sequential: false-alarm level, split over languages.")
    ] = 0.05,
    max_rate_increase: Annotated[
        float, typer.Option(help="Error/expired rate over the stable's by more: bad (margin).")
    ] = 0.05,
    max_slow_increase: Annotated[
        float, typer.Option(help="sequential: margin of the rate of replies over the SLO.")
    ] = 0.05,
    min_step_s: Annotated[
        float, typer.Option(help="sequential: a step lasts this long before a promotion.")
    ] = 60.0,
    grace_s: Annotated[float, typer.Option(help="Wait after a window's end.")] = 2.0,
    max_latency_ratio: Annotated[
        float, typer.Option(help="Canary P95 (P99 past the SLO) above this x the stable's: bad.")
    ] = 1.5,
    latency_slack_ms: Annotated[
        float, typer.Option(help="Added to the P95 bound: the latency noise tolerated.")
    ] = 250.0,
    app_id: Annotated[str, typer.Option(help="Faust app id (group, changelog).")] = "tolk-guard",
    replies_topic: Annotated[str | None, typer.Option(help="Default: the catalog's.")] = None,
    metrics_port: Annotated[
        str | None,
        typer.Option(
            help="Prometheus port: a number (taken: exit 2), auto (a free one, logged), 0 = off; "
            "default 9401, or a free one when that is taken (workers/ports.py).",
        ),
    ] = None,
    datadir: Annotated[str, typer.Option(help="Faust's local state directory.")] = ".tolk-guard",
    bootstrap: BootstrapOpt = None,
    log_level: Annotated[
        str, typer.Option(help="debug|info|warning|error|critical (warn, crit: the same)")
    ] = "info",
) -> None:
    """Run the canary guard: count replies per window, roll back or promote canaries."""
    import logging

    from topics.catalog import replies_topic as default_replies
    from workers.guard.app import run_guard
    from workers.guard.core import GuardConfig
    from workers.guard.policy import DECISIONS, GuardPolicy
    from workers.log_levels import parse_log_level
    from workers.ports import PortUnavailable, parse_port

    try:
        level = parse_log_level(log_level)  # one name that logging and faust both know
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--log-level") from None
    if decision not in DECISIONS:
        raise typer.BadParameter(f"one of {', '.join(DECISIONS)}", param_hint="--decision")
    try:
        port = None if metrics_port is None else parse_port(metrics_port, "--metrics-port")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--metrics-port") from None
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings, events_topic, control_topic = _target(bootstrap)
    from topics.cluster import KafkaConnectionError, check_broker
    from workers.guard.broker_auth import GuardSecurityError, faust_credentials
    from workers.ports import in_use_message, port_in_use

    if port is not None and port > 0 and port_in_use(port):  # before reaching the broker
        typer.echo(f"error: {in_use_message(WHAT, port, SETTING)}", err=True)
        raise typer.Exit(2)
    try:  # the faust consumer must speak the deployment's security, or no start
        faust_credentials(settings.kafka_common())
    except GuardSecurityError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:  # as `tolk worker`: a protocol mismatch, a failed login, an unknown CA, said at once
        check_broker(settings.kafka_common())
    except KafkaConnectionError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    config = GuardConfig(
        bootstrap=settings.bootstrap,
        kafka_config=settings.kafka_common(),
        replies_topic=replies_topic or default_replies(settings.topic_prefix),
        events_topic=events_topic,
        control_topic=control_topic,
        policy=GuardPolicy(
            window_s=window_s,
            min_requests=min_requests,
            bad_windows_to_rollback=bad_windows,
            good_windows_to_promote=good_windows,
            min_share=min_share,
            max_rate_increase=max_rate_increase,
            max_latency_ratio=max_latency_ratio,
            latency_slack_ms=latency_slack_ms,
            decision=decision,
            alpha=alpha,
            languages=max(1, len(settings.policies)),
            max_slow_increase=max_slow_increase,
            min_step_s=min_step_s,
        ),
        slos=dict(settings.policies),
        app_id=app_id,
        guard_id=f"{app_id}@{settings.worker_id}",
        grace_s=grace_s,
        datadir=datadir,
    )
    try:
        run_guard(config, metrics_port=port, loglevel=level.lower(), what=WHAT, setting=SETTING)
    except PortUnavailable as exc:  # another guard (or worker) on this host holds it
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@arms_app.command("set")
def arms_set(
    language: Annotated[str, typer.Argument(help="Target language, or '*' for the default.")],
    shares: Annotated[list[str], typer.Argument(help="ARM=PERCENT ..., summing to 100.")],
    bootstrap: BootstrapOpt = None,
    by: Annotated[str | None, typer.Option(help="Who sets it (default user@host).")] = None,
) -> None:
    """Set a language's shares: `tolk arms set de A=30 B=70` (workers apply it within 5 s)."""
    from workers.arms import describe_shares, parse_share_args
    from workers.kafka.arm_control import ArmControlError, publish_shares

    settings, _, topic = _target(bootstrap)
    try:
        parsed = parse_share_args(shares)
        publish_shares(settings.kafka_common(), topic, language, parsed, updated_by=by)
    except (ValueError, ArmControlError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{language}: {describe_shares(parsed)}")


@arms_app.command("clear")
def arms_clear(
    language: Annotated[str, typer.Argument(help="Target language, or '*'.")],
    bootstrap: BootstrapOpt = None,
) -> None:
    """Remove a language's entry (a tombstone): it falls back to '*', else every arm serves."""
    from workers.kafka.arm_control import ArmControlError, publish_shares

    settings, _, topic = _target(bootstrap)
    try:
        publish_shares(settings.kafka_common(), topic, language, None)
    except (ValueError, ArmControlError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{language}: cleared")


@arms_app.command("show")
def arms_show(bootstrap: BootstrapOpt = None) -> None:
    """Print the share table as the workers read it."""
    from workers.arms import describe_shares
    from workers.kafka.arm_control import ArmControlError, read_share_table

    settings, _, topic = _target(bootstrap)
    try:
        table = read_share_table(settings.kafka_common(), topic)
    except ArmControlError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if not table:
        typer.echo("no shares configured: every arm serves every request (mirror)")
    for lang in sorted(table.entries):
        typer.echo(f"{lang}: {describe_shares(table.entries[lang])}")
