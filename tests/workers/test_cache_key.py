"""The exact-match cache's key (workers/stages/cache/key.py): what makes two requests the same."""

from __future__ import annotations

import pytest

from workers.stages.cache.key import cache_key, normalize_text

BASE = {
    "engine_fingerprint": "gemma3-270m|FairEngine|",
    "prompt_set_version": "abc123",
    "source_lang": "de",
    "target_lang": "en",
}


def key_of(text: str, **changes: str) -> str:
    return cache_key(**{**BASE, **changes, "text": text}).digest


def test_normalize_composes_unicode_and_collapses_whitespace_but_keeps_case() -> None:
    decomposed = "Gru\u0308\u00dfe"  # u + combining diaeresis
    assert normalize_text(decomposed) == "Grüße"
    assert normalize_text("  Vielen \t Dank.\n\u00a0 ") == "Vielen Dank."
    assert normalize_text("OK") != normalize_text("ok")


def test_texts_equal_after_normalization_share_a_key() -> None:
    assert key_of("Vielen  Dank.") == key_of(" Vielen Dank.\n") == key_of("Vielen\u00a0Dank.")
    assert key_of("Gru\u0308\u00dfe") == key_of("Grüße")
    assert key_of("Vielen Dank.") != key_of("vielen Dank.")  # case kept
    assert key_of("Vielen Dank.") != key_of("Vielen Dank")  # punctuation kept


@pytest.mark.parametrize(
    "field, other",
    [
        ("engine_fingerprint", "gemma3-270m|FairEngine|arm=B"),
        ("prompt_set_version", "def456"),
        ("prompt_form", "zero_shot"),  # an EngineConfig.prompt_form override
        ("source_lang", ""),
        ("target_lang", "fr"),
    ],
)
def test_every_field_that_decides_the_output_changes_the_key(field: str, other: str) -> None:
    assert key_of("Ja, bitte.") != key_of("Ja, bitte.", **{field: other})


def test_fields_cannot_be_shifted_into_each_other() -> None:
    # without a separator "de"+"en" and "d"+"een" would concatenate alike
    assert key_of("x", source_lang="de", target_lang="en") != key_of(
        "x", source_lang="d", target_lang="een"
    )


def test_key_carries_the_target_language_and_a_fixed_size_digest() -> None:
    key = cache_key(**BASE, text="Ja." * 1000)
    assert key.target_lang == "en" and len(key.digest) == 32
    assert key.redis_key("tolk:tm:") == f"tolk:tm:en:{key.digest}"


def test_a_field_holding_the_separator_is_refused() -> None:
    with pytest.raises(ValueError, match="separator"):
        cache_key(**{**BASE, "engine_fingerprint": "a\x1fb"}, text="x")


PURE_CACHE_IMPORTS = ("workers.engine.types", "workers.stages.cache.", "workers.text_normal")


@pytest.mark.parametrize(
    "module",
    [
        "workers/stages/cache/key.py",
        "workers/stages/cache/policy.py",
        "workers/stages/cache/lru_k.py",
    ],
)
def test_the_pure_cache_modules_import_no_io_model_or_worker(module: str) -> None:
    from tests.test_architecture import ROOT, imported_modules

    imported = imported_modules(ROOT / module)
    io = ("confluent_kafka", "redis", "prometheus_client", "torch", "faust")
    bad = sorted(m for m in imported if m.split(".")[0] in io)
    bad += sorted(
        m for m in imported if m.startswith("workers.") and not m.startswith(PURE_CACHE_IMPORTS)
    )
    assert not bad, f"{module} imports {bad}"


def test_the_prompt_set_version_is_a_hash_of_prompts_json() -> None:
    import hashlib
    from pathlib import Path

    from workers.engine import prompts

    data = (Path(prompts.__file__).parent / "prompts.json").read_bytes()
    assert prompts.prompt_set_version() == hashlib.sha256(data).hexdigest()[:16]
