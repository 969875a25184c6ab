"""`tolk demo`: real support messages through the whole path, on this machine.

    local stack (Kafka + redis)  ->  topics  ->  a worker (in-process thread, real engine)
    ->  the asyncio client sends a few dozen messages  ->  prints each translation as it
    arrives, then latency per language and a summary.

The messages are the sample shipped in `workers/data/support_sample.jsonl` (customer German ->
English and agent English -> German from BConTrasT chats, plus short English sentences into
French, Spanish and Italian from Tatoeba and xSID; licenses and sources beside it).

The demo keeps to its own topics (`demo.` prefix) and consumer group, so it neither eats a
running deployment's requests nor replays their history. Latency is the client's: from just
before the request is produced to the reply's arrival.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = ["DemoMessage", "load_sample", "main", "pick_messages"]

DEMO_PREFIX = "demo."
DEMO_GROUP = "tolk-demo"
DEFAULT_LANGUAGES = ("en", "de", "fr", "es", "it")
SAMPLE_FILE = "support_sample.jsonl"

Echo = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoMessage:
    id: str
    source_lang: str
    target_lang: str
    text: str
    reference: str  # the human translation (shown for comparison, never sent)
    speaker: str  # customer / agent / user
    conversation_id: str | None


def load_sample() -> list[DemoMessage]:
    """The shipped sample, in file order (conversations in turn order)."""
    path = resources.files("workers").joinpath("data", SAMPLE_FILE)
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(
                    DemoMessage(
                        r["id"],
                        r["source_lang"],
                        r["target_lang"],
                        r["text"],
                        r["reference"],
                        r["speaker"],
                        r.get("conversation_id"),
                    )
                )
    return out


def pick_messages(
    sample: Sequence[DemoMessage], count: int, languages: Sequence[str]
) -> list[DemoMessage]:
    """`count` messages whose target is in `languages`, round-robin over the target languages
    (so every language shows up early), each language's messages in sample order."""
    by_lang = {lang: [m for m in sample if m.target_lang == lang] for lang in languages}
    out: list[DemoMessage] = []
    i = 0
    while len(out) < count and any(i < len(v) for v in by_lang.values()):
        out.extend(v[i] for v in by_lang.values() if i < len(v))
        i += 1
    return out[:count]


def _port_open(hostport: str) -> bool:
    host, _, port = hostport.split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _short(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def main(
    model: str = "gemma3-270m",
    count: int = 36,
    languages: Sequence[str] | None = None,
    *,
    stack_up: Callable[[], int] | None = None,
    echo: Echo = print,
    timeout_s: float = 600.0,
) -> int:
    """Run the demo; returns the process exit code (0 when every message was translated).

    `stack_up` starts the local stack when Kafka or redis is not answering (the CLI passes
    `bash compose/stack.sh up`); None means the stack must already run.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from workers.settings import Settings

    langs = tuple(languages or DEFAULT_LANGUAGES)
    settings = Settings.from_env(
        languages=langs, topic_prefix=DEMO_PREFIX, group_id=DEMO_GROUP, metrics_port=0
    )
    # host:port only: the URL may carry the redis password (`redis://:pw@host:port/0`).
    redis_hostport = settings.redis_url.split("//", 1)[-1].split("/", 1)[0].rpartition("@")[2]
    if not (_port_open(settings.bootstrap) and _port_open(redis_hostport)):
        if stack_up is None:
            echo(f"Kafka ({settings.bootstrap}) or redis ({redis_hostport}) is not answering")
            return 2
        echo("[1/5] starting the local stack (Kafka + redis): bash compose/stack.sh up")
        rc = stack_up()
        if rc != 0:
            echo(f"the stack did not start (exit {rc}); see compose/stack.sh")
            return rc
    else:
        echo(f"[1/5] local stack is up: Kafka {settings.bootstrap}, redis {redis_hostport}")

    picked = pick_messages(load_sample(), count, langs)
    if not picked:
        echo(f"no sample message targets {', '.join(langs)}")
        return 2
    _create_topics(settings, echo)

    engine = _load_engine(model, langs, echo)
    known = set(engine.languages)
    picked = [m for m in picked if m.source_lang in known and m.target_lang in known]

    from prometheus_client import CollectorRegistry

    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.worker import Worker

    settings = settings.replace(policies=_demo_policies(settings, langs))
    # the service's faithfulness guards, as `tolk worker` runs them (an answer still suspect
    # after a retry is withheld: an ERROR reply with the candidate in its metadata); no cache
    served = build_served_engine(
        engine, ServingOptions.of(settings, faithful=True, max_new_tokens=64), base=engine
    )
    worker = Worker(settings, served, registry=CollectorRegistry())
    stop = threading.Event()
    thread = worker.run_in_thread(stop)
    topics = f"{DEMO_PREFIX}tolk.requests.{{{','.join(langs)}}}"
    echo(f"[4/5] worker {settings.worker_id} (thread) consuming {topics}")
    if not worker.assigned_event.wait(60):
        echo("the worker got no partitions within 60 s")
        stop.set()
        thread.join(30)
        return 1
    try:
        t0 = time.perf_counter()
        results = asyncio.run(_send_all(settings, picked, echo, timeout_s))
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        thread.join(60)
    return _summarize(picked, results, wall, worker, echo)


def _create_topics(settings: Any, echo: Echo) -> None:
    from topics.admin import ensure_topics
    from topics.catalog import catalog

    specs = catalog(settings.languages, partitions=3, prefix=settings.topic_prefix)
    outcome = ensure_topics(settings.bootstrap, specs, client_config=settings.kafka_common())
    created = sum(1 for v in outcome.values() if v == "created")
    echo(f"[2/5] topics: {len(outcome)} ({created} created), e.g. {specs[0].name}")


def _load_engine(model: str, langs: Sequence[str], echo: Echo) -> Any:
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import default_cache_dir

    cached = default_cache_dir().is_dir() and any(default_cache_dir().iterdir())
    echo(
        f"[3/5] loading {model}"
        + (
            " (first load: dequantizing the GGUF weights, ~80 s on 2 CPU cores; "
            "cached under ~/.cache/tolk for later runs)"
            if not cached
            else " (if this is its first load, dequantizing takes ~80 s; cached afterwards)"
        )
    )
    t0 = time.perf_counter()
    # warm_languages: each language's prompt prefix goes into the prefix cache at load
    engine = Engine.from_config(
        EngineConfig(model=model, warm_languages=tuple(langs), max_new_tokens=64)
    )
    echo(
        f"      loaded and prompt prefixes of {len(langs)} languages warmed in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return engine


def _demo_policies(settings: Any, langs: Sequence[str]) -> dict[str, Any]:
    """The settings' policies with a 64-token output cap (chat messages are short)."""
    import dataclasses

    from workers.fairness.policy import LanguagePolicy

    out = {}
    for lang in langs:
        p = settings.policy(lang) or LanguagePolicy(1.0, 5.0, 256, 64)
        out[lang] = dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, 64))
    return out


async def _send_all(
    settings: Any, picked: Sequence[DemoMessage], echo: Echo, timeout_s: float
) -> list[tuple[Any, float] | BaseException]:
    from workers.client import TranslationClient

    n = len(picked)
    echo(f"[5/5] sending {n} messages; translations print as they arrive\n")
    done = 0
    extra = {k: v for k, v in settings.kafka_common().items() if k != "bootstrap.servers"}
    async with TranslationClient(
        settings.bootstrap, topic_prefix=settings.topic_prefix, kafka_config=extra
    ) as client:

        async def one(m: DemoMessage) -> tuple[Any, float]:
            nonlocal done
            t0 = time.perf_counter()
            try:
                reply = await client.translate(
                    m.text,
                    to=m.target_lang,
                    src=m.source_lang,
                    timeout=timeout_s,
                    conversation_id=m.conversation_id or f"demo-{uuid.uuid4().hex[:8]}",
                    raise_on_error=False,
                )
            except Exception as exc:
                done += 1
                echo(f"[{done:>3}/{n}] {m.source_lang}->{m.target_lang}  failed: {exc}")
                raise
            latency = time.perf_counter() - t0
            done += 1
            shown = reply.text if reply.ok else f"{reply.status}: {reply.error}"
            if reply.withheld is not None:
                shown = f"(withheld: {reply.error}; candidate: {reply.withheld!r})"
            echo(
                f"[{done:>3}/{n}] {m.source_lang}->{m.target_lang} {latency * 1e3:7.0f} ms  "
                f"({m.speaker})\n        {_short(m.text)}\n      → {_short(shown)}"
            )
            return reply, latency

        tasks = []
        for m in picked:  # a little spacing, as chat traffic arrives
            tasks.append(asyncio.create_task(one(m)))
            await asyncio.sleep(0.02)
        return await asyncio.gather(*tasks, return_exceptions=True)


def _summarize(
    picked: Sequence[DemoMessage],
    results: Sequence[tuple[Any, float] | BaseException],
    wall_s: float,
    worker: Any,
    echo: Echo,
) -> int:
    per_lang: dict[str, list[float]] = {}
    ok = failed = withheld = tokens = 0
    for m, r in zip(picked, results, strict=True):
        if isinstance(r, BaseException):
            failed += 1
            continue
        reply, latency = r
        if reply.withheld is not None:  # answered: the guards kept an unfaithful text back
            withheld += 1
        elif reply.ok:
            ok += 1
            tokens += reply.tokens_out
            per_lang.setdefault(f"{m.source_lang}->{m.target_lang}", []).append(latency)
        else:
            failed += 1
    echo("\nlatency per language pair (client send -> reply received):")
    echo(f"  {'pair':<8} {'n':>3} {'p50 ms':>8} {'p95 ms':>8}")
    for pair in sorted(per_lang):
        lat = sorted(per_lang[pair])
        echo(
            f"  {pair:<8} {len(lat):>3} {_percentile(lat, 50) * 1e3:>8.0f} "
            f"{_percentile(lat, 95) * 1e3:>8.0f}"
        )
    dup = worker.registry.get_sample_value("tolk_worker_duplicates_total") or 0
    echo(
        f"\nsummary: {ok}/{len(picked)} translated, {withheld} withheld as unfaithful, "
        f"{failed} failed; {tokens} tokens generated; "
        f"{wall_s:.1f}s wall ({ok / wall_s if wall_s else 0:.2f} msg/s, "
        f"{tokens / wall_s if wall_s else 0:.1f} tok/s); model {worker.engine.model_version}; "
        f"duplicates {int(dup)}; worker stopped cleanly: {worker.stopped_event.is_set()}"
    )
    return 0 if failed == 0 and ok + withheld == len(picked) else 1
