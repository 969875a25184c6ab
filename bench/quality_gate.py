"""The auto configuration's quality gate, recorded once per model and weight format.

`tolk worker` picks the fastest configuration whose weight format stays within 1.0 chrF of
float32 (`workers/engine/autoconfig.py`); it never measures quality at start-up: it reads
`workers/engine/quality_gate.json`, which this script writes. For each model it translates a
fixed dev slice (the first `--n` Tatoeba pairs of data/tatoeba_laser, en->de and de->en, greedy,
64 new tokens at most) with each format, scores chrF against the human references (sacrebleu)
and records each format's chrF and its delta to float32 per direction; a format that cannot run
is recorded with its error (it then fails the gate). Eager decode only: compiled decode computes
the same function up to float rounding (tests/engine/test_compiled.py), so the gate is per
format, not per compile flag.

    python -m bench.quality_gate --models gemma3-270m,smollm2-135m \
        --formats float32,bfloat16,int8,int4

The slice is 200 pairs per direction (it was 50 until 2026-12-03: at 50 the deltas moved by
about a point between formats that compute nearly the same thing, e.g. SmolLM2 int4 at -1.13 in
de-en with bit-exact weights, +0.07 at 200). Existing entries of other models and formats are
kept (the file is merged, not overwritten).
`--reuse-reference` takes float32's recorded chrF (same slice) instead of translating it again:
greedy float32 decoding is the same on every CPU up to float rounding, and it is the slowest
format to run (Gemma 3 270M, 200 pairs: 61 s on a quiet 2-vCPU Xeon, ~30 min for 50 pairs on a
crowded one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import machine_info
from bench.quality import sentence_pairs, translate_all
from workers.engine.autoconfig import GATE_CHRF, GATE_FILE, Candidate
from workers.engine.engine import Engine, EngineConfig

PAIRS = ("en-de", "de-en")


def score_format(model: str, weights: str, n: int) -> dict[str, Any]:
    """chrF per direction of one model in one weight format (or the error that stopped it)."""
    import sacrebleu

    candidate = Candidate(weights, compile_decode=False)
    t0 = time.perf_counter()
    try:
        engine = Engine.from_config(
            EngineConfig(model=model, dtype=candidate.dtype, quantize=candidate.quantize)
        )
        chrf = {}
        for pair in PAIRS:
            items = sentence_pairs(pair, n)
            hyps = translate_all(engine, items)
            chrf[pair] = round(sacrebleu.corpus_chrf(hyps, [[r for *_, r in items]]).score, 2)
    except (ImportError, NotImplementedError, RuntimeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"chrf": chrf, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gemma3-270m,smollm2-135m")
    ap.add_argument("--formats", default="float32,bfloat16,int8")
    ap.add_argument("--n", type=int, default=200, help="sentences per direction")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=GATE_FILE)
    ap.add_argument(
        "--reuse-reference",
        action="store_true",
        help="use float32's recorded chrF for this slice instead of running it again",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    table["max_chrf_drop"] = GATE_CHRF
    slice_text = f"data/tatoeba_laser, first {args.n} pairs, {', '.join(PAIRS)}"
    same_slice = table.get("slice", "").startswith(slice_text)
    if not same_slice:
        table["slice"] = slice_text
    table["made_by"] = "python -m bench.quality_gate"
    models = table.setdefault("models", {})
    formats = args.formats.split(",")
    formats = ["float32"] + [f for f in formats if f != "float32"]  # the reference first
    for model in args.models.split(","):
        entry = models.setdefault(model, {})
        reference = None
        for weights in formats:  # float32 first: the reference
            recorded = entry.get("float32", {})
            reusable = (
                args.reuse_reference
                and same_slice
                and set(PAIRS) <= set(recorded.get("chrf", {}))
                and "source" not in recorded
            )
            if weights == "float32" and reusable:
                reference = recorded["chrf"]
                print(model, "float32 (recorded)", json.dumps(recorded), flush=True)
                continue
            result = score_format(model, weights, args.n)
            if weights == "float32":
                reference = result.get("chrf")
            elif reference and "chrf" in result:
                result["delta_chrf"] = {
                    p: round(result["chrf"][p] - reference[p], 2) for p in PAIRS
                }
            result["date"] = datetime.date.today().isoformat()
            info = machine_info()
            result["machine"] = f"{info['cpu_model']}, load {info['loadavg']}"
            entry[weights] = result
            print(model, weights, json.dumps(result), flush=True)
            # after each format: a long run stopped midway keeps what it measured
            args.out.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
