"""`tolk`: the command line. Thin commands; heavy imports (torch, Kafka) inside them so that
`tolk --help` answers at once.

    tolk up | down | status            the local stack (compose/stack.sh)
    tolk topics create                 create the catalog's topics
    tolk worker [--model ...]          run a worker with the real engine (--arm NAME: an A/B arm)
    tolk arms set|clear|show           the arms' shares per language (control topic)
    tolk replay run | report           replay logs to the arms, the A/B report (replay/cli.py)
    tolk tm import|build|query|status  translation memories, the phrase index (tm/cli.py)
    tolk rollout start|status|promote|abort   canary rollouts per language (rollout_cli.py)
    tolk guard                         the canary guard: windows, rollback, promotion
    tolk translate "text" --to de      one request through Kafka
    tolk demo                          the end-to-end demo

One concern, over 400 lines: the commands' declarations. Each option is one typed parameter
with its help text, and `tolk worker` alone declares some forty; the work behind each command
lives elsewhere (worker_start.py, rollout_cli.py, replay/cli.py, tm/cli.py). Issue #46's one
options object would move the worker's options into a typed tree and shorten this file.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Annotated, Any

import typer

from replay.cli import app as replay_app  # typer only: the replay job loads inside its commands
from workers.loadtest.cli import load as load_command  # typer only: locust loads inside
from workers.rollout_cli import arms_app, rollout_app
from workers.rollout_cli import guard as guard_command
from workers.tm.cli import app as tm_app  # typer only: faiss and torch load inside

app = typer.Typer(help="tolk: Kafka-native translation inference.", no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics.", no_args_is_help=True)


@app.callback()
def _every_command() -> None:
    # Runs before every subcommand (worker, guard, replay, load, demo, ...): a native crash
    # (librdkafka, torch) leaves each thread's Python stack on stderr (workers/process_hooks.py).
    from workers.process_hooks import enable_crash_dumps

    enable_crash_dumps()


app.add_typer(topics_app, name="topics")
app.add_typer(arms_app, name="arms")  # the shares per language (workers/rollout_cli.py)
app.add_typer(replay_app, name="replay")
app.add_typer(tm_app, name="tm")  # translation memories (workers/tm/cli.py)
app.add_typer(rollout_app, name="rollout")  # canary rollouts (workers/rollout_cli.py)
app.command("guard")(guard_command)
app.command("load")(load_command)  # open-loop Locust load test (workers/loadtest/cli.py)

STACK_SCRIPT = Path(__file__).resolve().parent.parent / "compose" / "stack.sh"

LanguagesOpt = Annotated[
    str | None, typer.Option("--languages", "-l", help="Comma list of target languages.")
]
BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers.")
]


def run_stack(command: str, env: dict[str, str] | None = None) -> int:
    """`bash compose/stack.sh <command>`; its exit code (2 when the script is missing).
    `env`: variables added to this process's environment for the script."""
    if not STACK_SCRIPT.is_file():
        typer.echo(f"compose script not found: {STACK_SCRIPT}", err=True)
        return 2

    return subprocess.call(["bash", str(STACK_SCRIPT), command], env={**os.environ, **(env or {})})


def _stack(command: str) -> None:
    raise typer.Exit(run_stack(command))


@app.command()
def up(
    observability: Annotated[
        bool,
        typer.Option(help="Also Prometheus on :9090, scraping workers (:9400) and `tolk load`."),
    ] = False,
    registry: Annotated[
        bool,
        typer.Option(
            help="The Schema Registry on :8085 too (Apicurio, built with mvn the first time; "
            "Confluent-compatible API at /apis/ccompat/v7)."
        ),
    ] = True,
) -> None:
    """Start the local Kafka broker, redis and the Schema Registry (idempotent);
    --observability: Prometheus too."""
    env = {"TOLK_REGISTRY": "1" if registry else "0"}
    if observability:
        env["TOLK_OBSERVABILITY"] = "1"
    raise typer.Exit(run_stack("up", env))


@app.command()
def down() -> None:
    """Stop the local stack."""
    _stack("down")


@app.command()
def status() -> None:
    """Say what runs (and a local worker's configuration); exit 0 only when both Kafka and
    redis answer."""
    from workers.health import describe_local_worker

    code = run_stack("status")
    typer.echo(describe_local_worker())
    raise typer.Exit(code)


def _settings(**overrides: Any) -> Any:
    from workers.settings import Settings, parse_languages

    kw = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(kw.get("languages"), str):
        kw["languages"] = parse_languages(kw["languages"])
    return Settings.from_env(**kw)


def _check_broker_or_exit(settings: Any) -> None:
    """Fail fast, before the model loads, when the broker cannot be reached with the
    configured security settings (a protocol mismatch, bad credentials, an unknown CA)."""
    from topics.cluster import KafkaConnectionError, check_broker

    try:
        check_broker(settings.kafka_common())
    except KafkaConnectionError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _check_ports_or_exit(settings: Any) -> None:
    """Refuse (exit 2) before the model loads when a port given explicitly is taken: a second
    worker on the host must not run without probes or metrics (workers/ports.py)."""
    from workers.ports import in_use_message, port_in_use

    for port, what, setting in (
        (settings.health_port, "health probes (/readyz, /livez)", "TOLK_HEALTH_PORT"),
        (settings.metrics_port, "metrics (/metrics)", "TOLK_METRICS_PORT / --metrics-port"),
    ):
        if port is not None and port > 0 and port_in_use(port):
            typer.echo(f"error: {in_use_message(what, port, setting)}", err=True)
            raise typer.Exit(2)


@topics_app.command("create")
def topics_create(
    languages: LanguagesOpt = None,
    bootstrap: BootstrapOpt = None,
    partitions: Annotated[int, typer.Option(help="Partitions per topic.")] = 3,
    registry: Annotated[
        str | None,
        typer.Option(
            help="Schema Registry URL (Confluent-compatible API) to register each topic's "
            "value schema in, as <topic>-value (default TOLK_SCHEMA_REGISTRY_URL, else the "
            "local stack's when it answers; none: skip)."
        ),
    ] = None,
) -> None:
    """Create the request, reply and dead-letter topics that are missing; with a Schema
    Registry, register their value schemas (a refused change: the registry's reason, exit 1)."""
    import dataclasses

    from schemas.registry import RegistryError, SchemaRegistry
    from topics.admin import TopicAdminError, ensure_topics
    from topics.catalog import catalog
    from topics.subjects import SubjectRefused, register_subjects

    settings = _settings(languages=languages, bootstrap=bootstrap)
    specs = [
        dataclasses.replace(s, name=settings.topic_prefix + s.name)
        for s in catalog(settings.languages, partitions)
    ]
    url = registry if registry is not None else settings.schema_registry_url or _local_registry()
    subjects: dict[str, str] = {}
    try:
        if url:  # first: a refused schema change stops before any topic is made
            client = SchemaRegistry.from_url(url, ca_file=settings.ssl_ca_location or None)
            subjects = register_subjects(client, specs)
        outcome = ensure_topics(settings.bootstrap, specs, client_config=settings.kafka_common())
    except (TopicAdminError, RegistryError, SubjectRefused) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for name, what in {**outcome, **subjects}.items():
        typer.echo(f"{name}: {what}")


def _local_registry() -> str:
    """The local stack's Schema Registry URL when one answers there (`tolk up`), else ""."""
    import os

    from schemas.registry import RegistryError, SchemaRegistry

    port = os.environ.get("TOLK_REGISTRY_PORT", "8085")
    url = f"http://127.0.0.1:{port}/apis/ccompat/v7"
    try:
        SchemaRegistry(url, timeout_s=1.0).subjects()
    except RegistryError:
        return ""
    typer.echo(f"registry: {url} (the local stack's; TOLK_SCHEMA_REGISTRY_URL names another)",
               err=True)  # fmt: skip
    return url


@app.command()
def worker(
    model: Annotated[
        str | None, typer.Option(help="Preset (docs: presets.py), .gguf, HF dir.")
    ] = None,
    languages: LanguagesOpt = None,
    bootstrap: BootstrapOpt = None,
    metrics_port: Annotated[
        str | None,
        typer.Option(
            help="Prometheus port: a number (taken: exit 2), auto (a free one, logged), 0 = off; "
            "default TOLK_METRICS_PORT, else 9400 or a free one (workers/ports.py).",
        ),
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            help="auto (CUDA when usable, else CPU), cpu, or cuda (refuses to start without "
            "usable CUDA). The choice and its reason are logged (docs/OPERATIONS.md)."
        ),
    ] = "auto",
    triton_kernels: Annotated[
        bool,
        typer.Option(help="On CUDA: the Triton kernels, checked against the eager path at start."),
    ] = True,
    cuda_graphs: Annotated[
        bool,
        typer.Option(help="On CUDA: decode steps as CUDA graphs, checked at start."),
    ] = True,
    quantize: Annotated[
        str | None,
        typer.Option(
            help="Weights: 'none' (float32), 'bfloat16', 'int8' or 'int4' (weight-only, "
            "group-wise; tolk's CPU kernels). Default: the auto configuration's choice."
        ),
    ] = None,
    compile_decode: Annotated[
        bool | None,
        typer.Option(
            "--compile-decode/--no-compile-decode",
            help="Small decode steps through torch.compile. Default: the auto choice.",
        ),
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option(help="'ngram': speculative decoding, same output (engine/speculative.py)."),
    ] = None,
    cascade: Annotated[
        str | None,
        typer.Option(
            help="A larger model (a preset, e.g. qwen2.5-coder-1.5b) that translates where "
            "--model's answer is likely wrong, within the deadline (stages/cascade/stage.py)."
        ),
    ] = None,
    cascade_thresholds: Annotated[
        Path | None,
        typer.Option(
            help="The cascade's per-pair thresholds (python -m bench.cascade --calibrate "
            "--out-thresholds F). Default: the packaged calibration of gemma3-270m and "
            "qwen2.5-coder-1.5b."
        ),
    ] = None,
    cascade_early: Annotated[
        bool,
        typer.Option(
            "--cascade-early/--no-cascade-early",
            help="Stop the small model's answer as soon as its score so far falls under the "
            "threshold and defer at once (the same decision; a total signal only).",
        ),
    ] = True,
    auto: Annotated[
        bool,
        typer.Option(
            "--auto/--no-auto",
            envvar="TOLK_AUTO",
            help="Pick the fastest weights / compiled decode that pass the quality gate, by a "
            "start-up probe cached on disk (workers/engine/autoprobe.py); flags still win. "
            "--no-auto (TOLK_AUTO=0): eager float32 unless the flags say otherwise.",
        ),
    ] = True,
    log_level: Annotated[
        str, typer.Option(help="debug|info|warning|error|critical (warn, crit: the same)")
    ] = "info",
    arm: Annotated[
        str | None,
        typer.Option(help="Serve as this A/B arm: own group, shares from `tolk arms`."),
    ] = None,
    protect_spans: Annotated[
        bool,
        typer.Option(help="Mask numbers, URLs, ids, placeholders before translating; restore."),
    ] = False,
    faithful_checks: Annotated[
        bool,
        typer.Option(
            "--faithful/--no-faithful",
            help="Length guard + output checks (leak, ratio, loop, number, language), one retry.",
        ),
    ] = True,
    faithful_policy: Annotated[
        str,
        typer.Option(
            help="An answer still suspect after the retry: 'withhold' it (ERROR reply, the "
            "candidate in metadata) or send it 'flag'ged.",
        ),
    ] = "withhold",
    cache: Annotated[
        bool | None,
        typer.Option(
            "--cache/--no-cache",
            help="Exact-match translation cache, L1 + Redis (default on; TOLK_CACHE=0: off).",
        ),
    ] = None,
    context: Annotated[
        bool,
        typer.Option(
            "--context/--no-context",
            help="Earlier turns of the conversation in the prompt (TOLK_CONTEXT_TOKENS budget). "
            "TOLK_CONTEXT_LAYOUT direction|dialogue. No detectable gain with Gemma 3 270M, at "
            "about twice the compute (docs/BENCHMARKS.md): A/B it before use.",
        ),
    ] = False,
    drill_inject_latency: Annotated[
        list[str] | None,
        typer.Option(
            help="DRILL, a canary made slow: lang:fraction:ms (workers/stages/drill/stage.py)."
        ),
    ] = None,
    drill_inject_errors: Annotated[
        list[str] | None,
        typer.Option(help="DRILL, a canary made to fail: lang:fraction."),
    ] = None,
    tm_examples: Annotated[
        int,
        typer.Option(help="Retrieved examples: the K nearest TM pairs in each prompt (0 = off)."),
    ] = 0,
    tm_dir: Annotated[
        Path,
        typer.Option(envvar="TOLK_TM_DIR", help="The TM directory of --tm-examples (tolk tm)."),
    ] = Path("tm"),
) -> None:
    """Run a worker: consume the language topics, translate, reply (Ctrl-C drains and stops)."""

    from workers.log_levels import parse_log_level

    try:
        level = parse_log_level(log_level)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--log-level") from None
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from workers.stages.faithful.stage import POLICIES

    if faithful_policy not in POLICIES:
        raise typer.BadParameter(f"one of {', '.join(POLICIES)}", param_hint="--faithful-policy")
    from workers.ports import parse_port

    try:
        port = None if metrics_port is None else parse_port(metrics_port, "--metrics-port")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--metrics-port") from None
    # --device, and the GPU path checked against the eager path (workers/engine/device_select.py):
    # a device that cannot be had refuses here, before the broker and the model
    from workers.engine import device_select

    if device not in device_select.DEVICES:
        raise typer.BadParameter(
            f"one of {', '.join(device_select.DEVICES)}", param_hint="--device"
        )
    try:
        resolved_device, _ = device_select.choose_device(
            device, device_select.cuda_problem() if device != "cpu" else None
        )
    except device_select.DeviceUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = _settings(
        model=model, languages=languages, bootstrap=bootstrap, metrics_port=port, arm=arm
    )
    if not settings.schema_registry_url:  # a bot's registry-format request needs its ids
        settings = settings.replace(schema_registry_url=_local_registry())
    logging.getLogger(__name__).info("settings: %r", settings)  # secrets masked in repr
    _check_ports_or_exit(settings)  # before the model loads, as is the broker check
    _check_broker_or_exit(settings)

    from workers.worker_start import StartRefused, WorkerPlan, run_worker

    plan = WorkerPlan(
        device=device,
        resolved_device=resolved_device,
        triton_kernels=triton_kernels,
        cuda_graphs=cuda_graphs,
        quantize=quantize,
        compile_decode=compile_decode,
        draft=draft,
        cascade=cascade,
        cascade_thresholds=cascade_thresholds,
        cascade_early=cascade_early,
        auto=auto,
        tm_examples=tm_examples,
        tm_dir=tm_dir,
        faithful=faithful_checks,
        faithful_policy=faithful_policy,
        protect_spans=protect_spans,
        cache=cache,
        context=context,
        drill_latency=tuple(drill_inject_latency or ()),
        drill_errors=tuple(drill_inject_errors or ()),
    )
    try:
        code = run_worker(settings, plan)  # workers/worker_start.py
    except StartRefused as exc:
        if exc.option:
            raise typer.BadParameter(str(exc), param_hint=exc.option) from None
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.code) from None
    if code:
        raise typer.Exit(code)


@app.command()
def translate(
    text: Annotated[str, typer.Argument(help="Text to translate.")],
    to: Annotated[str, typer.Option("--to", help="Target language.")],
    src: Annotated[str, typer.Option("--src", help="Source language ('' = detect).")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the reply.")] = 30.0,
    bootstrap: BootstrapOpt = None,
) -> None:
    """Send one request through Kafka and print the translation."""
    import asyncio

    from workers.client import TranslationClient, TranslationError

    settings = _settings(bootstrap=bootstrap)

    async def run() -> str:
        async with TranslationClient(
            settings.bootstrap,
            topic_prefix=settings.topic_prefix,
            kafka_config=settings.kafka_security(),
        ) as client:
            reply = await client.translate(text, to=to, src=src, deadline=timeout, timeout=timeout)
            return reply.text

    try:
        typer.echo(asyncio.run(run()))
    except TranslationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="Model preset, .gguf or HF directory.")] = (
        "gemma3-270m"
    ),
    count: Annotated[int, typer.Option(help="Messages to send (from the shipped sample).")] = 36,
    languages: Annotated[
        str, typer.Option("--languages", "-l", help="Comma list of target languages.")
    ] = "en,de,fr,es,it",
) -> None:
    """The end-to-end demo: local stack, topics, a worker with the packaged model, and real
    support messages through Kafka (workers/demo.py)."""
    from workers.demo import main
    from workers.settings import parse_languages

    rc = main(
        model=model,
        count=count,
        languages=parse_languages(languages),
        stack_up=lambda: run_stack("up"),
    )
    raise typer.Exit(rc)


if __name__ == "__main__":
    app()
