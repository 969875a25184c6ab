"""Readers for the public data sets in the repository's `data/` (their own formats, no
hand-edited copies).

- `tatoeba_laser/tatoeba.<xxx>-eng.<xxx|eng>`: line-aligned short sentence pairs;
- `flores200_devtest/<xxx>.devtest`: the same 1,012 sentences in five languages;
- `bcontrast_wmt20_chat/{train,dev}.json`: customer (de) / agent (en) dialogues with targets;
- `xsid/<lang>.valid.conll`: voice-assistant commands (`# text = ...` lines).

Used by the benchmarks and the tests (there is no replay worker yet: `replay/` is these
readers). One lookup decides where the data lives, `data_dir()`:
`$TOLK_DATA_DIR` if set, else `data/` at the top of the checkout, found relative to this file
(an installed wheel has no `data/`; set the variable there). There is no fallback: a missing
directory or file raises `DataNotFoundError` naming the path and the variable, so a test or a
benchmark never runs hollow on built-in sentences.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ISO3 = {"en": "eng", "de": "deu", "fr": "fra", "es": "spa", "it": "ita"}
DATA_DIR_ENV = "TOLK_DATA_DIR"
# replay/datasets.py -> the checkout's top level -> data/
REPO_DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class DataNotFoundError(FileNotFoundError):
    """A data set directory or file is missing (the message says which and how to point at it)."""


@dataclass(frozen=True, slots=True)
class Utterance:
    conversation_id: str
    turn: int
    speaker: str  # "customer" (writes German) or "agent" (writes English)
    source_lang: str
    target_lang: str
    source: str
    target: str  # the human reference translation


def data_dir() -> Path:
    """The data root: `$TOLK_DATA_DIR` if set, else the checkout's `data/`. Read on each call
    (never at import), so a test or a benchmark may set the variable first."""
    env = os.environ.get(DATA_DIR_ENV)
    root = Path(env) if env else REPO_DATA_DIR
    if not root.is_dir():
        origin = f"${DATA_DIR_ENV}" if env else f"the checkout's data/ (${DATA_DIR_ENV} is unset)"
        raise DataNotFoundError(
            f"data directory {root} not found ({origin}); set {DATA_DIR_ENV} to a copy of the "
            "repository's data/ directory"
        )
    return root


def data_file(relative: str | Path, root: Path | None = None) -> Path:
    """`root / relative` (root defaults to `data_dir()`), which must exist."""
    base = root or data_dir()
    path = base / relative
    if not path.is_file():
        raise DataNotFoundError(
            f"data file {path} not found (data directory {base}, set by ${DATA_DIR_ENV} or the "
            "checkout's data/)"
        )
    return path


def _lines(path: Path) -> list[str]:
    return [line.rstrip("\n") for line in path.open(encoding="utf-8")]


def tatoeba_pairs(lang: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(english, other) pairs for lang in de/fr/es/it."""
    code = ISO3[lang]
    eng = _lines(data_file(f"tatoeba_laser/tatoeba.{code}-eng.eng", root))
    other = _lines(data_file(f"tatoeba_laser/tatoeba.{code}-eng.{code}", root))
    return list(zip(eng, other, strict=True))


def flores(lang: str, root: Path | None = None) -> list[str]:
    return _lines(data_file(f"flores200_devtest/{ISO3[lang]}.devtest", root))


def xsid_texts(lang: str, root: Path | None = None) -> list[str]:
    path = data_file(f"xsid/{lang}.valid.conll", root)
    return [
        line.split("=", 1)[1].strip()
        for line in path.open(encoding="utf-8")
        if line.startswith("# text =") or line.startswith("# text=")
    ]


def bcontrast(split: str = "dev", root: Path | None = None) -> Iterator[Utterance]:
    """Utterances in conversation order; customers write German, agents English."""
    path = data_file(f"bcontrast_wmt20_chat/{split}.json", root)
    with path.open(encoding="utf-8") as f:
        dialogues: dict[str, list[dict[str, object]]] = json.load(f)
    for conv_id, turns in dialogues.items():
        for t in turns:
            customer = t["speaker"] == "customer"
            yield Utterance(
                conversation_id=conv_id,
                turn=int(str(t["utteranceID"])),
                speaker=str(t["speaker"]),
                source_lang="de" if customer else "en",
                target_lang="en" if customer else "de",
                source=str(t["source"]),
                target=str(t["target"]),
            )


def mixed_translation_set(n: int, root: Path | None = None) -> list[tuple[str, str, str]]:
    """`n` (text, source_lang, target_lang) triples over several languages and sources,
    interleaved so any prefix of the list is mixed too."""
    root = root or data_dir()
    pools: list[list[tuple[str, str, str]]] = [
        [(en, "en", "de") for en, _ in tatoeba_pairs("de", root)[100:]],
        [(fr, "fr", "en") for _, fr in tatoeba_pairs("fr", root)[100:]],
        [(u.source, u.source_lang, u.target_lang) for u in bcontrast("dev", root)],
        [(t, "en", "es") for t in flores("en", root)],
        [(t, "it", "fr") for t in xsid_texts("it", root)],
        [(t, "en", "it") for t in xsid_texts("en", root)],
    ]
    out: list[tuple[str, str, str]] = []
    i = 0
    while len(out) < n:
        pool = pools[i % len(pools)]
        out.append(pool[(i // len(pools)) % len(pool)])
        i += 1
    return out
