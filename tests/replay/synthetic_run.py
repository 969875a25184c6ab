"""Builds small replay run directories in the format of docs/REPLAY.md for the report tests.

Requests are real BConTrasT dev turns (both directions) with their references; each arm's
replies are made by a function of the request (a perfect copy of the reference, words
dropped, ...) with a latency chosen by the test, so every expected number is known.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from replay.datasets import bcontrast

Reply = dict[str, Any]


def bcontrast_requests(n: int, gap_ms: float = 50.0) -> list[dict[str, Any]]:
    """The first n BConTrasT dev turns as requests.jsonl rows (sent every gap_ms)."""
    rows = []
    for i, u in enumerate(list(bcontrast("dev"))[:n]):
        rows.append(
            {
                "request_id": f"r{i:04d}",
                "conversation_id": u.conversation_id,
                "turn": u.turn,
                "source_lang": u.source_lang,
                "target_lang": u.target_lang,
                "text": u.source,
                "reference": u.target,
                "intent": None,
                "scheduled_ms": i * gap_ms,
                "sent_ms": i * gap_ms + 0.5,
                "created_at_ms": 1_700_000_000_000 + int(i * gap_ms),
            }
        )
    return rows


def drop_words(text: str, share: float, seed: int) -> str:
    """text without a seeded random share of its words (a worse translation)."""
    rng = random.Random(seed)
    kept = [w for w in text.split() if rng.random() >= share]
    return " ".join(kept) if kept else text.split()[0]


def reply(
    req: Mapping[str, Any], arm: str, text: str, latency_ms: float, status: str = "OK"
) -> Reply:
    received = float(req["sent_ms"]) + latency_ms
    return {
        "request_id": req["request_id"],
        "arm": arm,
        "model_version": f"fake-1@{arm}",
        "status": status,
        "text": text if status == "OK" else "",
        "error": None if status == "OK" else "synthetic failure",
        "received_ms": received,
        "created_at_ms": req["created_at_ms"],
        "completed_at_ms": int(req["created_at_ms"] + latency_ms),
        "worker_id": f"w-{arm}",
        "metadata": {},
    }


def arm_replies(
    requests: Iterable[Mapping[str, Any]],
    arm: str,
    text: Callable[[Mapping[str, Any]], str],
    latency: Callable[[Mapping[str, Any]], float],
) -> list[Reply]:
    return [reply(req, arm, text(req), latency(req)) for req in requests]


def write_run(
    root: Path,
    requests: list[dict[str, Any]],
    replies: list[Reply],
    arms: list[str],
    **run_fields: Any,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    run = {
        "run_id": "synthetic",
        "created_at_ms": 1_700_000_000_000,
        "arms": arms,
        "reply_topic": "tolk.replay.synthetic",
        "languages": sorted({r["target_lang"] for r in requests}),
        "log": {"path": "data/bcontrast_wmt20_chat/dev.json", "format": "bcontrast"},
        "pacing": {"speed": None, "rate": 20.0},
        "limit": len(requests),
        "seed": 0,
        "wait_s": 1,
        "finished": True,
        "tolk_commit": None,
        "cpu_model": "synthetic",
        **run_fields,
    }
    (root / "run.json").write_text(json.dumps(run), encoding="utf-8")
    for name, rows in (("requests", requests), ("replies", replies)):
        with (root / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (root / "problems.jsonl").write_text(
        json.dumps({"row": "dev.json:1", "reason": "unknown language 'xx'"}) + "\n",
        encoding="utf-8",
    )
    return root
