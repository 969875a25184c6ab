"""`CharTokenizer`: one token per character (id = code point), so decode(encode(t)) == t; the
tokenizer of the prompt builder's and the stages' pure tests (no model). With `chatml=True` it
also knows the ChatML markers, as SmolLM2's tokenizer does."""

from __future__ import annotations


class CharTokenizer:
    def __init__(self, chatml: bool = False) -> None:
        self.vocab = {"<|im_start|>": 1, "<|im_end|>": 2} if chatml else {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def convert_tokens_to_ids(self, tokens: str) -> int | None:
        return self.vocab.get(tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab
