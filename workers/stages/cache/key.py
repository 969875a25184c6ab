"""The exact-match cache's key: which earlier translation may answer a request.

Two requests may share a cached translation only if the same engine would produce the same
text for both, so the key holds everything that decides the output:

* the engine fingerprint: the model version, the A/B arm, the stages inside the cache
  (protected spans, faithful output, ...) and runtime variants that change tokens (int8
  weights); `CachingEngine` builds it (`engine_fingerprint`);
* the prompt-set version (`workers.engine.prompts.prompt_set_version()`: a hash of
  `prompts.json`), so editing a template or its examples retires every entry at once;
* the prompt form the engine uses by default (`EngineConfig.prompt_form`, resolved to the
  form's name by the engine's `PromptBuilder.default_form`; "" for an engine without one):
  the same prompts.json with another form (other examples, zero-shot) gives other
  translations, so an engine started with a `prompt_form` override never shares entries with
  one on the template's default (the builder, workers/serving/pipeline.py, gives the cache
  the engine's default form);
* the source and the target language ("" = detect is a value of its own);
* the text, normalized: Unicode NFC (a composed and a decomposed "ü" are one text) and runs
  of whitespace collapsed to one space, the ends stripped. Case is kept: "ok" and "OK" may
  translate differently, and a cached answer must be the one the engine would give.

The key is a BLAKE2b-128 digest of those fields (separated by a control character no field
holds), so its size does not grow with the text, plus the target language in clear: the L1
cache shares its capacity per language and the L2 TTL depends on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from workers.text_normal import normalize_text  # the phrase index normalizes alike

__all__ = ["KEY_SCHEMA", "CacheKey", "cache_key", "normalize_text"]

KEY_SCHEMA = "2"  # bump when the key's fields or their encoding change (2: the prompt form)
_SEPARATOR = "\x1f"  # unit separator: never in a language code or a fingerprint


@dataclass(frozen=True, slots=True)
class CacheKey:
    """One cache entry's identity: the target language (capacity share, TTL tier) and the
    digest of every field that decides the translation."""

    target_lang: str
    digest: str  # 32 hex characters

    def redis_key(self, prefix: str) -> str:
        """`<prefix><target_lang>:<digest>`: the language in clear, for `redis-cli --scan`."""
        return f"{prefix}{self.target_lang}:{self.digest}"


def cache_key(
    *,
    engine_fingerprint: str,
    prompt_set_version: str,
    source_lang: str,
    target_lang: str,
    text: str,
    prompt_form: str = "",
) -> CacheKey:
    """The key of translating `text` from `source_lang` to `target_lang` with that engine;
    `prompt_form`: the engine's default prompt form ("" when it has none)."""
    fields = (
        KEY_SCHEMA,
        engine_fingerprint,
        prompt_set_version,
        prompt_form,
        source_lang,
        target_lang,
        normalize_text(text),
    )
    for value in fields[:-1]:
        if _SEPARATOR in value:
            raise ValueError(f"cache key field {value!r} holds the separator")
    digest = hashlib.blake2b(_SEPARATOR.join(fields).encode("utf-8"), digest_size=16).hexdigest()
    return CacheKey(target_lang, digest)
