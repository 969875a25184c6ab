"""Translation memory (issue #15): what the service remembers of earlier translations.

* The exact-match cache: `cache_key` (the key: engine fingerprint, prompt-set version,
  languages, normalized text), `cache_policy` (which results may be cached), `lru_k` (L1: a
  language-aware LRU-K in the worker), `redis_cache` (L2: Redis shared by all workers, TTL per
  language tier, a circuit breaker for outages). `workers.stages.cache.stage.CachingEngine` puts
  them
  in front of the engine.
* The phrase index of retrieved examples: `formats` (TMX / TSV / replay JSONL readers into
  `TMPair`), `store` (the TM directory), `embed` (all-MiniLM-L6-v2), `phrase_index` (faiss
  IVF-PQ per language pair, memory-mapped), `cli` (`tolk tm import|build|query|status`).
  `workers.stages.examples.stage.RetrievedExamplesEngine` puts the nearest pairs into each prompt.

The cache's pure modules (`cache_key`, `cache_policy`, `lru_k`) import no Kafka, Redis, torch,
metrics or worker code; `redis_cache` imports redis only when a `RedisTranslationCache` is
built.
"""
