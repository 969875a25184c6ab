"""Gemma's tokenizer rebuilt from its GGUF: SentencePiece BPE whose merges the file leaves out.

Split out of workers/engine/loader.py (issue 27: no product file over 400 lines), body
unchanged. The loader's GGUF conversion (`loader._convert_gguf`) asks `spm_bpe_tokenizer` first
and falls back to transformers' own GGUF tokenizer when it returns None (a GGUF with merges, or
another tokenizer model). Why it is needed is in the function's notes: transformers reads such
a vocab as a Unigram model scored by what are really BPE merge ranks.

Imports gguf, tokenizers and transformers inside the function (only a conversion needs them).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

__all__ = ["spm_bpe_tokenizer"]


def spm_bpe_tokenizer(path: Path) -> Any | None:
    """A BPE tokenizer for a GGUF holding a SentencePiece-BPE vocab without merges (Gemma).

    transformers 4.57 turns such a vocab into a Unigram model scored by the GGUF scores, but
    those scores are BPE merge ranks (-rank), so it splits words into tiny pieces ("Hello world"
    -> 4 pieces instead of `Hello`, ` world`). We rebuild what SentencePiece (and llama.cpp)
    do: BPE whose merges are ordered by the merged piece's score, byte fallback, control
    tokens as special tokens, user-defined symbols ("\n", "\n\n", html tags) as atomic tokens.
    Returns None when the GGUF carries merges or another tokenizer model (transformers' reader
    is right there).
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    fields = GGUFReader(path).fields

    def values(key: str) -> list[Any]:
        field = fields[key]
        return [field.parts[i] for i in field.data]

    def scalar(key: str) -> Any:
        return fields[key].parts[-1][0] if key in fields else None

    model = bytes(fields["tokenizer.ggml.model"].parts[-1]).decode()
    if model != "llama" or "tokenizer.ggml.merges" in fields:
        return None
    tokens = [bytes(t).decode() for t in values("tokenizer.ggml.tokens")]
    scores = [float(s[0]) for s in values("tokenizer.ggml.scores")]
    types = [int(t[0]) for t in values("tokenizer.ggml.token_type")]  # 1 normal 3 control 4 user
    spaces = [ty == 4 and tok.strip(" ") == "" for tok, ty in zip(tokens, types, strict=True)]
    pieces = ["\u2581" * len(t) if sp else t for t, sp in zip(tokens, spaces, strict=True)]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    mergeable = {
        p: sc for p, sc, ty, sp in zip(pieces, scores, types, spaces, strict=True) if ty == 1 or sp
    }
    merges = generate_merges({p: vocab[p] for p in mergeable}, mergeable)
    special = {int(scalar(f"tokenizer.ggml.{n}_token_id")): n for n in ("bos", "eos", "unknown")
               if scalar(f"tokenizer.ggml.{n}_token_id") is not None}  # fmt: skip
    unk = next((pieces[i] for i, n in special.items() if n == "unknown"), None)
    tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_tokens(
        [
            AddedToken(p, normalized=False, special=ty == 3)
            for p, ty, sp in zip(pieces, types, spaces, strict=True)
            if ty == 3 or (ty == 4 and not sp)
        ]
    )
    named = {n: pieces[i] for i, n in special.items()}
    bos = named.get("bos")
    if bos is not None and bool(scalar("tokenizer.ggml.add_bos_token")):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    pad_id = scalar("tokenizer.ggml.padding_token_id")
    # from a file, not `tokenizer_object=tok`: transformers deep-copies an object it is given,
    # 6 s of a first start for this vocabulary, where writing and reading the file takes ~2 s
    with tempfile.TemporaryDirectory(prefix="tolk-tokenizer-") as tmp:
        tok.save(f"{tmp}/tokenizer.json")
        return PreTrainedTokenizerFast(
            tokenizer_file=f"{tmp}/tokenizer.json",
            bos_token=bos,
            eos_token=named.get("eos"),
            unk_token=unk,
            pad_token=pieces[int(pad_id)] if pad_id is not None else None,
        )
