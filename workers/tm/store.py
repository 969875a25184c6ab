"""The translation-memory directory: imported pairs per language pair, and their indexes.

`tolk tm import` and `tolk tm build` share one directory (`--tm-dir`, `$TOLK_TM_DIR`,
default `tm/`):

    <tm dir>/pairs/<src>-<tgt>.jsonl          every imported pair of the language pair
    <tm dir>/index/<src>-<tgt>/index.faiss    the phrase index (workers.tm.phrase_index)
    <tm dir>/index/<src>-<tgt>/manifest.json  what the index was built with
    <tm dir>/index/<src>-<tgt>/pairs.jsonl    the pairs the index's ids point at

Import appends: a pair already in the memory (same languages, source and target after
normalization) is counted as a duplicate and not written again, so importing a file twice
changes nothing; one source with two different translations keeps both. The pairs files are
JSON Lines (`{"source", "target", "origin"}`), UTF-8, one pair a line, so they diff and grep
like the TMs they came from.

`build` reads a pairs file once and writes the index with its own copy of the pairs, in the
index's id order: an import after a build never shifts the ids an open index answers with;
the index is simply stale until the next build (`tolk tm status` shows both counts).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from workers.tm.formats import TMPair

__all__ = ["ImportCounts", "TranslationMemoryDir", "read_pairs_file", "write_pairs_file"]


def _pair_name(source_lang: str, target_lang: str) -> str:
    return f"{source_lang}-{target_lang}"


def read_pairs_file(path: Path, source_lang: str, target_lang: str) -> Iterator[TMPair]:
    """The pairs of one JSONL pairs file (written by `write_pairs_file` / import)."""
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield TMPair(
                    source_lang,
                    target_lang,
                    row["source"],
                    row["target"],
                    origin=row.get("origin", ""),
                )


def _pair_line(pair: TMPair) -> str:
    row = {"source": pair.source, "target": pair.target, "origin": pair.origin}
    return json.dumps(row, ensure_ascii=False) + "\n"


def write_pairs_file(path: Path, pairs: Iterable[TMPair]) -> int:
    """Write `pairs` (one language pair) to `path`, replacing it; the number written."""
    count = 0
    tmp = Path(path).with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(_pair_line(pair))
            count += 1
    tmp.replace(path)
    return count


@dataclass(slots=True)
class ImportCounts:
    """What one import added, per language pair."""

    added: dict[str, int] = field(default_factory=dict)  # "en-de" -> new pairs written
    duplicates: dict[str, int] = field(default_factory=dict)  # already in the memory

    @property
    def total_added(self) -> int:
        return sum(self.added.values())

    @property
    def total_duplicates(self) -> int:
        return sum(self.duplicates.values())


class TranslationMemoryDir:
    """One TM directory on disk (see the module docstring for the layout)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def pairs_path(self, source_lang: str, target_lang: str) -> Path:
        return self.root / "pairs" / f"{_pair_name(source_lang, target_lang)}.jsonl"

    def index_dir(self, source_lang: str, target_lang: str) -> Path:
        return self.root / "index" / _pair_name(source_lang, target_lang)

    def language_pairs(self) -> list[tuple[str, str]]:
        """The language pairs with imported pairs, sorted."""
        return self._pairs_under(self.root / "pairs", "*.jsonl", lambda p: p.stem)

    def indexed_pairs(self) -> list[tuple[str, str]]:
        """The language pairs with a built index (a manifest), sorted."""
        return self._pairs_under(self.root / "index", "*/manifest.json", lambda p: p.parent.name)

    @staticmethod
    def _pairs_under(
        base: Path, pattern: str, name_of: Callable[[Path], str]
    ) -> list[tuple[str, str]]:
        if not base.is_dir():
            return []
        out = []
        for path in base.glob(pattern):
            src, sep, tgt = name_of(path).partition("-")
            if sep and src and tgt:
                out.append((src, tgt))
        return sorted(out)

    def load_pairs(self, source_lang: str, target_lang: str) -> list[TMPair]:
        path = self.pairs_path(source_lang, target_lang)
        return list(read_pairs_file(path, source_lang, target_lang)) if path.is_file() else []

    def add(self, pairs: Iterable[TMPair]) -> ImportCounts:
        """Append the pairs not yet in the memory; duplicates (also within `pairs`) skipped."""
        counts = ImportCounts()
        seen: dict[tuple[str, str], set[tuple[str, str]]] = {}
        handles = {}
        try:
            for pair in pairs:
                langs = (pair.source_lang, pair.target_lang)
                name = _pair_name(*langs)
                if langs not in seen:
                    seen[langs] = {(p.source, p.target) for p in self.load_pairs(*langs)}
                    path = self.pairs_path(*langs)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    handles[langs] = path.open("a", encoding="utf-8")
                    counts.added.setdefault(name, 0)
                    counts.duplicates.setdefault(name, 0)
                key = (pair.source, pair.target)
                if key in seen[langs]:
                    counts.duplicates[name] += 1
                    continue
                seen[langs].add(key)
                handles[langs].write(_pair_line(pair))
                counts.added[name] += 1
        finally:
            for handle in handles.values():
                handle.close()
        return counts
