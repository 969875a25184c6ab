"""Retrieved examples in the prompt (workers/stages/examples/stage.py,
`PromptBuilder.build(examples=)`).

Fast tests: a character tokenizer for the prompt builder, `HashEmbedder` (equal texts, equal
vectors) for the index, a recording fake engine for the wrapper. The prefix cache on a real
model is tested in `test_tm_engine_real_model.py`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fake_tokenizer import CharTokenizer
from workers.engine.prompts import PromptBuilder
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationRequest,
)
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.cache.redis_l2 import InMemoryTranslationCache
from workers.stages.examples.stage import (
    EXAMPLES_KEY,
    NOTE_KEY,
    SIMILARITY_KEY,
    ExampleRetriever,
    RetrievedExamplesEngine,
    open_retriever,
    tm_digest,
)
from workers.tm.formats import TMPair
from workers.tm.phrase_index import IndexMismatchError, PhraseIndex, PhraseIndexes
from workers.tm.store import TranslationMemoryDir


class HashEmbedder:
    """A unit vector per text from its hash: equal texts, equal vectors; others far apart."""

    model_name = "test/hash-embedder"
    dimension = 32

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
            v = np.random.default_rng(seed).standard_normal(self.dimension)
            rows.append(v / np.linalg.norm(v))
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), self.dimension)


def builder() -> PromptBuilder:
    return PromptBuilder(CharTokenizer(), "gemma3", bos_id=2, eos_ids={1})


TM_PAIRS = [
    TMPair("en", "de", "Where is my order?", "Wo ist meine Bestellung?"),
    TMPair("en", "de", "Thank you for waiting.", "Danke fürs Warten."),
    TMPair("en", "de", "Your refund is on its way.", "Ihre Erstattung ist unterwegs."),
    TMPair("en", "de", "Long " * 200, "Lang " * 200),  # longer than the example cap
    TMPair("en", "de", "Can I change the address?", "Kann ich die Adresse ändern?"),
]


@pytest.fixture()
def tm_dir(tmp_path: Path) -> Path:
    tm = TranslationMemoryDir(tmp_path / "tm")
    tm.add(TM_PAIRS)
    PhraseIndex.build(tm.index_dir("en", "de"), tm.load_pairs("en", "de"), HashEmbedder())
    return tm.root


def retriever(tm_dir: Path, k: int = 2, **kw: Any) -> ExampleRetriever:
    return ExampleRetriever(PhraseIndexes.open(tm_dir, HashEmbedder()), k, **kw)


# -- the prompt ----------------------------------------------------------------------------------


def test_examples_go_between_the_unchanged_prefix_and_the_query() -> None:
    prompts = builder()
    plain, plain_prefix = prompts.build("Hallo", "de", "en")
    examples = [("Danke.", "Thanks."), ("Guten Tag.", "Good day.")]
    ids, prefix_len = prompts.build("Hallo", "de", "en", examples=examples)
    assert prefix_len == plain_prefix  # the shareable prefix is the same ids for every request
    assert ids[:prefix_len] == plain[:plain_prefix] == prompts.prefix_ids("en")
    middle = CharTokenizer().decode(ids[prefix_len:])
    assert middle == (
        "German: Danke.\nEnglish: Thanks.\n\nGerman: Guten Tag.\nEnglish: Good day.\n\n"
        + prompts.query_text("Hallo", "de", "en")
    )


def test_no_examples_builds_the_plain_prompt() -> None:
    prompts = builder()
    assert prompts.build("Hallo", "de", "en", examples=()) == prompts.build("Hallo", "de", "en")


# -- retrieval -----------------------------------------------------------------------------------


def test_the_nearest_pair_comes_last_and_long_pairs_are_left_out(tm_dir: Path) -> None:
    found = retriever(tm_dir, k=4).retrieve("en", "de", "Where is my order?")
    assert found.indexed and found.top_similarity == pytest.approx(1.0, abs=1e-5)
    assert found.examples[-1] == ("Where is my order?", "Wo ist meine Bestellung?")
    assert len(found.examples) == 4  # 5 pairs, the over-long one dropped
    assert all(len(src) <= 400 for src, _ in found.examples)
    assert found.embed_s > 0 and found.search_s > 0


def test_k_and_the_similarity_floor_bound_the_examples(tm_dir: Path) -> None:
    assert len(retriever(tm_dir, k=2).retrieve("en", "de", "Where is my order?").examples) == 2
    # hash vectors of different texts are nearly orthogonal: only the exact match is >= 0.9
    found = retriever(tm_dir, k=4, min_similarity=0.9).retrieve("en", "de", "Where is my order?")
    assert found.examples == (("Where is my order?", "Wo ist meine Bestellung?"),)


def test_a_pair_without_index_retrieves_nothing(tm_dir: Path) -> None:
    found = retriever(tm_dir).retrieve("de", "en", "Wo ist meine Bestellung?")
    assert not found.indexed and found.examples == () and found.top_similarity is None


def test_an_index_for_another_embedder_is_refused_at_open(tm_dir: Path) -> None:
    class OtherEmbedder(HashEmbedder):
        model_name = "test/other"

    with pytest.raises(IndexMismatchError, match="test/hash-embedder"):
        open_retriever(tm_dir, 4, embedder=OtherEmbedder())
    with pytest.raises(ValueError, match="no phrase index"):
        open_retriever(tm_dir.parent / "empty", 4, embedder=HashEmbedder())


def test_the_tm_digest_changes_with_one_pair(tmp_path: Path, tm_dir: Path) -> None:
    same = TranslationMemoryDir(tmp_path / "same")
    same.add(TM_PAIRS)
    PhraseIndex.build(same.index_dir("en", "de"), same.load_pairs("en", "de"), HashEmbedder())
    other = TranslationMemoryDir(tmp_path / "other")
    other.add([*TM_PAIRS[:-1], TMPair("en", "de", "Can I change the address?", "Adresse?")])
    PhraseIndex.build(other.index_dir("en", "de"), other.load_pairs("en", "de"), HashEmbedder())

    def digest(root: Path) -> str:
        return tm_digest(PhraseIndexes.open(root, HashEmbedder()))

    assert digest(tm_dir) == digest(same.root) != digest(other.root)


# -- the wrapper ---------------------------------------------------------------------------------


class PromptEngine:
    """The engine under the stage: records each request (its examples) and answers at once,
    "<n examples>:<text>"."""

    model_version = "fake-model"
    languages = ("en", "de")

    def __init__(self) -> None:
        self.prompts = builder()
        self.calls: list[TranslationRequest] = []
        self.cancelled: list[str] = []

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        self.calls.append(request)
        self.prompts.build(request.text, request.source_lang, request.target_lang,
                           examples=request.examples)  # fmt: skip
        handle = RequestHandle(request.request_id, self.cancelled.append)
        handle.set_result(
            GenerationResult(
                request.request_id,
                [7],
                f"{len(request.examples)}:{request.text}",
                FinishReason.STOP,
                notes={"inner": "kept"},
            )  # fmt: skip
        )
        return handle

    def count_tokens(self, text: str) -> int:
        return len(text)

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float | None = None) -> None: ...


def submit(engine: RetrievedExamplesEngine, text: str, src: str = "en", tgt: str = "de",
           **kw: Any) -> GenerationResult:  # fmt: skip
    handle = engine.submit_translation(TranslationRequest("r1", text, src, tgt, **kw))
    return handle.result(1)


def test_each_request_is_prompted_with_its_retrieved_pairs(tm_dir: Path) -> None:
    inner = PromptEngine()
    engine = RetrievedExamplesEngine(inner, retriever(tm_dir, k=2))
    result = submit(engine, "Where is my order?", deadline=5.0, prompt_form="short_mix8")
    assert result.text == "2:Where is my order?" and result.ok
    (call,) = inner.calls
    assert call.examples[-1] == ("Where is my order?", "Wo ist meine Bestellung?")
    assert call.deadline == 5.0 and call.prompt_form == "short_mix8"  # passed through
    assert result.notes == {"inner": "kept", EXAMPLES_KEY: "2", SIMILARITY_KEY: "1.000"}
    assert engine.outcomes[("de", "retrieved")] == 1 and len(engine.retrieval_seconds) == 1


def test_retrievals_are_counted_in_prometheus_once_bound(tm_dir: Path) -> None:
    from prometheus_client import CollectorRegistry

    from workers.metrics import WorkerMetrics

    worker_metrics = WorkerMetrics(CollectorRegistry())
    engine = RetrievedExamplesEngine(PromptEngine(), retriever(tm_dir, k=2))
    engine.bind_metrics(worker_metrics.stages)  # as the worker binds its stages
    submit(engine, "Where is my order?")
    submit(engine, "Hallo", src="de", tgt="en")
    sample = worker_metrics.registry.get_sample_value
    assert sample("tolk_tm_retrievals_total", {"lang": "de", "outcome": "retrieved"}) == 1
    assert sample("tolk_tm_retrievals_total", {"lang": "en", "outcome": "no_index"}) == 1
    assert sample("tolk_tm_retrieval_seconds_count") == 1  # only a real look-up is timed


def test_a_pair_without_index_is_translated_with_the_fixed_examples(tm_dir: Path) -> None:
    inner = PromptEngine()
    engine = RetrievedExamplesEngine(inner, retriever(tm_dir))
    result = submit(engine, "Hallo", src="de", tgt="en")
    assert result.text == "0:Hallo" and result.notes[NOTE_KEY] == "no_index"
    assert inner.calls[0].examples == ()


def test_a_failing_retrieval_never_loses_the_request(tm_dir: Path) -> None:
    class Broken(ExampleRetriever):
        def retrieve(self, source_lang: str, target_lang: str, text: str) -> Any:
            raise RuntimeError("index file gone")

    inner = PromptEngine()
    engine = RetrievedExamplesEngine(inner, Broken(PhraseIndexes({}), 2))
    result = submit(engine, "Where is my order?")
    assert result.text == "0:Where is my order?" and result.notes[NOTE_KEY] == "error"
    assert engine.outcomes[("de", "error")] == 1


def test_cancel_reaches_the_engine(tm_dir: Path) -> None:
    inner = PromptEngine()
    engine = RetrievedExamplesEngine(inner, retriever(tm_dir))
    engine.submit_translation(
        TranslationRequest(request_id="r9", text="x", source_lang="en", target_lang="de")
    ).cancel()
    assert inner.cancelled == ["r9"]


def test_the_cache_key_tells_the_arms_apart(tm_dir: Path) -> None:
    def fingerprint(retrieved: Any) -> str:  # the cache's key, as the builder composes it
        options = ServingOptions.of(
            Settings(), faithful=False, cache=True, cache_l2=InMemoryTranslationCache(),
            retriever=retrieved,
        )  # fmt: skip
        cache = build_served_engine(PromptEngine(), options).stage("cache")
        assert cache.prompt_form == builder().default_form
        return str(cache.fingerprint)

    prints = {fingerprint(r) for r in (None, retriever(tm_dir, k=2), retriever(tm_dir, k=4))}
    assert len(prints) == 3
    assert "RetrievedExamplesEngine[tm(k=4," in fingerprint(retriever(tm_dir, k=4))


# -- `tolk worker --tm-examples` -----------------------------------------------------------------


def run_worker(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[Any, list[Any]]:
    """`tolk worker ARGS` with the broker check, the engine and the Worker replaced."""
    from typer.testing import CliRunner

    import workers.cli as cli
    import workers.serving.fair_engine as fair_engine
    import workers.worker as worker_module
    from tests.workers.test_cache_engine import RecordingWorker

    built: list[Any] = []
    monkeypatch.setattr(cli, "_check_broker_or_exit", lambda settings: None)
    monkeypatch.setattr(
        fair_engine, "build_fair_engine", lambda *a, **k: built.append(PromptEngine()) or built[0]
    )
    monkeypatch.setattr(worker_module, "Worker", RecordingWorker)
    RecordingWorker.engines = []
    result = CliRunner().invoke(cli.app, ["worker", "--metrics-port", "0", "--no-cache", *args])
    return result, RecordingWorker.engines


def test_tolk_worker_puts_retrieval_innermost_under_the_faithful_checks(
    monkeypatch: pytest.MonkeyPatch, tm_dir: Path
) -> None:
    import workers.stages.examples.stage as tm_engine
    from workers.stages.faithful.stage import FaithfulEngine

    opened = []

    def fake_open(directory: Path, k: int) -> ExampleRetriever:
        opened.append((directory, k))
        return open_retriever(directory, k, embedder=HashEmbedder())

    monkeypatch.setattr(tm_engine, "open_retriever", fake_open)
    result, engines = run_worker(monkeypatch, ["--tm-examples", "3", "--tm-dir", str(tm_dir)])
    assert result.exit_code == 0, result.output
    (served,) = engines
    engine = served.entry
    assert isinstance(engine, FaithfulEngine) and engine.retry  # its retry form still works
    assert isinstance(engine.inner, RetrievedExamplesEngine)
    assert isinstance(engine.inner.inner, PromptEngine) and opened == [(tm_dir, 3)]


def test_tolk_worker_refuses_a_tm_of_another_embedder_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch, tm_dir: Path
) -> None:
    result, engines = run_worker(monkeypatch, ["--tm-examples", "2", "--tm-dir", str(tm_dir)])
    assert result.exit_code == 2 and engines == []
    assert "test/hash-embedder" in result.output and "tolk tm build" in result.output


def test_tolk_worker_without_the_option_has_no_retrieval(monkeypatch: pytest.MonkeyPatch) -> None:
    result, (served,) = run_worker(monkeypatch, ["--no-faithful"])
    assert result.exit_code == 0 and isinstance(served.entry, PromptEngine)


def test_tolk_worker_withholds_by_default_and_takes_the_flag_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers.stages.faithful.stage import FaithfulEngine

    result, (served,) = run_worker(monkeypatch, [])
    assert result.exit_code == 0 and isinstance(served.entry, FaithfulEngine)
    assert served.entry.policy == "withhold"
    result, (served,) = run_worker(monkeypatch, ["--faithful-policy", "flag"])
    assert result.exit_code == 0 and served.entry.policy == "flag"
    result, engines = run_worker(monkeypatch, ["--faithful-policy", "drop"])
    assert result.exit_code == 2 and engines == []  # refused before the model loads
    assert "--faithful-policy" in result.output
