"""Translation quality: chrF of tolk's output against human references (sacrebleu).

Compares engine variants on the same sentences in one run, e.g. float32 vs the weight-only
int8 swap (the engine issue allows int8 for batch-1 speed if it stays within 1 chrF point of
float32 on 200 Tatoeba sentences).

    python -m bench.quality --model smollm2-135m --n 200 --variants float32,int8 [--pairs en-de]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from bench._common import machine_info
from replay.datasets import tatoeba_pairs
from workers.engine.engine import Engine, EngineConfig


def sentence_pairs(pair: str, n: int) -> list[tuple[str, str, str, str]]:
    """(source text, src lang, tgt lang, reference) from Tatoeba, first n of the pair."""
    src, tgt = pair.split("-")
    other = tgt if src == "en" else src
    rows = tatoeba_pairs(other)[:n]
    if src == "en":
        return [(en, "en", tgt, ref) for en, ref in rows]
    return [(text, src, "en", en) for en, text in rows]


def translate_all(engine: Engine, items: list[tuple[str, str, str, str]]) -> list[str]:
    reqs = [engine.translation_request(t, s, g, max_new_tokens=64) for t, s, g, _ in items]
    return [r.text for r in engine.generate(reqs)]


def run(model: str, n: int, variants: list[str], pairs: list[str], threads: int) -> dict[str, Any]:
    import sacrebleu

    torch.set_num_threads(threads)
    out: dict[str, Any] = {"model": model, "n": n, "pairs": pairs, "variants": {}}
    for variant in variants:
        quant = None if variant == "float32" else variant
        engine = Engine.from_config(EngineConfig(model=model, quantize=quant))
        per_pair = {}
        t0 = time.perf_counter()
        for pair in pairs:
            items = sentence_pairs(pair, n)
            hyps = translate_all(engine, items)
            refs = [ref for *_, ref in items]
            per_pair[pair] = {
                "chrF": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
                "BLEU": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                "sample": [(items[i][0], hyps[i]) for i in range(3)],
            }
        seconds = round(time.perf_counter() - t0, 1)
        out["variants"][variant] = {"pairs": per_pair, "seconds": seconds}
    if "float32" in variants:
        base = out["variants"]["float32"]["pairs"]
        for variant in variants:
            if variant != "float32":
                out["variants"][variant]["chrF_delta_vs_float32"] = {
                    p: round(out["variants"][variant]["pairs"][p]["chrF"] - base[p]["chrF"], 2)
                    for p in pairs
                }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--variants", default="float32,int8")
    ap.add_argument("--pairs", default="en-de")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    result = run(a.model, a.n, a.variants.split(","), a.pairs.split(","), a.threads)
    result["machine"] = machine_info(a.threads)  # the CPU the figures belong to
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
