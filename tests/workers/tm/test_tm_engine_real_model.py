"""Retrieved examples on the real SmolLM2 engine: the language prefix still comes from the
prefix cache, only the examples and the query are prefilled, and the wrapper's requests run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.workers.tm.test_tm_engine import TM_PAIRS, HashEmbedder
from workers.engine.engine import Engine, EngineConfig
from workers.engine.types import TranslationRequest
from workers.stages.examples.stage import EXAMPLES_KEY, ExampleRetriever, RetrievedExamplesEngine
from workers.tm.phrase_index import PhraseIndex, PhraseIndexes
from workers.tm.store import TranslationMemoryDir

pytestmark = pytest.mark.slow

EXAMPLES = [("Where is my order?", "Wo ist meine Bestellung?"), ("Thanks!", "Danke!")]


@pytest.fixture()
def engine(smollm2: Any) -> Engine:
    return Engine(smollm2, EngineConfig(kv_cache_tokens=4096, max_new_tokens=12))


def test_the_warm_prefix_is_reused_and_only_examples_and_query_are_prefilled(
    engine: Engine,
) -> None:
    engine.warm(["de"])
    prefix_len = len(engine.prompts.prefix_ids("de"))
    plain = engine.translation_request("Can you help me?", "en", "de")
    with_examples = engine.translation_request("Can you help me?", "en", "de", examples=EXAMPLES)
    assert with_examples.prompt_ids[:prefix_len] == plain.prompt_ids[:prefix_len]
    assert len(with_examples.prompt_ids) > len(plain.prompt_ids)
    before = engine.stats.prefill_tokens
    (res,) = engine.generate([with_examples])
    assert res.ok and res.text
    assert res.cached_tokens == prefix_len  # the language prefix: from the prefix cache
    assert engine.stats.prefill_tokens - before == res.tokens_in - prefix_len


def test_the_wrapper_translates_through_the_running_engine(engine: Engine, tmp_path: Path) -> None:
    tm = TranslationMemoryDir(tmp_path / "tm")
    tm.add(TM_PAIRS)
    PhraseIndex.build(tm.index_dir("en", "de"), tm.load_pairs("en", "de"), HashEmbedder())
    retriever = ExampleRetriever(PhraseIndexes.open(tm.root, HashEmbedder()), 2)
    wrapped = RetrievedExamplesEngine(engine, retriever)
    wrapped.start()
    try:
        result = wrapped.submit_translation(
            TranslationRequest(
                request_id="r1", text="Where is my order?", source_lang="en", target_lang="de"
            )
        ).result(120)
    finally:
        wrapped.stop()
    assert result.ok and result.notes[EXAMPLES_KEY] == "2"
    assert result.tokens_in > len(engine.prompts.build("Where is my order?", "en", "de")[0])
