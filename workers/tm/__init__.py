"""Translation memory (issue #15): the phrase index of retrieved examples.

`formats` (TMX / TSV / replay JSONL readers into `TMPair`), `store` (the TM directory), `embed`
(all-MiniLM-L6-v2), `phrase_index` (faiss IVF-PQ per language pair, memory-mapped), `cli`
(`tolk tm import|build|query|status`). `workers.stages.examples.stage.RetrievedExamplesEngine`
puts the nearest pairs into each prompt.

The exact-match translation cache lives in `workers/stages/cache/` (key, policy, L1 LRU-K, L2
Redis, the stage), not here.
"""
