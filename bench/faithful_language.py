"""The language check's false alarms and catches on human translations (issue #28).

    python -m bench.faithful_language [--tatoeba 300] [--out bench/out/faithful_language.json]

`workers/text/language.py` withholds (or retries) an answer it calls "untranslated"
or "wrong_language", so a call on a good translation costs a customer an answer. This measures,
per language pair, on the parallel data in `data/` (BConTrasT train + dev: real support chat
turns, en<->de; a seeded sample of `--tatoeba` Tatoeba pairs per en<->de/fr/it/es direction):

- `false_alarms`: human references, taken as the answers, that the check calls (any call is
  wrong: they are in the target language);
- `untranslated_caught`: each source passed off as its own translation, called "untranslated";
  `too_short`: of those, how many had too few letters to call at all.

JSON on stdout (and `--out`). No model, no services; lingua's models ship in its wheel.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import JSON, dump, machine_info, write_json

REPO = Path(__file__).resolve().parents[1]
TATOEBA = (("deu", "de"), ("fra", "fr"), ("ita", "it"), ("spa", "es"))


def pairs(tatoeba: int, seed: int = 0) -> list[tuple[str, str, str, str, str]]:
    """(corpus, source lang, target lang, source, reference)."""
    out = []
    for split in ("train", "dev"):
        dialogues = json.loads((REPO / f"data/bcontrast_wmt20_chat/{split}.json").read_text())
        for turns in dialogues.values():
            for t in turns:
                src, tgt = ("de", "en") if t["speaker"] == "customer" else ("en", "de")
                out.append(("bcontrast", src, tgt, t["source"], t["target"]))
    rng = random.Random(seed)
    for name, code in TATOEBA:
        base = REPO / "data/tatoeba_laser" / f"tatoeba.{name}-eng"
        eng = Path(f"{base}.eng").read_text(encoding="utf-8").splitlines()
        other = Path(f"{base}.{name}").read_text(encoding="utf-8").splitlines()
        for en, xx in rng.sample(list(zip(eng, other, strict=True)), min(tatoeba, len(eng))):
            out.append(("tatoeba", "en", code, en, xx))
            out.append(("tatoeba", code, "en", xx, en))
    return out


def measure(rows: Sequence[tuple[str, str, str, str, str]]) -> dict[str, Any]:
    from workers.text.language import MIN_LETTERS, language_problem, scored_text

    per: dict[str, dict[str, Any]] = {}
    for corpus, src, tgt, source, reference in rows:
        p = per.setdefault(
            f"{corpus} {src}-{tgt}",
            {"n": 0, "false_alarms": 0, "untranslated_caught": 0, "too_short": 0, "examples": []},
        )
        p["n"] += 1
        called = language_problem(reference, src, tgt, source=source)
        if called is not None:
            p["false_alarms"] += 1
            if len(p["examples"]) < 5:
                p["examples"].append({"reference": reference, "called": called})
        if language_problem(source, src, tgt, source=source) == "untranslated":
            p["untranslated_caught"] += 1
        elif sum(ch.isalpha() for ch in scored_text(source, source)) < MIN_LETTERS:
            p["too_short"] += 1
    for p in per.values():
        p["false_alarm_rate"] = round(p["false_alarms"] / p["n"], 5)
        p["caught_rate"] = round(p["untranslated_caught"] / p["n"], 4)
    return per


def main(argv: Sequence[str] | None = None) -> JSON:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tatoeba", type=int, default=300, help="pairs per Tatoeba direction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from workers.text import language

    rows = pairs(args.tatoeba, args.seed)
    per = measure(rows)
    n = sum(p["n"] for p in per.values())
    result: JSON = {
        "benchmark": "faithful_language",
        "machine": machine_info(),
        "thresholds": {
            "min_letters": language.MIN_LETTERS,
            "lead_confidence": language.LEAD_CONFIDENCE,
            "lead_ratio": language.LEAD_RATIO,
        },
        "pairs": per,
        "all": {
            "n": n,
            "false_alarms": sum(p["false_alarms"] for p in per.values()),
            "untranslated_caught": sum(p["untranslated_caught"] for p in per.values()),
            "too_short": sum(p["too_short"] for p in per.values()),
        },
    }
    write_json(result, args.out)
    print(dump(result))
    return result


if __name__ == "__main__":
    main()
