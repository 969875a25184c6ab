"""The phrase index: the k translation-memory pairs nearest to a new sentence, per language pair.

One index per language pair (`en-de` holds English source segments whose German translation
the TM knows), because a retrieved example is only useful to a prompt of the same pair.
Vectors are the source segments' sentence embeddings (`workers.tm.embed`, unit length).

**Index.** faiss `IndexIVFPQ` (inner product of unit vectors = cosine similarity): a coarse
k-means quantizer of `nlist` cells and, inside each cell, the residual of every vector
product-quantized into `m` sub-vectors of `nbits` bits each. Inner product, not L2: with L2 and
residuals faiss keeps a precomputed table of nlist x m x 2^nbits floats in memory (61 MB for
the 25k-vector index, 15x the index file, which would defeat the memory map); with inner
product the lookup table is per query only. A query visits the `nprobe`
nearest cells and ranks their codes with one lookup table per query: the index holds `m`
bytes per vector instead of 4 x 384, and a query reads a few percent of them. Parameters come
from `choose_params(n)` (tuned by `bench/tm.py` on every language pair of the repository's
data; docs/BENCHMARKS.md has the figures): k-means wants about 39 training points per
centroid and PQ 2^nbits centroids per sub-quantizer (8 bits from 16 points each), so a
small memory gets fewer cells and fewer bits. Under `MIN_IVFPQ_PAIRS` (10,000) pairs an
exact `IndexFlatIP` is written instead: measured on every language pair of data/
(docs/BENCHMARKS.md, one faiss thread), flat search of the 1-2k-vector pairs is 1.3-6x faster
than IVF-PQ, and exact; with 192 sub-quantizers IVF-PQ holds 0.91 of flat's top 10 at 24k
vectors, 6.4x faster and 6x smaller, but is no faster than flat around 7k vectors and slower
below, so under 10,000 pairs the exact index wins.
The manifest says which kind was built (`kind`). With faiss-gpu installed the same index
can be moved to a GPU (`faiss.index_cpu_to_gpu`); tolk's TMs are small enough for the CPU.

**On disk** (`build` / `open`): `index.faiss` (faiss's own format), `pairs.jsonl` (the pairs,
in id order) and `manifest.json`: format version, embedding model and dimension, kind and
parameters, counts, faiss version, languages. `open` reads the manifest first and refuses an
index built with another embedding model or dimension (`IndexMismatchError`, naming both and
the command that rebuilds it), or whose files disagree with it; then it opens the index with
`faiss.IO_FLAG_MMAP`: the inverted lists (the codes, the bulk of an IVF-PQ index) stay in the
page cache, shared by every worker on the host and paged in as queries touch them; only the
coarse centroids and the PQ codebooks are read into memory. (A flat index is mapped with
`IO_FLAG_MMAP_IFC`.)

**At request time** `PhraseIndexes.nearest(source_lang, target_lang, text, k)` embeds the
text (about a millisecond) and returns up to k `Neighbour`s, nearest first, each a `TMPair`
with its cosine similarity (and distance). The retrieved-examples arm option
(`workers/stages/examples/stage.py`, `tolk worker --tm-examples K`) opens the TM directory this
way at
worker start (a mismatched index stops the worker with the error above) and hands the
neighbours to the prompt builder as examples, after the cached language prefix.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from workers.tm.embed import Embedder
from workers.tm.formats import TMPair
from workers.tm.store import TranslationMemoryDir, read_pairs_file, write_pairs_file

__all__ = [
    "MANIFEST_VERSION",
    "MIN_IVFPQ_PAIRS",
    "IndexMismatchError",
    "IndexParams",
    "Manifest",
    "Neighbour",
    "PhraseIndex",
    "PhraseIndexes",
    "choose_params",
    "train_index",
]

MANIFEST_VERSION = 1
MIN_IVFPQ_PAIRS = 10_000  # below: an exact flat index, faster there (bench/tm.py)
INDEX_FILE = "index.faiss"
MANIFEST_FILE = "manifest.json"
PAIRS_FILE = "pairs.jsonl"
POINTS_PER_CENTROID = 39  # faiss's k-means warns below this many training points per centroid
PQ_BYTES_PER_VECTOR = 192  # m: sub-quantizers (2 dimensions each for MiniLM's 384; 96 missed
# recall@10 >= 0.9 of flat: 0.83 vs 0.91 on 24k vectors, docs/BENCHMARKS.md)
MAX_NPROBE = 32  # cells visited per query: an eighth of the cells, at least 8, at most 32

IndexKind = Literal["ivfpq", "flat"]


class IndexMismatchError(ValueError):
    """An index on disk cannot be used with this embedder (or its files disagree)."""


@dataclass(frozen=True, slots=True)
class IndexParams:
    """How one index is built and searched."""

    kind: IndexKind  # "ivfpq", or "flat" (exact) for a small memory
    nlist: int = 0  # coarse cells (IVF)
    m: int = 0  # PQ sub-quantizers = bytes per vector at nbits=8; divides the dimension
    nbits: int = 0  # bits per sub-quantizer code
    nprobe: int = 0  # cells visited per query


def choose_params(n: int, dimension: int = 384, kind: IndexKind | None = None) -> IndexParams:
    """Parameters for an index of `n` vectors (tuned by bench/tm.py, docs/BENCHMARKS.md);
    `kind` forces flat or IVF-PQ (ValueError if n is too small to train IVF-PQ)."""
    kind = kind or ("flat" if n < MIN_IVFPQ_PAIRS else "ivfpq")
    if kind == "flat":
        return IndexParams(kind="flat")
    # PQ codebooks: 2^nbits centroids per sub-quantizer; 8 bits from 16 training points each
    nbits = 8 if n >= 16 * 256 else 6 if n >= 64 * POINTS_PER_CENTROID // 4 else 0
    if nbits == 0:
        raise ValueError(
            f"{n} pairs are too few to train IVF-PQ (at least {64 * POINTS_PER_CENTROID // 4});"
            " use the exact flat index"
        )
    # about 4 sqrt(n) cells, but never fewer than 39 training points per cell
    nlist = max(1, min(int(4 * math.sqrt(n)), n // POINTS_PER_CENTROID))
    m = _largest_divisor_at_most(dimension, PQ_BYTES_PER_VECTOR)
    nprobe = min(nlist, max(8, min(MAX_NPROBE, nlist // 8)))
    return IndexParams(kind="ivfpq", nlist=nlist, m=m, nbits=nbits, nprobe=nprobe)


def _largest_divisor_at_most(dimension: int, limit: int) -> int:
    return next(m for m in range(min(limit, dimension), 0, -1) if dimension % m == 0)


def train_index(vectors: np.ndarray, params: IndexParams) -> Any:
    """A trained faiss index holding `vectors` ([n, d] float32), ids 0..n-1."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    dimension = vectors.shape[1]
    index: Any
    if params.kind == "flat":
        index = faiss.IndexFlatIP(dimension)
    else:
        quantizer = faiss.IndexFlatIP(dimension)
        index = faiss.IndexIVFPQ(
            quantizer, dimension, params.nlist, params.m, params.nbits, faiss.METRIC_INNER_PRODUCT
        )
        index.cp.seed = 1234  # k-means initialisation: the same TM builds the same index
        index.pq.cp.seed = 1234
        index.train(vectors)
        index.nprobe = params.nprobe
    index.add(vectors)
    return index


@dataclass(frozen=True, slots=True)
class Manifest:
    """`manifest.json`: what an index was built with."""

    version: int
    embedding_model: str
    dimension: int
    source_lang: str
    target_lang: str
    count: int
    kind: IndexKind
    nlist: int
    m: int
    nbits: int
    nprobe: int
    faiss_version: str
    build_seconds: float

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(**{name: raw[name] for name in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise IndexMismatchError(f"{path}: unreadable index manifest ({exc})") from exc

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @property
    def params(self) -> IndexParams:
        return IndexParams(self.kind, self.nlist, self.m, self.nbits, self.nprobe)


@dataclass(frozen=True, slots=True)
class Neighbour:
    """One retrieved TM pair."""

    pair: TMPair
    similarity: float  # cosine similarity of the unit vectors (PQ-approximate for IVF-PQ)

    @property
    def distance(self) -> float:
        """Squared L2 between the unit vectors, 2 - 2 cos: 0 = same direction."""
        return 2.0 - 2.0 * self.similarity


def check_manifest(manifest: Manifest, embedder: Embedder, where: Path) -> None:
    """Refuse an index this embedder cannot query (IndexMismatchError)."""
    if manifest.version != MANIFEST_VERSION:
        raise IndexMismatchError(
            f"{where}: index manifest version {manifest.version}, this tolk reads version "
            f"{MANIFEST_VERSION}; rebuild it with `tolk tm build`"
        )
    if (manifest.embedding_model, manifest.dimension) != (embedder.model_name, embedder.dimension):
        raise IndexMismatchError(
            f"{where}: index built with embedding model {manifest.embedding_model!r} "
            f"(dimension {manifest.dimension}), but this worker embeds with "
            f"{embedder.model_name!r} (dimension {embedder.dimension}); rebuild it with "
            "`tolk tm build` or use the model it was built with"
        )


class PhraseIndex:
    """The index of one language pair, with the pairs its ids point at."""

    def __init__(
        self, index: Any, pairs: list[TMPair], manifest: Manifest, embedder: Embedder
    ) -> None:
        self.index = index
        self.pairs = pairs
        self.manifest = manifest
        self.embedder = embedder

    @classmethod
    def build(
        cls,
        directory: Path,
        pairs: Sequence[TMPair],
        embedder: Embedder,
        params: IndexParams | None = None,
        vectors: np.ndarray | None = None,
    ) -> PhraseIndex:
        """Embed the pairs' sources (unless `vectors` are given), train, write to `directory`."""
        import faiss

        if not pairs:
            raise ValueError("a phrase index needs at least one pair")
        langs = {(p.source_lang, p.target_lang) for p in pairs}
        if len(langs) != 1:
            raise ValueError(f"one index per language pair, got {sorted(langs)}")
        ((source_lang, target_lang),) = langs
        started = time.perf_counter()
        if vectors is None:
            vectors = embedder.embed([p.source for p in pairs])
        if vectors.shape != (len(pairs), embedder.dimension):
            raise ValueError(
                f"vectors {vectors.shape} for {len(pairs)} pairs of dimension {embedder.dimension}"
            )
        params = params or choose_params(len(pairs), embedder.dimension)
        index = train_index(vectors, params)
        manifest = Manifest(
            version=MANIFEST_VERSION,
            embedding_model=embedder.model_name,
            dimension=embedder.dimension,
            source_lang=source_lang,
            target_lang=target_lang,
            count=len(pairs),
            kind=params.kind,
            nlist=params.nlist,
            m=params.m,
            nbits=params.nbits,
            nprobe=params.nprobe,
            faiss_version=faiss.__version__,
            build_seconds=round(time.perf_counter() - started, 3),
        )
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # pairs and index first, the manifest last: a build cut short leaves no manifest,
        # so the directory is not an index (open refuses it, `indexed_pairs` skips it)
        (directory / MANIFEST_FILE).unlink(missing_ok=True)
        write_pairs_file(directory / PAIRS_FILE, pairs)
        faiss.write_index(index, str(directory / INDEX_FILE))
        manifest.write(directory / MANIFEST_FILE)
        return cls(index, list(pairs), manifest, embedder)

    @classmethod
    def open(cls, directory: Path, embedder: Embedder, mmap: bool = True) -> PhraseIndex:
        """Open a written index (memory-mapped by default), after checking its manifest."""
        import faiss

        directory = Path(directory)
        manifest = Manifest.read(directory / MANIFEST_FILE)
        check_manifest(manifest, embedder, directory)
        flags = 0
        if mmap:
            flags = faiss.IO_FLAG_MMAP if manifest.kind == "ivfpq" else faiss.IO_FLAG_MMAP_IFC
        index: Any = faiss.read_index(str(directory / INDEX_FILE), flags)
        pairs = list(
            read_pairs_file(directory / PAIRS_FILE, manifest.source_lang, manifest.target_lang)
        )
        if (index.d, index.ntotal, len(pairs)) != (
            manifest.dimension,
            manifest.count,
            manifest.count,
        ):
            raise IndexMismatchError(
                f"{directory}: the files disagree with the manifest (index dimension "
                f"{index.d}, {index.ntotal} vectors, {len(pairs)} pairs; manifest: dimension "
                f"{manifest.dimension}, {manifest.count}); rebuild it with `tolk tm build`"
            )
        if manifest.kind == "ivfpq":
            index.nprobe = manifest.nprobe
        return cls(index, pairs, manifest, embedder)

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss search: (similarities [q, k], ids [q, k]; -1 where fewer than k were found)."""
        distances, ids = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)
        return distances, ids

    def nearest(self, text: str, k: int = 4) -> list[Neighbour]:
        """Up to k pairs whose source is nearest to `text`, nearest first."""
        similarities, ids = self.search(self.embedder.embed([text]), k)
        return [
            Neighbour(self.pairs[int(i)], float(s))
            for s, i in zip(similarities[0], ids[0], strict=True)
            if i >= 0
        ]


class PhraseIndexes:
    """Every built index of a TM directory, by language pair (what a worker opens at start)."""

    def __init__(self, indexes: dict[tuple[str, str], PhraseIndex]) -> None:
        self.indexes = indexes

    @classmethod
    def open(cls, root: Path, embedder: Embedder, mmap: bool = True) -> PhraseIndexes:
        tm = TranslationMemoryDir(root)
        return cls(
            {
                langs: PhraseIndex.open(tm.index_dir(*langs), embedder, mmap=mmap)
                for langs in tm.indexed_pairs()
            }
        )

    @property
    def language_pairs(self) -> list[tuple[str, str]]:
        return sorted(self.indexes)

    def nearest(self, source_lang: str, target_lang: str, text: str, k: int = 4) -> list[Neighbour]:
        """Up to k TM pairs of this language pair nearest to `text`; [] without an index."""
        index = self.indexes.get((source_lang, target_lang))
        return index.nearest(text, k) if index is not None else []
