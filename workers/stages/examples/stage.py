"""`RetrievedExamplesEngine`: a `TranslationEngine` whose prompts show the k translation-memory
pairs nearest to each request as examples (issue #15, the "retrieved examples" arm option).

Flow of one request (`tolk worker --tm-examples K`, off by default):

1. `ExampleRetriever.retrieve` embeds the text (all-MiniLM-L6-v2, `workers.tm.embed`) and
   searches the phrase index of the request's language pair (`workers.tm.phrase_index`,
   opened memory-mapped at worker start; a TM built for another embedding model or
   dimension stops the worker there). Up to `k` pairs come back; pairs whose source or target
   is longer than `max_example_chars` are dropped (one pasted e-mail in a TM must not blow up
   every prompt it is near), and so are pairs below `min_similarity`.
2. The engine builds the prompt as `cached language prefix + retrieved examples + query`
   (`PromptBuilder.build(..., examples=)`, `Engine.translation_request(examples=)`): the
   prefix (instructions and the form's fixed examples) is the same token ids as for every
   other request of the language, so its KV blocks still come from the prefix cache and only
   the retrieved examples and the query are prefilled. The nearest pair goes last, right
   before the query.
3. The reply's metadata says what was retrieved: `tolk.tm.examples` (how many went into the
   prompt) and `tolk.tm.similarity` (the nearest one's cosine similarity), or `tolk.tm` =
   `no_index` (no index for the pair, or no source language given) / `error` (retrieval
   failed: the request is translated with the fixed examples only, never lost).

Its place is innermost, right around the engine (workers/serving/pipeline.py): the examples
go down in the request's `examples` field, and the faithfulness stage's retry, a copy of the
request in another prompt form, shows the same examples.

The exact-match cache must not answer a plain arm's request with a retrieved-examples
translation or the other way round: `key_note` (k, the similarity floor, the length cap and a
digest of every index's pairs and parameters) goes into the cache's engine fingerprint
(`workers.stages.cache.stage.engine_fingerprint`), besides this class's name among the stages
below the cache; rebuilding the TM with other pairs retires its cached translations.

Retrieval runs on the caller's thread (the worker's poll loop): about a millisecond or two of
embedding plus well under a millisecond of search per request (`bench/tm_prompt.py` measures
it; docs/BENCHMARKS.md). `ExampleRetriever` is also what the benchmark uses, so the figures
are those of this code path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from workers import reply_metadata as meta
from workers.engine.types import (
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
)
from workers.stages.wrapper import EngineWrapper
from workers.tm.phrase_index import Neighbour, PhraseIndexes

__all__ = [
    "DEFAULT_MAX_EXAMPLE_CHARS",
    "NOTE_KEY",
    "ExampleRetriever",
    "Retrieval",
    "RetrievedExamplesEngine",
    "tm_digest",
    "open_retriever",
]

log = logging.getLogger(__name__)

NOTE_KEY = meta.TM  # the reply metadata keys of this stage (workers/reply_metadata.py)
EXAMPLES_KEY = meta.TM_EXAMPLES
SIMILARITY_KEY = meta.TM_SIMILARITY
DEFAULT_MAX_EXAMPLE_CHARS = 400  # a longer source or target is not shown as an example


@dataclass(frozen=True, slots=True)
class Retrieval:
    """What one request retrieved, and what it cost."""

    examples: tuple[tuple[str, str], ...]  # (source, target), farthest first, nearest last
    top_similarity: float | None  # the nearest pair's, None when nothing was found
    embed_s: float  # embedding the text
    search_s: float  # searching the index
    indexed: bool  # the language pair has an index

    @property
    def seconds(self) -> float:
        return self.embed_s + self.search_s


class ExampleRetriever:
    """The k nearest TM pairs of a request's language pair, as prompt examples."""

    def __init__(
        self,
        indexes: PhraseIndexes,
        k: int,
        *,
        min_similarity: float = -1.0,
        max_example_chars: int = DEFAULT_MAX_EXAMPLE_CHARS,
        embed_threads: int = 1,
    ) -> None:
        """`embed_threads`: torch threads of the calling thread while it embeds (restored
        after). One by default: the worker's poll thread must not grow an OpenMP pool of its
        own beside the engine thread's (`workers.engine.threads`: idle pools make every
        parallel op of the engine pay a wake-up), and a short sentence gains little from two."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.indexes = indexes
        self.k = k
        self.min_similarity = min_similarity
        self.max_example_chars = max_example_chars
        self.embed_threads = embed_threads

    def retrieve(self, source_lang: str, target_lang: str, text: str) -> Retrieval:
        index = self.indexes.indexes.get((source_lang, target_lang))
        if index is None or not text.strip():
            return Retrieval((), None, 0.0, 0.0, index is not None)
        started = time.perf_counter()
        with _torch_threads(self.embed_threads):
            vector = index.embedder.embed([text])
        embedded = time.perf_counter()
        # ask for more than k: the length filter may drop some of the nearest
        similarities, ids = index.search(vector, min(self.k * 2, index.manifest.count))
        searched = time.perf_counter()
        neighbours = [
            Neighbour(index.pairs[int(i)], float(s))
            for s, i in zip(similarities[0], ids[0], strict=True)
            if i >= 0
        ]
        chosen = [n for n in neighbours if self._usable(n)][: self.k]
        return Retrieval(
            tuple((n.pair.source, n.pair.target) for n in reversed(chosen)),
            chosen[0].similarity if chosen else None,
            embedded - started,
            searched - embedded,
            True,
        )

    def _usable(self, neighbour: Neighbour) -> bool:
        pair = neighbour.pair
        return (
            neighbour.similarity >= self.min_similarity
            and 0 < len(pair.source) <= self.max_example_chars
            and 0 < len(pair.target) <= self.max_example_chars
        )

    @property
    def key_note(self) -> str:
        """What decides the retrieved examples, for the exact-match cache's key."""
        return (
            f"tm(k={self.k},min={self.min_similarity:g},chars={self.max_example_chars},"
            f"{tm_digest(self.indexes)})"
        )


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """The calling thread's torch intra-op thread count set to `n` for the block."""
    import torch

    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)


def tm_digest(indexes: PhraseIndexes) -> str:
    """16 hex digits over every index's language pair, embedding model, parameters and pairs:
    equal for a TM rebuilt from the same pairs, different as soon as one pair differs."""
    h = hashlib.blake2b(digest_size=8)
    for langs in indexes.language_pairs:
        index = indexes.indexes[langs]
        m = index.manifest
        h.update(f"{langs}|{m.embedding_model}|{m.dimension}|{m.params}\x1e".encode())
        for pair in index.pairs:
            h.update(f"{pair.source}\x1f{pair.target}\x1e".encode())
    return h.hexdigest()


class RetrievedExamplesEngine(EngineWrapper):
    """Wraps the engine; each request's prompt shows its nearest TM pairs (module notes)."""

    def __init__(self, inner: TranslationEngine, retriever: ExampleRetriever) -> None:
        self.inner = inner
        self.retriever = retriever
        self.key_note = retriever.key_note  # read by the cache's engine fingerprint
        self._lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (lang, retrieved|no_index|error)
        self.retrieval_seconds: deque[float] = deque(maxlen=4096)  # the latest, for stats
        self._metrics: Any = None  # the worker's, once bound: tolk_tm_retrieval*

    def bind_metrics(self, metrics: Any) -> None:
        """Count in the worker's `tolk_tm_retrievals_total` / `tolk_tm_retrieval_seconds`."""
        self._metrics = metrics

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Queue one translation whose prompt shows the nearest TM pairs (the request's
        `examples`, which the engine puts after the cached prefix)."""
        request_id, text = request.request_id, request.text
        source_lang, target_lang = request.source_lang, request.target_lang
        notes: dict[str, str]
        examples: tuple[tuple[str, str], ...]
        try:
            found = self.retriever.retrieve(source_lang, target_lang, text)
        except Exception:  # an index problem must not lose the request
            log.exception("retrieval failed for %s (%s->%s)", request_id, source_lang, target_lang)
            found = None
        if found is None:
            outcome, examples, notes = "error", (), {NOTE_KEY: "error"}
        elif not found.indexed:
            outcome, examples, notes = "no_index", (), {NOTE_KEY: "no_index"}
        else:
            outcome, examples = "retrieved", found.examples
            notes = {EXAMPLES_KEY: str(len(examples))}
            if found.top_similarity is not None:
                notes[SIMILARITY_KEY] = f"{found.top_similarity:.3f}"
        with self._lock:
            self.outcomes[(target_lang, outcome)] += 1
            if found is not None and found.indexed:
                self.retrieval_seconds.append(found.seconds)
        if self._metrics is not None:
            self._metrics.tm_retrievals_total.labels(lang=target_lang, outcome=outcome).inc()
            if found is not None and found.indexed:
                self._metrics.tm_retrieval_seconds.observe(found.seconds)
        inner = self.inner.submit_translation(dataclasses.replace(request, examples=examples))
        outer = RequestHandle(request_id, lambda _rid: inner.cancel())

        def done(result: GenerationResult) -> None:  # engine thread: one dict merge
            merged = {**result.notes, **notes}
            outer.set_result(dataclasses.replace(result, notes=merged, examples_used=len(examples)))

        inner.add_done_callback(done)
        return outer


def open_retriever(
    tm_dir: Any,
    k: int,
    *,
    min_similarity: float = -1.0,
    max_example_chars: int = DEFAULT_MAX_EXAMPLE_CHARS,
    embedder: Any = None,
) -> ExampleRetriever:
    """The retriever of `tm_dir`'s phrase indexes, opened memory-mapped (`tolk worker
    --tm-examples K --tm-dir DIR`, before the model loads). An index built for another
    embedding model or dimension raises `IndexMismatchError`; a TM without any index raises
    ValueError: the worker refuses to start with either."""
    from workers.tm.embed import MiniLMEmbedder

    indexes = PhraseIndexes.open(tm_dir, embedder if embedder is not None else MiniLMEmbedder())
    if not indexes.indexes:
        raise ValueError(
            f"{tm_dir}: no phrase index to retrieve examples from (run `tolk tm import FILE` "
            "and `tolk tm build` first)"
        )
    pairs = ", ".join(f"{s}-{t}" for s, t in indexes.language_pairs)
    log.info("retrieved examples: k=%d from %s (%s)", k, tm_dir, pairs)
    return ExampleRetriever(
        indexes, k, min_similarity=min_similarity, max_example_chars=max_example_chars
    )
