"""Every key the worker writes into a reply's `metadata` map, declared once, with what it says.

A `TranslationResult` reply (schemas/translation_result.avsc) carries a string map `metadata`:
how the answer was made, for the client, the replay report and the dashboards. The serving
stages put their keys into `GenerationResult.notes` (which `workers.kafka.replies` copies, in the
order the stages wrote them) and say the same in the result's declared fields
(`GenerationResult.cache_tier`, `.faithful`, `.retries`...), which is what code reads: the
cache's rule of what it may keep (`workers.stages.cache.policy`) never parses these strings.

Nothing but this module spells a key (tests/workers/test_reply_metadata.py checks the source).
Adding a reply field: docs/ARCHITECTURE.md, "Adding a reply field". Pure: no imports.
"""

from __future__ import annotations

__all__ = ["REPLY_KEYS"]

# -- the reply as a whole (workers/kafka/replies.py)
# ---------------------------------------------------
# why a translation stopped short: `length` (its token cap, set by the reply builder) or
# `length_guard` (the faithfulness stage's cap by the source's length); absent: a stop rule
FINISH_REASON = "tolk.finish_reason"

# -- the exact-match cache (workers/stages/cache/stage.py)
# ---------------------------------------------
CACHE = "tolk.cache"  # how it answered: l1 / l2 (a hit), miss (ran the engine), joined

# -- faithfulness (workers/stages/faithful/stage.py); only on a suspect answer's reply
# -----------------
FAITHFUL = "tolk.faithful"  # the outcome: retried / flagged / withheld
FAITHFUL_FIRST = "tolk.faithful.first"  # what the first run's checks found ("leak,ratio")
FAITHFUL_PROBLEMS = "tolk.faithful.problems"  # what the answer given still has (flag/withhold)
FAITHFUL_RETRY = "tolk.faithful.retry"  # what became of the retry ("suspect too", "off", ...)
FAITHFUL_CANDIDATE = "tolk.faithful.candidate"  # a withheld answer's text

# -- span protection (workers/stages/protected/stage.py); only when the text had spans
# ----------------
SPANS = "tolk.protected_spans"  # restored / skipped / retried_unmasked / flagged
SPANS_COUNT = "tolk.protected_spans.spans"  # how many spans the text had
SPANS_RESTORE_ERROR = "tolk.protected_spans.restore_error"  # why the masked answer failed
SPANS_PRESERVED = "tolk.protected_spans.preserved"  # "found/total" spans in the answer given
SPANS_RETRY = "tolk.protected_spans.retry"  # why the unmasked retry gave no answer

# -- retrieved examples (workers/stages/examples/stage.py)
# ---------------------------------------------------
TM = "tolk.tm"  # no_index / error: the prompt showed no retrieved example, and why
TM_EXAMPLES = "tolk.tm.examples"  # how many retrieved examples the prompt showed
TM_SIMILARITY = "tolk.tm.similarity"  # cosine similarity of the nearest one ("0.873")

# -- conversation context (workers/stages/context/stage.py)
# --------------------------------------------
CONTEXT = "tolk.context"  # "turns=N": history turns in the prompt
CONTEXT_RETRY = "tolk.context.retry"  # why the turn ran again without history

# -- the quality-aware cascade (workers/stages/cascade/stage.py, `--cascade`)
# --------------------------
CASCADE = "tolk.cascade"  # small (kept) / deferred (the large model answered) / deadline
CASCADE_SCORE = "tolk.cascade.score"  # the deferral signal's value ("-0.731"), when computed
CASCADE_REASON = "tolk.cascade.reason"  # why: score / early / check / failed / late
# -- drills (workers/stages/drill/stage.py)
# ------------------------------------------------------------
DRILL = "tolk.drill"  # the faults injected: latency / error / error+latency

REPLY_KEYS: tuple[str, ...] = (
    FINISH_REASON,
    CACHE,
    FAITHFUL,
    FAITHFUL_FIRST,
    FAITHFUL_PROBLEMS,
    FAITHFUL_RETRY,
    FAITHFUL_CANDIDATE,
    SPANS,
    SPANS_COUNT,
    SPANS_RESTORE_ERROR,
    SPANS_PRESERVED,
    SPANS_RETRY,
    TM,
    TM_EXAMPLES,
    TM_SIMILARITY,
    CONTEXT,
    CONTEXT_RETRY,
    CASCADE,
    CASCADE_SCORE,
    CASCADE_REASON,
    DRILL,
)
