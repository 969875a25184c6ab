"""Fit the length guard's caps (`workers/length_caps.json`) on the parallel data in `data/`.

For each model's tokenizer and each language pair, the (source tokens, reference tokens) of
every parallel sentence go to `workers.stages.faithful.rules.fit_length_cap`: the `slope * source +
intercept`
cap with the smallest mean that still covers 99.5 % of the references. The data: FLORES-200
devtest (all 20 directions between en, de, fr, es, it: long, formal sentences), Tatoeba from
line 100 on (en <-> de/fr/es/it both ways: short everyday sentences; lines 0-99 are kept for
`bench/faithful.py`), BConTrasT *train* (de -> en, en -> de chat turns; dev is the benchmark's).
Only tokenizers are loaded (no weights); a run takes well under a minute.

    python -m bench.length_caps [--out workers/length_caps.json] [--coverage 0.995]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench._common import write_json
from replay.datasets import bcontrast, flores, tatoeba_pairs
from workers.stages.faithful.rules import COVERAGE, fit_length_cap

LANGS = ("en", "de", "fr", "es", "it")
BENCH_TATOEBA_LINES = 100  # Tatoeba lines 0-99 belong to bench/faithful.py's test set
TOKENIZERS = {"gemma3": "gemma3-270m", "smollm2": "smollm2-135m"}  # table key -> preset
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "workers" / "length_caps.json"


def parallel_sentences() -> dict[str, list[tuple[str, str]]]:
    """pair ("en-de") -> [(source, reference)] from every fitting source in data/."""
    by_pair: dict[str, list[tuple[str, str]]] = defaultdict(list)
    lines = {lang: flores(lang) for lang in LANGS}
    for src in LANGS:
        for tgt in LANGS:
            if src != tgt:
                by_pair[f"{src}-{tgt}"].extend(zip(lines[src], lines[tgt], strict=True))
    for lang in LANGS[1:]:
        for en, other in tatoeba_pairs(lang)[BENCH_TATOEBA_LINES:]:
            by_pair[f"en-{lang}"].append((en, other))
            by_pair[f"{lang}-en"].append((other, en))
    for u in bcontrast("train"):
        by_pair[f"{u.source_lang}-{u.target_lang}"].append((u.source, u.target))
    return dict(by_pair)


def _tokenizer(preset: str) -> Any:
    from transformers import AutoTokenizer

    from workers.engine.loader import checkpoint_dir

    return AutoTokenizer.from_pretrained(checkpoint_dir(preset))


def fit(coverage: float = COVERAGE) -> dict[str, Any]:
    data = parallel_sentences()
    tables: dict[str, dict[str, Any]] = {}
    for key, preset in TOKENIZERS.items():
        tok = _tokenizer(preset)
        table = {}
        for pair, rows in sorted(data.items()):
            src = tok([s for s, _ in rows], add_special_tokens=False)["input_ids"]
            ref = tok([r for _, r in rows], add_special_tokens=False)["input_ids"]
            counts = [(len(a), len(b)) for a, b in zip(src, ref, strict=True)]
            cap = fit_length_cap(counts, coverage)
            covered = sum(b <= cap.tokens(a) for a, b in counts) / len(counts)
            table[pair] = {
                "slope": cap.slope,
                "intercept": cap.intercept,
                "n": len(counts),
                "covered": round(covered, 4),
            }
        tables[key] = table
    return {
        "_doc": "Length guard caps: ceil(slope * source tokens + intercept) output tokens per "
        "tokenizer and language pair, covering `coverage` of the references of data/ (FLORES "
        "devtest, Tatoeba lines 100+, BConTrasT train). Written by `python -m bench.length_caps`.",
        "coverage": coverage,
        "tokenizers": tables,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--coverage", type=float, default=COVERAGE)
    args = ap.parse_args()
    out = fit(args.coverage)
    write_json(out, args.out)
    print(json.dumps(out["tokenizers"], indent=1)[:2000])


if __name__ == "__main__":
    main()
