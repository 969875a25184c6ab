"""The serving pipeline (workers/serving/pipeline.py, what `tolk worker` serves): the declared
order, a drill that changes every reply of its arm (also a turn with history on a `--context`
arm, which goes around the cache, and a cache hit), a stage added through the declared list
only (docs/ARCHITECTURE.md, "Adding a stage"), and no stage built anywhere else.

The drill once sat inside the context engine: a context arm's turns with history skipped it,
so a rollback drill injected less than it said. The pipeline here is the real one (the fake
engine stands for the fair engine; the context stage builds prompts with the real Gemma 3
tokenizer; the cache's L2 is in memory).
"""

from __future__ import annotations

import ast
import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.workers.fakes import FakeEngine, fake_translation
from workers.engine.prompts import PromptBuilder
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
)
from workers.metrics import WorkerMetrics
from workers.serving.pipeline import (
    STAGES,
    Build,
    ServedEngine,
    ServingOptions,
    Stage,
    build_served_engine,
)
from workers.settings import Settings
from workers.stages.cache.redis_l2 import InMemoryTranslationCache
from workers.stages.cascade.rules import CascadeThresholds
from workers.stages.cascade.stage import CascadeSetup
from workers.stages.context.stage import CONTEXT_NOTE, ContextEngine
from workers.stages.drill.stage import DRILL_NOTE_KEY, DrillEngine
from workers.stages.wrapper import EngineWrapper

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gemma_prompts() -> PromptBuilder:
    from transformers import AutoTokenizer

    from workers.engine.loader import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("gemma3-270m"))
    return PromptBuilder(tokenizer, "gemma3", tokenizer.bos_token_id, {tokenizer.eos_token_id})


def _served(prompts: PromptBuilder, **options: Any) -> tuple[ServedEngine, FakeEngine]:
    engine = FakeEngine(languages=("en", "de"))
    settings = Settings(languages=("en", "de"), cache_l1_entries=100)
    opts = ServingOptions.of(
        settings,
        faithful=False,
        cache=True,
        cache_l2=InMemoryTranslationCache(),
        context=True,
        **options,
    )
    served = build_served_engine(engine, opts, base=SimpleNamespace(prompts=prompts))
    served.start()
    return served, engine


def _turn(served: Any, rid: str, conversation: str, text: str) -> GenerationResult:
    request = TranslationRequest(rid, text, "en", "de", conversation_id=conversation)
    return served.submit_translation(request).result(10)  # type: ignore[no-any-return]


def _chain(served: ServedEngine) -> list[str]:
    """The class names from the outermost stage down to the engine."""
    names, node = [], served.entry
    while isinstance(node, EngineWrapper):
        names.append(type(node).__name__)
        node = node.inner
    return [*names, type(node).__name__]


def test_the_declared_order() -> None:
    assert [s.name for s in STAGES] == [
        "drill", "context", "cache", "protect_spans", "faithful", "examples", "cascade",
    ]  # fmt: skip
    large = FakeEngine(model_version="large-1")
    thresholds = CascadeThresholds("s", "l", "large_logprob", {}, pooled=-1.0, defer_share=0.3)
    options = ServingOptions.of(
        Settings(),
        faithful=True, protect_spans=True, cache=True, cache_l2=InMemoryTranslationCache(),
        context=True, drill_errors=("de:0.5",), retriever=SimpleNamespace(key_note="tm(test)"),
        cascade=CascadeSetup(large, thresholds),
    )  # fmt: skip
    prompts = SimpleNamespace(retry_form="short_mix8", default_form="support8")
    served = build_served_engine(FakeEngine(), options, base=SimpleNamespace(prompts=prompts))
    assert _chain(served) == [
        "DrillEngine", "ContextEngine", "CachingEngine", "ProtectedSpansEngine",
        "FaithfulEngine", "RetrievedExamplesEngine", "CascadeEngine", "FakeEngine",
    ]  # fmt: skip
    assert served.stage("cascade").large is large
    context = served.stage("context")
    assert context.uncached is served.stage("cache").inner  # turns with history skip the cache
    assert served.stage("faithful").retry_form == "short_mix8"  # from the engine's prompts
    assert served.stage("cache").fingerprint.endswith(
        "|ProtectedSpansEngine>FaithfulEngine>RetrievedExamplesEngine[tm(test)]>"
        "CascadeEngine[cascade=large-1,signal=large_logprob,share=0.3]>FakeEngine|"
    )


def test_the_drill_is_outermost_and_the_context_engine_next(gemma_prompts: PromptBuilder) -> None:
    served, _ = _served(gemma_prompts, drill_errors=("de:1.0",))
    try:
        assert isinstance(served.entry, DrillEngine)
        assert isinstance(served.entry.inner, ContextEngine)
    finally:
        served.stop()


def test_an_error_drill_fails_every_turn_of_a_context_arm(gemma_prompts: PromptBuilder) -> None:
    served, engine = _served(gemma_prompts, drill_errors=("de:1.0",))
    try:
        first = _turn(served, "a1", "conv-A", "Hello there.")  # no history: through the cache
        in_context = _turn(served, "a2", "conv-A", "How can I help?")  # history: around it
        hit = _turn(served, "b1", "conv-B", "Hello there.")  # a cache hit (a1's answer)
    finally:
        served.stop()
    assert in_context.notes[CONTEXT_NOTE] == "turns=1"  # it did take the contextual path
    assert hit.notes["tolk.cache"] == "l1"
    assert engine.submitted == ["a1", "a2"]  # the engine ran both, and answered OK
    for result in (first, in_context, hit):
        assert result.finish_reason == FinishReason.ERROR, result
        assert result.error == "drill: injected error"
        assert result.notes[DRILL_NOTE_KEY] == "error"


def test_a_latency_drill_delays_a_turn_with_history(gemma_prompts: PromptBuilder) -> None:
    served, _ = _served(gemma_prompts, drill_latency=("de:1.0:400",))
    try:
        _turn(served, "a1", "conv-A", "Hello there.")
        started = time.monotonic()
        in_context = _turn(served, "a2", "conv-A", "How can I help?")
        waited = time.monotonic() - started
    finally:
        served.stop()
    assert in_context.ok and in_context.notes[CONTEXT_NOTE] == "turns=1"
    assert in_context.notes[DRILL_NOTE_KEY] == "latency"
    assert waited >= 0.4


def test_no_stage_on_serves_the_engine_itself() -> None:
    engine = FakeEngine(languages=("en", "de"))
    served = build_served_engine(
        engine, ServingOptions.of(Settings(languages=("en", "de")), faithful=False)
    )
    assert served.entry is engine and served.stages == {}
    assert served.queue_snapshot is None  # not a fair engine: the worker's gauges skip it
    assert served.loop_heartbeat is None and served.warmed_languages is None


# -- adding a stage (docs/ARCHITECTURE.md, "Adding a stage"), carried out once -------------------


class ShoutingEngine(EngineWrapper):
    """A new stage: every answer in capitals; counts its answers in the worker's metrics."""

    key_note = "shout"  # its answers differ: the cache must key on it

    def __init__(self, inner: TranslationEngine) -> None:
        self.inner = inner
        self.metrics: Any = None

    def bind_metrics(self, metrics: Any) -> None:
        self.metrics = metrics

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        inner = self.inner.submit_translation(request)
        outer = RequestHandle(request.request_id, lambda _rid: inner.cancel())
        inner.add_done_callback(
            lambda r: outer.set_result(dataclasses.replace(r, text=r.text.upper()))
        )
        return outer


def test_a_new_stage_joins_through_the_declared_list_only() -> None:
    shout = Stage("shout", lambda o: bool(o.extra.get("shout")), lambda inner, b: _shout(inner, b))
    at = [s.name for s in STAGES].index("protect_spans")  # inside the cache: hits skip it
    stages = (*STAGES[:at], shout, *STAGES[at:])
    options = ServingOptions.of(
        Settings(),
        faithful=False, cache=True, cache_l2=InMemoryTranslationCache(), protect_spans=True,
        extra={"shout": True},
    )  # fmt: skip
    engine = FakeEngine()
    engine.start()
    served = build_served_engine(engine, options, stages=stages)
    try:
        assert _chain(served) == [
            "CachingEngine", "ShoutingEngine", "ProtectedSpansEngine", "FakeEngine",
        ]  # fmt: skip
        request = TranslationRequest("s1", "good morning", "en", "de")
        first = served.submit_translation(request).result(5)
        again = served.submit_translation(dataclasses.replace(request, request_id="s2"))
        assert first.text == fake_translation("good morning", "de").upper()
        assert again.result(5).notes["tolk.cache"] == "l1" and engine.submitted == ["s1"]
        assert "ShoutingEngine[shout]>ProtectedSpansEngine" in served.stage("cache").fingerprint
        metrics = WorkerMetrics(CollectorRegistry()).stages
        served.bind_metrics(metrics)  # the worker's binding reaches the new stage
        assert served.stage("shout").metrics is metrics
    finally:
        served.stop()
    # off unless its option says so
    plain = build_served_engine(FakeEngine(), ServingOptions.of(Settings()), stages=stages)
    assert "shout" not in plain.stages


def _shout(inner: TranslationEngine, b: Build) -> TranslationEngine:
    return ShoutingEngine(inner)


# -- nothing else builds a stage -----------------------------------------------------------------

STAGE_MODULES = {
    "workers/serving/pipeline.py",
    "workers/stages/cache/stage.py",
    "workers/stages/context/stage.py",
    "workers/stages/drill/stage.py",
    "workers/stages/faithful/stage.py",
    "workers/stages/protected/stage.py",
    "workers/stages/examples/stage.py",
    "workers/stages/cascade/stage.py",
    "workers/stages/wrapper.py",
}
STAGE_CLASSES = {
    "CachingEngine", "ContextEngine", "DrillEngine", "FaithfulEngine", "ProtectedSpansEngine",
    "RetrievedExamplesEngine", "CascadeEngine", "ServedEngine", "EngineWrapper",
}  # fmt: skip
# the factories of the old inline assembly: gone, and must not come back elsewhere
OLD_FACTORIES = {
    "faithful", "protect_spans", "with_translation_cache", "with_conversation_context",
    "with_drills", "compose_served",
}  # fmt: skip


def stage_constructions(path: Path, root: Path = ROOT) -> list[str]:
    """Where `path` builds or defines a stage: a call of a stage class or an old factory, a
    class deriving from a stage class, an assignment of an engine's `prompt_history` hook."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        name = ""
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name not in STAGE_CLASSES | OLD_FACTORIES:
                name = ""
        elif isinstance(node, ast.ClassDef):
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            }
            name = next(iter(bases & STAGE_CLASSES), "")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name = node.attr if node.attr == "prompt_history" else ""
        if name:
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} {name}"))
    return [hit for _, hit in sorted(found)]


def product_and_bench_files(root: Path = ROOT) -> list[Path]:
    files = [*(root / "workers").rglob("*.py"), *(root / "bench").rglob("*.py")]
    return sorted(f for f in files if str(f.relative_to(root)) not in STAGE_MODULES)


def test_no_product_or_bench_code_builds_a_stage_outside_the_builder() -> None:
    files = product_and_bench_files()
    assert len(files) > 50 and ROOT / "workers/cli.py" in files  # the scan sees the tree
    assert [hit for f in files for hit in stage_constructions(f)] == []


def test_the_scan_catches_each_kind_of_construction(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from workers.stages.cache.stage import CachingEngine\n"
        "import workers.stages.faithful.stage as fe\n"
        "engine = CachingEngine(inner, l1_capacity=1)\n"
        "guarded = fe.FaithfulEngine(engine)\n"
        "served = with_translation_cache(engine, settings)\n"
        "class Mine(EngineWrapper): ...\n"
        "base.prompt_history = hook\n"
    )
    assert stage_constructions(bad, tmp_path) == [
        "bad.py:3 CachingEngine", "bad.py:4 FaithfulEngine", "bad.py:5 with_translation_cache",
        "bad.py:6 EngineWrapper", "bad.py:7 prompt_history",
    ]  # fmt: skip


def test_a_switch_of_weight_format_rekeys_the_cache_and_keeps_the_arm() -> None:
    """After the tuner moved the engine to another weight format (workers/engine/tuner.py), the
    cache keys new answers by it: an int8 answer is never served as a float32 one."""
    from workers.worker_start import cache_variant

    options = ServingOptions.of(
        Settings(arm="b"), faithful=False, cache=True, cache_l2=InMemoryTranslationCache(),
        cache_variant=cache_variant(SimpleNamespace(quantize="int8", dtype=None)),
    )  # fmt: skip
    served = build_served_engine(FakeEngine(), options)
    before = served.stage("cache").fingerprint
    assert before.endswith("|arm=b,quantize=int8")
    served.set_cache_variant(cache_variant(SimpleNamespace(quantize=None, dtype="bfloat16")))
    after = served.stage("cache").fingerprint
    assert after == before.replace("quantize=int8", "quantize=,dtype=bfloat16")
    build_served_engine(FakeEngine(), ServingOptions.of(Settings())).set_cache_variant(
        "quantize=int8"
    )  # no cache stage: nothing to rekey
