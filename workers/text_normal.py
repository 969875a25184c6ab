"""The one normalization of a text that two parts must agree on: the translation cache's key
(workers/stages/cache/key.py) and the phrase index's rows (workers/tm/formats.py). A leaf.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["normalize_text"]

_WHITESPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """NFC, whitespace runs (any Unicode space, tabs, newlines) -> one space, ends stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()
