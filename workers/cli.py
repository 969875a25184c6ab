"""`tolk`: the command line. Thin commands; heavy imports (torch, Kafka) inside them so that
`tolk --help` answers at once.

    tolk up | down | status            the local stack (compose/stack.sh)
    tolk topics create                 create the catalog's topics
    tolk worker [--model ...]          run a worker with the real engine
    tolk translate "text" --to de      one request through Kafka
    tolk demo                          the end-to-end demo
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="tolk: Kafka-native translation inference.", no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")

STACK_SCRIPT = Path(__file__).resolve().parent.parent / "compose" / "stack.sh"

LanguagesOpt = Annotated[
    str | None, typer.Option("--languages", "-l", help="Comma list of target languages.")
]
BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers.")
]


def run_stack(command: str) -> int:
    """`bash compose/stack.sh <command>`; its exit code (2 when the script is missing)."""
    if not STACK_SCRIPT.is_file():
        typer.echo(f"compose script not found: {STACK_SCRIPT}", err=True)
        return 2
    return subprocess.call(["bash", str(STACK_SCRIPT), command])


def _stack(command: str) -> None:
    raise typer.Exit(run_stack(command))


@app.command()
def up() -> None:
    """Start the local Kafka broker and redis (idempotent)."""
    _stack("up")


@app.command()
def down() -> None:
    """Stop the local stack."""
    _stack("down")


@app.command()
def status() -> None:
    """Say what runs; exit 0 only when both Kafka and redis answer."""
    _stack("status")


def _settings(**overrides: Any) -> Any:
    from workers.settings import Settings, parse_languages

    kw = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(kw.get("languages"), str):
        kw["languages"] = parse_languages(kw["languages"])
    return Settings.from_env(**kw)


def _check_broker_or_exit(settings: Any) -> None:
    """Fail fast, before the model loads, when the broker cannot be reached with the
    configured security settings (a protocol mismatch, bad credentials, an unknown CA)."""
    from workers.kafka_config import KafkaConnectionError, check_broker

    try:
        check_broker(settings.kafka_common())
    except KafkaConnectionError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@topics_app.command("create")
def topics_create(
    languages: LanguagesOpt = None,
    bootstrap: BootstrapOpt = None,
    partitions: Annotated[int, typer.Option(help="Partitions per topic.")] = 3,
) -> None:
    """Create the request, reply and dead-letter topics that are missing."""
    import dataclasses

    from topics.admin import TopicAdminError, ensure_topics
    from topics.catalog import catalog

    settings = _settings(languages=languages, bootstrap=bootstrap)
    specs = [
        dataclasses.replace(s, name=settings.topic_prefix + s.name)
        for s in catalog(settings.languages, partitions)
    ]
    try:
        outcome = ensure_topics(settings.bootstrap, specs, client_config=settings.kafka_common())
    except TopicAdminError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for name, what in outcome.items():
        typer.echo(f"{name}: {what}")


@app.command()
def worker(
    model: Annotated[str | None, typer.Option(help="Model preset, .gguf or HF directory.")] = None,
    languages: LanguagesOpt = None,
    bootstrap: BootstrapOpt = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port (0 = off).")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    quantize: Annotated[
        str | None, typer.Option(help="'int8': weight-only int8 projections (CPU: tolk's kernel).")
    ] = None,
    compile_decode: Annotated[
        bool, typer.Option(help="Small decode steps through torch.compile (~1-2 min at start).")
    ] = False,
    log_level: Annotated[str, typer.Option(help="Python logging level.")] = "INFO",
) -> None:
    """Run a worker: consume the language topics, translate, reply (Ctrl-C drains and stops)."""
    import logging

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = _settings(
        model=model, languages=languages, bootstrap=bootstrap, metrics_port=metrics_port
    )
    logging.getLogger(__name__).info("settings: %r", settings)  # secrets masked in repr
    _check_broker_or_exit(settings)

    from workers.engine.engine import EngineConfig
    from workers.serving.fair_engine import build_fair_engine
    from workers.worker import Worker

    policies = {k: v for k, v in settings.policies.items() if k in settings.languages}
    # Weighted fair share (VTC) across languages, deadline admission, no OK after a deadline.
    # EngineConfig.warm_languages puts each language's prompt prefix into the prefix cache
    # before the first request.
    engine = build_fair_engine(
        EngineConfig(
            model=settings.model,
            device=device,
            quantize=quantize,
            compile_decode=compile_decode,
            warm_languages=tuple(settings.languages),
            max_new_tokens=max((p.max_new_tokens for p in policies.values()), default=256),
        ),
        policies,
        burst_tokens=settings.burst_tokens,
    )
    Worker(settings, engine).run()


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
