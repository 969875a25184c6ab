"""Which model translates better: chrF per language pair, each model against a baseline model on
the same sentences, with paired-bootstrap 95 % intervals (issue #43, Done-when 1).

Test sets (held out: no example of the prompt set comes from them):
- `bcontrast`: BConTrasT dev (real customer-service chats), the first `--bcontrast` customer
  turns (de->en) and as many agent turns (en->de), in conversation order;
- `flores`: FLORES-200 devtest, the first `--flores` sentences of each pair among
  en<->de, en<->fr, en<->es, en<->it.

Each model runs through tolk's own engine with its preset's default prompt form (Gemma 3's
few-shot form, Qwen's "keep" ChatML form) and one weight format for all (`--quantize`, int8 by
default: what the worker serves after its probe; each format's chrF against float32 is the
quality gate's, workers/engine/quality_gate.json), greedy, `--max-new-tokens` at most. Per
(model, set, pair): chrF (sacrebleu's, from summed statistics) and, for every model but the
baseline, chrF minus the baseline's with its paired-bootstrap interval (`replay.stats`), so a
gain is counted only where the interval clears 0.

    python -m bench.model_quality --models gemma3-270m,qwen2.5-coder-1.5b \\
        --bcontrast 200 --flores 100 --out bench/out/model_quality.json

JSON on stdout (and in `--out`), with three sample translations per pair and the machine.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench._common import dump, machine_info, parse_csv, write_json
from replay.datasets import bcontrast, flores
from replay.quality import chrf_statistics
from replay.stats import chrf_from_sums, paired_bootstrap
from workers.engine.engine import Engine, EngineConfig

FLORES_PAIRS = (
    ("en", "de"), ("de", "en"), ("en", "fr"), ("fr", "en"),
    ("en", "es"), ("es", "en"), ("en", "it"), ("it", "en"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Item:
    subset: str  # "bcontrast" | "flores"
    source_lang: str
    target_lang: str
    source: str
    reference: str

    @property
    def pair(self) -> str:
        return f"{self.source_lang}-{self.target_lang}"


def held_out_items(n_bcontrast: int, n_flores: int) -> list[Item]:
    """The sets above, in a fixed order (the same items for every model)."""
    items: list[Item] = []
    taken = {"de": 0, "en": 0}
    for u in bcontrast("dev"):
        if taken[u.source_lang] < n_bcontrast and u.source.strip():
            taken[u.source_lang] += 1
            items.append(Item("bcontrast", u.source_lang, u.target_lang, u.source, u.target))
    for src, tgt in FLORES_PAIRS:
        pairs = zip(flores(src)[:n_flores], flores(tgt)[:n_flores], strict=True)
        items += [Item("flores", src, tgt, s, r) for s, r in pairs]
    return items


def translate(model: str, items: list[Item], quantize: str | None, cap: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = Engine.from_config(EngineConfig(model=model, quantize=quantize))
    loaded = time.perf_counter()
    requests = [
        engine.translation_request(i.source, i.source_lang, i.target_lang, max_new_tokens=cap)
        for i in items
    ]
    results = engine.generate(requests)
    done = time.perf_counter()
    form = engine.prompts.default_form if engine.prompts is not None else ""
    del engine  # its KV pools and weights go before the next model loads
    return {
        "texts": [r.text for r in results],
        "tokens": sum(len(r.token_ids) for r in results),
        "form": form,
        "load_s": round(loaded - t0, 1),
        "translate_s": round(done - loaded, 1),
    }


def compare(
    items: list[Item], texts: dict[str, list[str]], baseline: str
) -> dict[str, dict[str, Any]]:
    """Per (set, pair): each model's chrF, and its paired difference to the baseline."""
    groups: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(f"{item.subset}:{item.pair}", []).append(index)
    out: dict[str, dict[str, Any]] = {}
    for key, indices in groups.items():
        refs = [items[i].reference for i in indices]
        stats = {m: chrf_statistics([t[i] for i in indices], refs) for m, t in texts.items()}
        row: dict[str, Any] = {"n": len(indices)}
        for model, s in stats.items():
            row[model] = {"chrF": round(float(chrf_from_sums(s.sum(axis=0)[None, :])[0]), 2)}
            if model != baseline:
                diff = paired_bootstrap(stats[baseline], s, chrf_from_sums)
                row[model]["minus_baseline"] = [
                    round(diff.estimate, 2), round(diff.low, 2), round(diff.high, 2)
                ]  # fmt: skip
        first = indices[0]
        row["sample"] = {"source": items[first].source, **{m: t[first] for m, t in texts.items()}}
        out[key] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", type=parse_csv, default=["gemma3-270m", "qwen2.5-coder-1.5b"])
    ap.add_argument("--baseline", default=None, help="default: the first of --models")
    ap.add_argument("--bcontrast", type=int, default=200, help="BConTrasT turns per direction")
    ap.add_argument("--flores", type=int, default=100, help="FLORES sentences per pair")
    ap.add_argument("--quantize", default="int8", help="int8, int4, or none (float32)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    baseline = args.baseline or args.models[0]
    quantize = None if args.quantize == "none" else args.quantize
    items = held_out_items(args.bcontrast, args.flores)
    runs = {m: translate(m, items, quantize, args.max_new_tokens) for m in args.models}
    texts = {m: run["texts"] for m, run in runs.items()}
    result = {
        "bench": "model_quality",
        "machine": machine_info(args.threads),
        "baseline": baseline,
        "quantize": args.quantize,
        "items": len(items),
        "runs": {m: {k: v for k, v in run.items() if k != "texts"} for m, run in runs.items()},
        "pairs": compare(items, texts, baseline),
        "outputs": {m: list(t) for m, t in texts.items()},
        "mean_chars": {m: float(np.mean([len(t) for t in ts])) for m, ts in texts.items()},
    }
    write_json(result, args.out)
    print(dump({k: v for k, v in result.items() if k != "outputs"}), flush=True)


if __name__ == "__main__":
    main()
