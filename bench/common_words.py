"""Build the name check's common-word lists (`workers/stages/faithful/common_words.json`).

`workers/stages/faithful/names.py` calls a capitalised source word a name only when it is not a
common word of the source language. The lists come from the training sides of the parallel data
in data/ (never BConTrasT dev nor FLORES-200, on which the check is measured):

- BConTrasT train (`data/bcontrast_wmt20_chat/train.json`): agents' English turns with their
  German translations, customers' German turns with their English ones;
- Tatoeba (`data/tatoeba_laser`): 1,000 pairs each of German, French, Italian, Spanish with
  English.

Per language, every word seen in its text (casefolded) is listed, less the **names**: words
seen capitalised inside a sentence (not at its start) in at least `MIN_SEEN` sentences and
copied, capitalised, into the aligned translation (accents folded) in at least `COPIED_SHARE`
of them ("Tom", "Berlin", "Starbucks"; not German "Moment", which English writes "moment");
a capitalised word the translations translate ("Abend" -> "evening", "Monday" -> "Montag")
stays. Deterministic: the same data gives the same file.

    python -m bench.common_words            # writes the JSON, prints the list sizes
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from workers.stages.faithful.names import MIN_NAME_CHARS, fold, is_sentence_start, words

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
OUT = ROOT / "workers" / "stages" / "faithful" / "common_words.json"
MIN_SEEN = 1  # sentences with the word capitalised mid-sentence, for a name call
COPIED_SHARE = 0.5  # ... of which its translation copied it at least this share
TATOEBA = {"de": "deu", "fr": "fra", "it": "ita", "es": "spa"}


def pairs() -> Iterator[tuple[str, str, str]]:
    """(language of the text, text, its translation) over the training data, both ways."""
    train = json.loads((DATA / "bcontrast_wmt20_chat" / "train.json").read_text("utf-8"))
    for turns in train.values():
        for turn in turns:
            src_lang = "en" if turn["speaker"] == "agent" else "de"
            tgt_lang = "de" if src_lang == "en" else "en"
            yield src_lang, turn["source"], turn["target"]
            yield tgt_lang, turn["target"], turn["source"]
    for lang, code in TATOEBA.items():
        base = DATA / "tatoeba_laser" / f"tatoeba.{code}-eng"
        other = Path(f"{base}.{code}").read_text("utf-8").splitlines()
        english = Path(f"{base}.eng").read_text("utf-8").splitlines()
        for a, b in zip(other, english, strict=True):
            yield lang, a, b
            yield "en", b, a


def build() -> dict[str, list[str]]:
    seen: dict[str, Counter[str]] = {}
    capitalised: dict[str, Counter[str]] = {}
    copied: dict[str, Counter[str]] = {}
    for lang, text, translation in pairs():
        vocab = seen.setdefault(lang, Counter())
        caps = capitalised.setdefault(lang, Counter())
        kept = copied.setdefault(lang, Counter())
        capitalised_there = {fold(w) for _, w in words(translation) if w[0].isupper()}
        for offset, word in sorted(set(words(text))):
            vocab[word.casefold()] += 1
            if (
                len(word) >= MIN_NAME_CHARS
                and word[0].isupper()
                and not word.isupper()
                and not is_sentence_start(text, offset)
            ):
                caps[word.casefold()] += 1
                kept[word.casefold()] += fold(word) in capitalised_there
    lists = {}
    for lang, vocab in seen.items():
        names = {
            w
            for w, n in capitalised[lang].items()
            if n >= MIN_SEEN and copied[lang][w] >= COPIED_SHARE * n
        }
        lists[lang] = sorted(w for w in vocab if w not in names)
    return dict(sorted(lists.items()))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    lists = build()
    doc = {
        "made_by": "python -m bench.common_words",
        "sources": ["data/bcontrast_wmt20_chat/train.json", "data/tatoeba_laser (de/fr/it/es-en)"],
        "license": "derived from CC-BY-SA 4.0 (BConTrasT) and CC-BY 2.0 FR (Tatoeba) text",
        "languages": lists,
    }
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", "utf-8")
    print(json.dumps({lang: len(ws) for lang, ws in lists.items()}))


if __name__ == "__main__":
    main()
