"""The replay run directory: what a run wrote, readable by the report and by a resumed run.

Layout (docs/REPLAY.md has every field):

    run.json          the run's settings and state ("finished": false until the wait is over)
    requests.jsonl    one line per request produced, written right after produce()
    replies.jsonl     one line per reply consumed, duplicates too, with its partition/offset
    problems.jsonl    one line per log row skipped

The JSON Lines files are append-only and flushed line by line, so a run killed at any point
leaves at most one partial last line; `repair_tail` cuts it off before a resumed run appends,
and `read_jsonl` ignores it. `run.json` is replaced atomically (write, fsync, rename). A resumed
run learns from `requests.jsonl` which requests went out (never sent twice) and from the
highest offset per partition in `replies.jsonl` where to continue reading its reply topic.
Times inside the files are ms after the run's `created_at_ms` (epoch), except the fields named
`*_at_ms`, which are epoch milliseconds.

A line of `requests.jsonl` is a `SentLine`, one of `replies.jsonl` a `ReplyLine`: the job writes
them with `to_json` and the report and a resumed run read them with `read_sent` /
`read_replies`, so no code reads their fields by string key (the request and reply fields they
copy are typed in `schemas/wire.py`). Reading is lenient: an unknown key is ignored and a
missing one takes its default, so run directories of older versions still report; a line
without a `request_id` is skipped like a broken one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, TypeVar

RUN_JSON = "run.json"
REQUESTS = "requests.jsonl"
REPLIES = "replies.jsonl"
PROBLEMS = "problems.jsonl"

REPO_ROOT = Path(__file__).resolve().parents[1]


class RunDirError(RuntimeError):
    """The run directory cannot be used (finished already, foreign files, unreadable)."""


def new_run_id(now_s: float | None = None) -> str:
    """`20261201T063400-1a2b3c`: sortable by time, unique enough for topic names."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_s if now_s is not None else None))
    return f"{stamp}-{secrets.token_hex(3)}"


def cpu_model() -> str:
    """The CPU's model name (lscpu's "Model name"), for the report (Intel and AMD
    machines differ in which kernels are fastest: docs/BENCHMARKS.md)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def tolk_commit() -> str | None:
    """The checkout's git commit, None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def sha256(path: Path) -> str:
    """The file's SHA-256 (a resumed run checks that its log did not change)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_run_info(run_dir: Path, info: Mapping[str, Any]) -> None:
    """Replace run.json atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RUN_JSON}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(dict(info), f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(run_dir / RUN_JSON)


def read_run_info(run_dir: Path) -> dict[str, Any] | None:
    """run.json, or None when the directory has none."""
    path = Path(run_dir) / RUN_JSON
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(info, dict):
        raise RunDirError(f"{path} does not hold a JSON object")
    return info


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The objects of a JSON Lines file; a partial or broken line (a killed run) is skipped."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(obj, dict):
                yield obj


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(iter_jsonl(path))


def repair_tail(path: Path) -> None:
    """Cut a partial last line (no newline: the writer was killed mid-line)."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class JsonlWriter:
    """Appends one JSON object per line, flushed at once (a killed run loses at most the line
    being written)."""

    def __init__(self, path: Path) -> None:
        repair_tail(path)
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def write(self, obj: Mapping[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        self._file.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class SentLine:
    """A line of requests.jsonl: one request the job produced (docs/REPLAY.md)."""

    request_id: str
    conversation_id: str = ""
    turn: int | None = None
    source_lang: str = ""
    target_lang: str = ""
    text: str = ""
    reference: str | None = None  # the log's human translation, when it has one
    intent: str | None = None
    sender: str | None = None
    row: str = ""  # where in the log it came from
    scheduled_ms: float = 0.0  # when the schedule said to send it (ms after the run's start)
    sent_ms: float = 0.0  # when produce() was called (the run's clock)
    created_at_ms: int = 0  # the request's created_at (epoch ms)
    topic: str = ""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ReplyLine:
    """A line of replies.jsonl: one reply record the job consumed, duplicates too."""

    request_id: str
    arm: str | None = None  # the A/B arm named by its model_version (None: none)
    model_version: str = ""
    status: str = "ERROR"
    text: str = ""
    error: str | None = None
    received_ms: float = 0.0  # when the job read it (the run's clock)
    created_at_ms: int | None = None  # its request's created_at (epoch ms)
    completed_at_ms: int | None = None  # the worker's completed_at (epoch ms)
    worker_id: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    partition: int | None = None
    offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["metadata"] = dict(self.metadata)
        return out


_Line = TypeVar("_Line", SentLine, ReplyLine)


def _lines(path: Path, cls: type[_Line]) -> list[_Line]:
    names = {f.name for f in fields(cls)}
    out = []
    for obj in iter_jsonl(path):
        try:
            line = cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError:  # no request_id
            continue
        if isinstance(line.request_id, str):
            out.append(line)
    return out


def read_sent(run_dir: Path) -> list[SentLine]:
    """The requests a run produced, in send order."""
    return _lines(run_dir / REQUESTS, SentLine)


def read_replies(run_dir: Path) -> list[ReplyLine]:
    """The replies a run consumed, in the order it read them."""
    return _lines(run_dir / REPLIES, ReplyLine)


def reply_offsets(replies: list[ReplyLine]) -> dict[int, int]:
    """partition -> the next offset to read, from the replies a run already wrote."""
    nxt: dict[int, int] = {}
    for reply in replies:
        if reply.partition is not None and reply.offset is not None:
            nxt[reply.partition] = max(nxt.get(reply.partition, 0), reply.offset + 1)
    return nxt
