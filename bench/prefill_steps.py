"""Warm prefill steps, eager against the compiled graph's rows (issue #25's prefill share).

A request at low load pays one prefill of its query (the language's few-shot prefix is in the
prefix cache) and then its decode steps. `EngineConfig.compile_max_rows` runs prefill and mixed
steps of up to that many tokens through the compiled decode graph, one row per token
(`workers/engine/compiled.py`); 0 keeps them eager. This benchmark builds one engine per value
in one process (each warms the target language), then sends each query to both, alternating
which goes first: support texts (`workers/loadtest/texts.py`, English into German), one request
at a time with one new token, queries of one, two and four texts joined (about 15, 30 and 55
tokens). It prints the prefill time per request as JSON: per setting and length the values and
the median, and the ratio compiled / eager of the medians. A query is never sent twice to one
engine, so none hits the prefix cache beyond the language's shared prefix.

    python -m bench.prefill_steps --model gemma3-270m --quantize int8 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from bench._common import JSON, machine_info

JOINS = (1, 2, 4)  # texts per query
SETTINGS = (("eager", 0), ("compiled_rows", 64))  # label, compile_max_rows


def _prefill_ms(engine: Any, text: str) -> tuple[float, int]:
    """One request of one new token: (its prefill steps' milliseconds, their tokens)."""
    engine.step_trace = []
    engine.submit(engine.translation_request(text, "en", "de", max_new_tokens=1))
    engine.run_until_done()
    steps = [s for s in engine.step_trace if s.kind == "prefill"]
    engine.step_trace = None
    return 1000 * sum(s.seconds for s in steps), sum(s.num_tokens for s in steps)


def run(args: argparse.Namespace) -> JSON:
    import torch

    from workers.engine.engine import Engine, EngineConfig
    from workers.loadtest.texts import support_mix

    torch.set_num_threads(args.threads)
    texts = [t.text for t in support_mix("de", seed=args.seed) if t.source_lang == "en"]
    if len(texts) < args.repeats * sum(JOINS):
        raise SystemExit(f"{len(texts)} texts, {args.repeats * sum(JOINS)} needed: lower --repeats")
    engines = {
        label: Engine.from_config(
            EngineConfig(
                model=args.model,
                quantize=args.quantize,
                compile_decode=True,
                compile_max_rows=rows,
                warm_languages=("de",),
            )
        )
        for label, rows in SETTINGS
    }
    ms: dict[str, dict[int, list[float]]] = {label: {j: [] for j in JOINS} for label in engines}
    tokens: dict[int, list[int]] = {j: [] for j in JOINS}
    at = 0
    for join in JOINS:
        for rep in range(args.repeats):
            text = " ".join(texts[at : at + join])
            at += join
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for label in order:  # the same query on both, alternating which goes first
                took, n = _prefill_ms(engines[label], text)
                ms[label][join].append(round(took, 1))
            tokens[join].append(n)
    medians = {
        label: {j: round(statistics.median(v), 1) for j, v in by_join.items()}
        for label, by_join in ms.items()
    }
    return {
        "bench": "prefill_steps",
        "command": "python -m bench.prefill_steps " + " ".join(args.argv),
        "machine": machine_info(args.threads),
        "settings": {"model": args.model, "quantize": args.quantize, "repeats": args.repeats},
        "query_tokens": {str(j): v for j, v in tokens.items()},
        "prefill_ms": {label: {str(j): v for j, v in d.items()} for label, d in ms.items()},
        "prefill_ms_median": {
            label: {str(j): v for j, v in d.items()} for label, d in medians.items()
        },
        "ratio_compiled_over_eager": {
            str(j): round(medians["compiled_rows"][j] / medians["eager"][j], 3) for j in JOINS
        },
    }


def main(argv: Sequence[str] | None = None) -> JSON:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--quantize", default="int8", choices=("int8", "int4", "none"))
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else []
    if args.quantize == "none":
        args.quantize = None
    result = run(args)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
