"""Readers for the public data sets in `shared/data` (their own formats, no hand-edited copies).

- `tatoeba_laser/tatoeba.<xxx>-eng.<xxx|eng>`: line-aligned short sentence pairs;
- `flores200_devtest/<xxx>.devtest`: the same 1,012 sentences in five languages;
- `bcontrast_wmt20_chat/{train,dev}.json`: customer (de) / agent (en) dialogues with targets;
- `xsid/<lang>.valid.conll`: voice-assistant commands (`# text = ...` lines).

Used by the replay worker, the demo, the benchmarks and the tests. The root is
`$TOLK_DATA_DIR`, else the first of `../shared/data` beside the checkout and `/work/shared/data`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ISO3 = {"en": "eng", "de": "deu", "fr": "fra", "es": "spa", "it": "ita"}


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
    env = os.environ.get("TOLK_DATA_DIR")
    candidates = [Path(env)] if env else []
    beside_checkout = Path(__file__).resolve().parents[2] / "shared" / "data"
    candidates += [beside_checkout, Path("/work/shared/data")]
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(
        "shared data not found; set TOLK_DATA_DIR (looked in: "
        + ", ".join(str(c) for c in candidates)
        + ")"
    )


def _lines(path: Path) -> list[str]:
    return [line.rstrip("\n") for line in path.open(encoding="utf-8")]


def tatoeba_pairs(lang: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(english, other) pairs for lang in de/fr/es/it."""
    code = ISO3[lang]
    base = (root or data_dir()) / "tatoeba_laser"
    eng = _lines(base / f"tatoeba.{code}-eng.eng")
    other = _lines(base / f"tatoeba.{code}-eng.{code}")
    return list(zip(eng, other, strict=True))


def flores(lang: str, root: Path | None = None) -> list[str]:
    return _lines((root or data_dir()) / "flores200_devtest" / f"{ISO3[lang]}.devtest")


def xsid_texts(lang: str, root: Path | None = None) -> list[str]:
    path = (root or data_dir()) / "xsid" / f"{lang}.valid.conll"
    return [
        line.split("=", 1)[1].strip()
        for line in path.open(encoding="utf-8")
        if line.startswith("# text =") or line.startswith("# text=")
    ]


def bcontrast(split: str = "dev", root: Path | None = None) -> Iterator[Utterance]:
    """Utterances in conversation order; customers write German, agents English."""
    path = (root or data_dir()) / "bcontrast_wmt20_chat" / f"{split}.json"
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
