"""Speculative decoding measured: does it change a token, how many drafts the target takes, and
what one request's latency becomes (issue #43, Done-when 2 and the acceptance figures).

Each held-out item (`bench.model_quality.held_out_items`: BConTrasT dev turns both ways, FLORES
devtest en<->de/fr/es/it) is translated alone, once by the plain engine and once with drafts
(`--draft ngram`), interleaved item by item on the same loaded model so both see the same
machine. Per item: the two outputs' tokens (they must be equal: greedy decoding is the
target's own either way), the wall time, the engine steps, the drafts checked and accepted.
Per pair and overall: identical outputs, acceptance rate (accepted / checked drafts), tokens per
target step (generated tokens / steps after the prompt's), and P50 / mean latency of both and
their ratio.

    python -m bench.speculative --model qwen2.5-coder-0.5b --bcontrast 25 --flores 12 \\
        --out bench/out/speculative.json

JSON on stdout (and in `--out`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench._common import dump, machine_info, parse_csv, write_json
from bench.model_quality import Item, held_out_items
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_model
from workers.engine.speculative import make_drafter


def run_alone(engine: Engine, item: Item, cap: int) -> dict[str, Any]:
    before = (engine.stats.steps, engine.stats.draft_tokens, engine.stats.accepted_draft_tokens)
    request = engine.translation_request(
        item.source, item.source_lang, item.target_lang, max_new_tokens=cap
    )
    t0 = time.perf_counter()
    (result,) = engine.generate([request])
    seconds = time.perf_counter() - t0
    s = engine.stats
    return {
        "tokens": result.token_ids,
        "seconds": seconds,
        "steps": s.steps - before[0],
        "drafted": s.draft_tokens - before[1],
        "accepted": s.accepted_draft_tokens - before[2],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    plain = [r["plain"] for r in rows]
    spec = [r["draft"] for r in rows]
    drafted = sum(r["drafted"] for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    generated = sum(len(r["tokens"]) for r in spec)
    # the first step of a request computes its prompt and samples its first token
    decode_steps = sum(r["steps"] - 1 for r in spec)
    p50_plain = statistics.median(r["seconds"] for r in plain)
    p50_spec = statistics.median(r["seconds"] for r in spec)
    return {
        "n": len(rows),
        "identical": sum(p["tokens"] == s["tokens"] for p, s in zip(plain, spec, strict=True)),
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_step": round((generated - len(rows)) / decode_steps, 3)
        if decode_steps
        else None,
        "p50_s": {"plain": round(p50_plain, 4), "draft": round(p50_spec, 4)},
        "p50_ratio": round(p50_spec / p50_plain, 3),
        "mean_ratio": round(
            statistics.fmean(r["seconds"] for r in spec)
            / statistics.fmean(r["seconds"] for r in plain),
            3,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft", default="ngram")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--quantize", default="int8", help="int8, int4, or none (float32)")
    ap.add_argument(
        "--compile-decode", action=argparse.BooleanOptionalAction, default=True,
        help="decode steps and draft checks through the compiled graph (the worker's usual)",
    )  # fmt: skip
    ap.add_argument("--bcontrast", type=int, default=25, help="BConTrasT turns per direction")
    ap.add_argument("--flores", type=int, default=12, help="FLORES sentences per pair")
    ap.add_argument("--pairs", type=parse_csv, default=[], help="only these, e.g. de-en,en-de")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    items = [
        i
        for i in held_out_items(args.bcontrast, args.flores)
        if not args.pairs or i.pair in args.pairs
    ]
    loaded = load_model(args.model)
    config = EngineConfig(
        model=args.model, quantize=quantize, kv_cache_tokens=4096,
        compile_decode=args.compile_decode,
    )  # fmt: skip
    plain = Engine(loaded, config)
    spec = Engine(loaded, config)  # the same prepared model, its own KV pools
    max_rows = config.compile_max_rows if args.compile_decode else None  # as the engine sets
    spec.drafter = make_drafter(args.draft, args.draft_max, config.max_model_len, max_rows)
    for engine in (plain, spec):
        engine.warm(sorted({i.target_lang for i in items}))
    rows: list[dict[str, Any]] = []
    for item in items:  # interleaved: both engines see the machine's same minute
        rows.append(
            {
                "pair": f"{item.subset}:{item.pair}",
                "plain": run_alone(plain, item, args.max_new_tokens),
                "draft": run_alone(spec, item, args.max_new_tokens),
            }
        )
    by_pair: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_pair.setdefault(row["pair"], []).append(row)
    result = {
        "bench": "speculative",
        "machine": machine_info(args.threads),
        "model": args.model,
        "quantize": args.quantize,
        "draft": args.draft,
        "draft_max": args.draft_max,
        "compile_decode": args.compile_decode,
        "overall": summarize(rows),
        "pairs": {pair: summarize(group) for pair, group in sorted(by_pair.items())},
        "different": [
            {"pair": r["pair"], "plain": r["plain"]["tokens"], "draft": r["draft"]["tokens"]}
            for r in rows
            if r["plain"]["tokens"] != r["draft"]["tokens"]
        ],
    }
    write_json(result, args.out)
    print(dump(result), flush=True)


if __name__ == "__main__":
    main()
