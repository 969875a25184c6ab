"""What every system of `bench/engine.py` reports the same way: its rows, metrics and repeats.

`bench/engine.py` (tolk, transformers) and `bench/engine_llamacpp.py` (llama.cpp) both build
their result rows with these, so that neither imports the other's helpers (the parent module
runs the llama.cpp worker, which used to import the parent back). The metrics are those of
`bench/engine.py`'s notes: prefill, decode (the decode-only phase), the old decode window and
aggregate tokens/s from a batch's TTFT, total and decode times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from bench._common import JSON, summarize

METRICS = (
    "ttft_s",
    "total_s",
    "prefill_tok_s",
    "decode_tok_s",
    "decode_tok_s_window",
    "aggregate_tok_s",
)


def gguf_path(model: str) -> Path:
    from workers.engine.loader import resolve_source

    return resolve_source(model)[1]


def prompt_stats(ids: Sequence[Sequence[int]]) -> JSON:
    lens = [len(x) for x in ids]
    return {"total": sum(lens), "min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)}


# -- measurement --------------------------------------------------------------------------------
def run_metrics(
    batch: int,
    prompt_tokens: int,
    ttft: float,
    total: float,
    new: int,
    *,
    decode_s: float,
    decode_tokens: int | None = None,
) -> JSON:
    """`decode_s`: the time of the decode phase (every sequence decoding), in which
    `decode_tokens` (default B * (new - 1)) tokens were made."""
    decode_tokens = batch * (new - 1) if decode_tokens is None else decode_tokens
    return {
        "ttft_s": ttft,
        "total_s": total,
        "prefill_tok_s": prompt_tokens / max(ttft, 1e-9),
        "decode_tok_s": decode_tokens / max(decode_s, 1e-9),
        "decode_tok_s_window": batch * (new - 1) / max(total - ttft, 1e-9),
        "aggregate_tok_s": batch * new / max(total, 1e-9),
    }


def measure(once: Callable[[], JSON], repeats: int) -> JSON:
    """One warm-up call, then `repeats` timed ones; medians per metric (raw values kept)."""
    once()
    runs = [once() for _ in range(repeats)]
    out: JSON = {k: summarize([r[k] for r in runs]) for k in METRICS}
    for k, v in runs[-1].items():  # non-metric facts of the last run (tokens, cache hits)
        if k not in METRICS:
            out[k] = v
    return out


def row(system: str, model: str, dtype: str, batch: int, ids: Sequence[Sequence[int]]) -> JSON:
    return {
        "system": system,
        "model": model,
        "dtype": dtype,
        "batch": batch,
        "prompt_tokens": prompt_stats(ids),
    }
