"""The serving benchmark's anchor: llama.cpp's `llama-server` on the same GGUF, same load.

Built from source by `bench/build_llama_server.sh` (the llama.cpp tree of the pinned
llama-cpp-python sdist; the flags are documented there). What is held equal with tolk:

* the GGUF file tolk's worker loads (`workers.engine.loader.resolve_source`, e.g. the
  gemma3-270m preset's assembled Q4_K_M file);
* the prompt TEXT: tolk's own few-shot prefix + query for the target language
  (`workers.engine.prompts.PromptBuilder.prefix_text` + `query_text`, the default form),
  sent raw to `/completion` with `cache_prompt: true`, so the server's slots reuse the
  shared prefix (`--cache-reuse`); llama-server adds the BOS token as tolk does. (tolk
  tokenizes prefix and query apart, the server the joined text: a token may differ at the
  seam.);
* the stop rule (a newline ends the answer; EOS as always) and the output cap (64 tokens);
  greedy decoding (`temperature: 0`, tolk's default);
* the threads (`-t 2 -tb 2`).

Two ways to reach it, both driven by the same open-loop schedule:

* `llama-http`: straight over HTTP, one aiohttp request per arrival (the harness's asyncio
  loop sends at the scheduled times; it never waits for a reply before the next send);
* `llama-kafka`: what a user would bolt on to serve tolk's topics with llama-server: a small
  consumer process (`python -m bench.serving_llamaserver consume ...`) that reads the request
  topics, calls the server from a pool of `-np` threads and produces a TranslationResult to
  the request's reply topic. The harness drives it with tolk's own client, exactly as it
  drives `tolk worker`. It has no deadlines, no fair share, no output guard.

A reply's `timings.predicted_ms` is the server's decode time (TTFT = latency - decode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serving_stats import Outcome, stage_split

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "bench" / "build_llama_server.sh"

__all__ = [
    "LlamaReply",
    "LlamaServer",
    "completion_body",
    "find_llama_server",
    "parse_completion",
    "prompt_text",
    "run_http",
]


def find_llama_server() -> Path | None:
    """$LLAMA_SERVER_BIN, else $LLAMA_SERVER_DIR/bin/llama-server (default <repo>/.llama-server),
    when executable."""
    env = os.environ.get("LLAMA_SERVER_BIN")
    cands = [Path(env)] if env else []
    cands.append(
        Path(os.environ.get("LLAMA_SERVER_DIR", REPO / ".llama-server")) / "bin" / "llama-server"
    )
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


# -- the request and its reply --------------------------------------------------------------


class _TextOnly:
    """Enough of a tokenizer for PromptBuilder to render prompt TEXT (no ids are made)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NotImplementedError("text only")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError("text only")

    def convert_tokens_to_ids(self, tokens: str) -> int | None:
        return None

    def get_vocab(self) -> dict[str, int]:
        return {"<|im_start|>": 0}  # keep a ChatML template ChatML (SmolLM2)


def gguf_arch(path: Path) -> str:
    """`general.architecture` of a GGUF file (gemma3, llama, ...)."""
    from gguf import GGUFReader

    from workers.engine.gguf_parse import one_gguf_parse

    with one_gguf_parse():  # fast: the reader's own parse of a 262k vocabulary takes 12 s+
        field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


class PromptTexts:
    """tolk's prompt text (default form) per (source, target, text)."""

    def __init__(self, arch: str, form: str | None = None) -> None:
        from workers.engine.prompts import PromptBuilder

        self.builder = PromptBuilder(_TextOnly(), arch, None, set(), form=form)
        self.stop_at_newline = self.builder.stop_rules.stop_at_newline

    def __call__(self, text: str, source_lang: str, target_lang: str) -> str:
        b = self.builder
        return b.prefix_text(target_lang) + b.query_text(text, source_lang, target_lang)


def prompt_text(arch: str, text: str, source_lang: str, target_lang: str) -> str:
    return PromptTexts(arch)(text, source_lang, target_lang)


def completion_body(prompt: str, max_new_tokens: int, stop_at_newline: bool) -> dict[str, Any]:
    """The `/completion` request: raw prompt, greedy, prompt cache on, tolk's stop rule."""
    return {
        "prompt": prompt,
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": True,
        "stop": ["\n"] if stop_at_newline else [],
        "stream": False,
    }


@dataclass(frozen=True, slots=True)
class LlamaReply:
    status: str  # OK or ERROR
    text: str
    tokens_in: int
    tokens_out: int
    cached_tokens: int
    prompt_ms: float
    predicted_ms: float
    stop_type: str  # eos / word (a stop string) / limit (the cap) / ...
    error: str | None


def parse_completion(http_status: int, body: str | bytes | Mapping[str, Any]) -> LlamaReply:
    """A `/completion` response (HTTP status + body) as a reply; anything but a 200 with a
    JSON object is an ERROR that says why."""
    data: Any = body
    if isinstance(body, str | bytes):
        try:
            data = json.loads(body)
        except ValueError:
            data = None
    if not isinstance(data, Mapping):
        raw = body if isinstance(body, str) else repr(body)[:200]
        return LlamaReply("ERROR", "", 0, 0, 0, 0.0, 0.0, "", f"HTTP {http_status}: {raw[:200]}")
    if http_status != 200 or "error" in data:
        err = data.get("error")
        msg = err.get("message") if isinstance(err, Mapping) else err
        return LlamaReply("ERROR", "", 0, 0, 0, 0.0, 0.0, "", f"HTTP {http_status}: {msg}")
    timings = data.get("timings") or {}
    text = str(data.get("content", "")).split("\n", 1)[0].strip()
    return LlamaReply(
        status="OK",
        text=text,
        tokens_in=int(data.get("tokens_evaluated", timings.get("prompt_n", 0)) or 0),
        tokens_out=int(data.get("tokens_predicted", timings.get("predicted_n", 0)) or 0),
        cached_tokens=int(data.get("tokens_cached", timings.get("cache_n", 0)) or 0),
        prompt_ms=float(timings.get("prompt_ms", 0.0) or 0.0),
        predicted_ms=float(timings.get("predicted_ms", 0.0) or 0.0),
        stop_type=str(data.get("stop_type", "")),
        error=None,
    )


# -- the server process -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """`llama-server` on a free loopback port; `with LlamaServer(...) as srv: srv.url`."""

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        *,
        threads: int = 2,
        parallel: int = 4,
        ctx_per_slot: int = 1024,
        cache_reuse: int = 256,
        log_path: Path | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(ctx_per_slot * parallel), "--cache-reuse", str(cache_reuse),
            "--no-webui", *extra,
        ]  # fmt: skip
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 300.0) -> None:
        log = self.log_path.open("wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited {self.proc.returncode}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama-server not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def complete_blocking(url: str, body: Mapping[str, Any], timeout_s: float) -> LlamaReply:
    """One `/completion` call with urllib (the bolt-on consumer's threads, warm-up)."""
    req = urllib.request.Request(
        url + "/completion", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return parse_completion(r.status, r.read())
    except urllib.error.HTTPError as exc:
        return parse_completion(exc.code, exc.read())
    except (urllib.error.URLError, OSError) as exc:
        return LlamaReply("ERROR", "", 0, 0, 0, 0.0, 0.0, "", f"{type(exc).__name__}: {exc}")


# -- straight over HTTP, open loop --------------------------------------------------------------


def run_http(
    url: str,
    requests: Sequence[tuple[float, str, str, str]],
    prompts: PromptTexts,
    *,
    max_new_tokens: int,
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    """Send `requests` ((offset_s, target, source, text), time-ordered) at their offsets from
    now; returns every outcome and the sending window (s)."""
    return asyncio.run(_run_http(url, requests, prompts, max_new_tokens, timeout_s))


async def _run_http(
    url: str,
    requests: Sequence[tuple[float, str, str, str]],
    prompts: PromptTexts,
    max_new_tokens: int,
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    import aiohttp

    outcomes: list[Outcome] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one(scheduled: float, tgt: str, src: str, text: str) -> None:
            lag = max(0.0, time.monotonic() - scheduled)
            body = completion_body(prompts(text, src, tgt), max_new_tokens, prompts.stop_at_newline)
            left = max(0.1, timeout_s - (time.monotonic() - scheduled))
            try:
                async with session.post(
                    url + "/completion", json=body, timeout=aiohttp.ClientTimeout(total=left)
                ) as resp:
                    reply = parse_completion(resp.status, await resp.read())
            except TimeoutError:
                outcomes.append(Outcome(tgt, "TIMEOUT", None, None, 0, lag))
                return
            except aiohttp.ClientError as exc:
                reply = LlamaReply("ERROR", "", 0, 0, 0, 0.0, 0.0, "", str(exc))
            latency = time.monotonic() - scheduled
            ttft = latency - reply.predicted_ms / 1e3 if reply.status == "OK" else None
            # llama-server reports no queue time: its slot wait is part of `outside`
            server_s = {"prefill": reply.prompt_ms / 1e3, "decode": reply.predicted_ms / 1e3}
            stages = stage_split(latency, {**server_s, "total": sum(server_s.values())})
            outcomes.append(
                Outcome(
                    tgt,
                    reply.status,
                    latency,
                    ttft,
                    reply.tokens_out,
                    lag,
                    stages if reply.status == "OK" else {},
                )  # fmt: skip
            )

        t0 = time.monotonic() + 0.05
        tasks = []
        for offset, tgt, src, text in requests:
            delay = t0 + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(t0 + offset, tgt, src, text)))
        window = time.monotonic() - t0
        await asyncio.gather(*tasks)
    return outcomes, window


# -- the bolt-on Kafka consumer ---------------------------------------------------------------


def consume_main(args: argparse.Namespace) -> None:
    """Consume the request topics, call llama-server from `--parallel` threads, reply."""
    from confluent_kafka import Consumer, Producer

    from schemas.codec import decode_request, encode_result
    from topics.catalog import request_topic

    prompts = PromptTexts(args.arch)
    consumer = Consumer({
        "bootstrap.servers": args.bootstrap, "group.id": args.group,
        "auto.offset.reset": "earliest", "enable.auto.commit": True,
    })  # fmt: skip
    producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 1})
    topics = [request_topic(lang, args.prefix) for lang in args.languages.split(",")]
    assigned = False

    def on_assign(c: Any, parts: Any) -> None:
        nonlocal assigned
        assigned = True
        print(f"assigned {[p.topic for p in parts]}", flush=True)

    consumer.subscribe(topics, on_assign=on_assign)
    pool = ThreadPoolExecutor(max_workers=args.parallel)

    def serve(req: dict[str, Any], received_ms: int) -> None:
        body = completion_body(
            prompts(req["text"], req["source_lang"] or "", req["target_lang"]),
            args.max_new_tokens, prompts.stop_at_newline,
        )  # fmt: skip
        reply = complete_blocking(args.url, body, args.timeout_s)
        now = int(time.time() * 1000)
        record = {
            "request_id": req["request_id"], "status": reply.status, "text": reply.text,
            "error": reply.error, "model_version": "llama-server",
            "source_lang": req.get("source_lang") or "", "target_lang": req["target_lang"],
            "timings": {"queue_ms": 0.0, "prefill_ms": reply.prompt_ms,
                        "decode_ms": reply.predicted_ms, "total_ms": float(now - received_ms)},
            "tokens_in": reply.tokens_in, "tokens_out": reply.tokens_out,
            "cached_prefix_tokens": reply.cached_tokens, "worker_id": "llama-bolt-on",
            "completed_at": now, "conversation_id": req.get("conversation_id"), "metadata": {},
        }  # fmt: skip
        producer.produce(req["reply_topic"], value=encode_result(record), key=req["request_id"])
        producer.poll(0)

    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stop:
        msg = consumer.poll(0.1)
        producer.poll(0)
        if msg is None or msg.error():
            continue
        try:
            req = decode_request(msg.value() or b"")
        except Exception as exc:  # noqa: BLE001 - a bad record is skipped, as a user would
            print(f"skipped an undecodable record: {exc}", flush=True)
            continue
        pool.submit(serve, req, int(time.time() * 1000))
    pool.shutdown(wait=False, cancel_futures=True)
    producer.flush(5)
    consumer.close()


def start_consumer(
    *, bootstrap: str, prefix: str, languages: Sequence[str], url: str, arch: str,
    parallel: int, max_new_tokens: int, timeout_s: float, log_path: Path,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """The bolt-on consumer as its own process; returns once it has its partitions."""
    import sys

    cmd = [
        sys.executable, "-m", "bench.serving_llamaserver", "consume", "--bootstrap", bootstrap,
        "--prefix", prefix, "--languages", ",".join(languages), "--url", url, "--arch", arch,
        "--parallel", str(parallel), "--max-new-tokens", str(max_new_tokens),
        "--timeout-s", str(timeout_s), "--group", f"{prefix}llama-bolt-on",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"bolt-on consumer exited {proc.returncode}; see {log_path}")
        if "assigned [" in log_path.read_text(errors="replace"):
            return proc
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"bolt-on consumer got no partitions within 120 s; see {log_path}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="The serving benchmark's llama-server helpers.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consume", help="the bolt-on Kafka consumer (started by bench.serving)")
    c.add_argument("--bootstrap", required=True)
    c.add_argument("--prefix", default="")
    c.add_argument("--languages", required=True)
    c.add_argument("--url", required=True)
    c.add_argument("--arch", default="gemma3")
    c.add_argument("--parallel", type=int, default=4)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--timeout-s", type=float, default=120.0)
    c.add_argument("--group", default="llama-bolt-on")
    args = p.parse_args(argv)
    consume_main(args)


if __name__ == "__main__":
    main()
