"""The phrase index: built, written, opened memory-mapped, queried; mismatches refused.

The fast tests use `HashEmbedder` (a deterministic random unit vector per text, no model), so
they test the index and its files, not the embedding; the `slow` one runs all-MiniLM-L6-v2.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from workers.tm.formats import TMPair
from workers.tm.phrase_index import (
    MIN_IVFPQ_PAIRS,
    IndexMismatchError,
    IndexParams,
    PhraseIndex,
    PhraseIndexes,
    choose_params,
)
from workers.tm.store import TranslationMemoryDir


class HashEmbedder:
    """A unit vector per text from its hash: equal texts, equal vectors; others far apart."""

    def __init__(self, dimension: int = 32, model_name: str = "test/hash-embedder") -> None:
        self.dimension = dimension
        self.model_name = model_name

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
            v = np.random.default_rng(seed).standard_normal(self.dimension)
            rows.append(v / np.linalg.norm(v))
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), self.dimension)


def _pairs(n: int, src: str = "en", tgt: str = "de") -> list[TMPair]:
    return [
        TMPair(src, tgt, f"sentence number {i}", f"Satz Nummer {i}", f"tm.tsv:{i + 1}")
        for i in range(n)
    ]


IVFPQ = IndexParams(kind="ivfpq", nlist=16, m=8, nbits=6, nprobe=4)


def test_ivfpq_index_written_opened_mmap_finds_the_stored_sentence(tmp_path: Path) -> None:
    import faiss

    embedder = HashEmbedder()
    built = PhraseIndex.build(tmp_path / "en-de", _pairs(1500), embedder, params=IVFPQ)
    assert built.manifest.kind == "ivfpq" and built.manifest.count == 1500
    manifest = json.loads((tmp_path / "en-de" / "manifest.json").read_text())
    assert manifest["embedding_model"] == "test/hash-embedder" and manifest["dimension"] == 32

    opened = PhraseIndex.open(tmp_path / "en-de", embedder)  # memory-mapped by default
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(opened.index).invlists)
    assert isinstance(lists, faiss.OnDiskInvertedLists)  # the codes are mapped, not read
    assert opened.index.nprobe == 4
    for i in (0, 737, 1499):
        found = opened.nearest(f"sentence number {i}", k=5)
        assert len(found) == 5
        assert found[0].pair.source == f"sentence number {i}"
        assert found[0].pair.target == f"Satz Nummer {i}"
        assert found[0].distance == min(n.distance for n in found)
        assert found[0].similarity > 0.8  # PQ-approximate, but the same vector


def test_full_load_answers_like_the_mmap_load(tmp_path: Path) -> None:
    embedder = HashEmbedder()
    PhraseIndex.build(tmp_path / "en-de", _pairs(1200), embedder, params=IVFPQ)
    queries = embedder.embed([f"sentence number {i}" for i in range(0, 1200, 97)])
    mapped = PhraseIndex.open(tmp_path / "en-de", embedder, mmap=True).search(queries, 10)
    loaded = PhraseIndex.open(tmp_path / "en-de", embedder, mmap=False).search(queries, 10)
    np.testing.assert_array_equal(mapped[1], loaded[1])


def test_small_memory_gets_an_exact_flat_index(tmp_path: Path) -> None:
    embedder = HashEmbedder()
    assert choose_params(MIN_IVFPQ_PAIRS - 1).kind == "flat"
    assert choose_params(20_000).kind == "ivfpq"
    index = PhraseIndex.build(tmp_path / "en-de", _pairs(40), embedder)
    assert index.manifest.kind == "flat"
    found = PhraseIndex.open(tmp_path / "en-de", embedder).nearest("sentence number 7", k=3)
    assert found[0].pair.source == "sentence number 7"
    assert found[0].distance == pytest.approx(0.0, abs=1e-5)  # exact search
    assert len(PhraseIndex.open(tmp_path / "en-de", embedder).nearest("x", k=100)) == 40


def test_index_of_another_embedding_model_or_dimension_is_refused(tmp_path: Path) -> None:
    PhraseIndex.build(tmp_path / "en-de", _pairs(50), HashEmbedder())
    with pytest.raises(
        IndexMismatchError,
        match=r"built with embedding model 'test/hash-embedder'"
        r" \(dimension 32\).*'other/model' \(dimension 32\).*tolk tm build",
    ):
        PhraseIndex.open(tmp_path / "en-de", HashEmbedder(model_name="other/model"))
    with pytest.raises(IndexMismatchError, match=r"dimension 32.*dimension 64"):
        PhraseIndex.open(tmp_path / "en-de", HashEmbedder(dimension=64))


def test_files_that_disagree_with_the_manifest_are_refused(tmp_path: Path) -> None:
    embedder = HashEmbedder()
    PhraseIndex.build(tmp_path / "en-de", _pairs(50), embedder)
    pairs_file = tmp_path / "en-de" / "pairs.jsonl"
    pairs_file.write_text("".join(pairs_file.read_text().splitlines(True)[:-1]))
    with pytest.raises(IndexMismatchError, match="49 pairs"):
        PhraseIndex.open(tmp_path / "en-de", embedder)
    (tmp_path / "en-de" / "manifest.json").write_text("{")
    with pytest.raises(IndexMismatchError, match="unreadable index manifest"):
        PhraseIndex.open(tmp_path / "en-de", embedder)


def test_indexes_of_a_tm_dir_by_language_pair(tmp_path: Path) -> None:
    embedder = HashEmbedder()
    tm = TranslationMemoryDir(tmp_path)
    PhraseIndex.build(tm.index_dir("en", "de"), _pairs(30), embedder)
    PhraseIndex.build(
        tm.index_dir("de", "en"),
        [TMPair("de", "en", "Hallo", "Hello"), TMPair("de", "en", "Danke", "Thanks")],
        embedder,
    )
    indexes = PhraseIndexes.open(tmp_path, embedder)
    assert indexes.language_pairs == [("de", "en"), ("en", "de")]
    assert indexes.nearest("de", "en", "Danke", k=1)[0].pair.target == "Thanks"
    assert indexes.nearest("en", "fr", "Hello", k=3) == []  # no TM for the pair
    with pytest.raises(ValueError, match="one index per language pair"):
        PhraseIndex.build(tmp_path / "mixed", _pairs(2) + _pairs(2, "de", "en"), embedder)


@pytest.mark.slow
def test_minilm_index_finds_paraphrases_of_support_sentences(tmp_path: Path) -> None:
    from workers.tm.embed import MINILM_DIMENSION, MiniLMEmbedder

    embedder = MiniLMEmbedder()
    sources = [
        "Where is my order?",
        "I would like to cancel my subscription.",
        "The package arrived damaged.",
        "Can I pay by credit card?",
        "Thank you for your help!",
        "What time do you open tomorrow?",
    ]
    pairs = [TMPair("en", "de", s, f"de:{s}") for s in sources]
    PhraseIndex.build(tmp_path / "en-de", pairs, embedder)
    index = PhraseIndex.open(tmp_path / "en-de", embedder)
    assert index.manifest.dimension == MINILM_DIMENSION
    assert index.nearest("Where is my order?", k=1)[0].distance == pytest.approx(0.0, abs=1e-4)
    assert index.nearest("My parcel came broken", k=1)[0].pair.source == sources[2]
    assert index.nearest("Do you accept Visa?", k=1)[0].pair.source == sources[3]
