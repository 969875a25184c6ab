"""The fast GGUF field parse (workers/engine/gguf_parse.py) builds the reader's own parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workers.engine import gguf_parse


def _fields(reader: Any) -> dict[str, tuple[Any, ...]]:
    """Every field as (types, data indices, parts as (dtype, shape, bytes)): what a caller sees."""
    return {
        name: (
            tuple(f.types),
            tuple(f.data),
            tuple((p.dtype.str, p.shape, p.tobytes()) for p in f.parts),
        )
        for name, f in reader.fields.items()
    }


def _parse_both(path: Path) -> tuple[dict[str, Any], dict[str, Any], Any]:
    import gguf

    slow = _fields(gguf.GGUFReader(path))
    with gguf_parse.one_gguf_parse():
        fast_reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is fast_reader  # one parse serves every caller
        fast = _fields(fast_reader)
    assert gguf.GGUFReader.__name__ == "GGUFReader"  # patched only within the context
    return slow, fast, fast_reader


def test_the_fast_parse_gives_the_readers_own_fields_on_every_value_kind(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_uint32("llama.block_count", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "", "héllo", "\n", "▁the" * 30])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 3.0, 1e-9])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 4, 1])
    writer.add_array("test.empty", [])  # (the writer leaves an empty array out)
    writer.add_array("test.nested", [[1, 2], [3]])  # the reader's own code path
    writer.add_array("test.flags", [True, False, True])
    writer.add_tensor("w", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    slow, fast, reader = _parse_both(path)
    assert fast == slow
    assert reader.fields["tokenizer.ggml.tokens"].contents() == [
        "<s>", "", "héllo", "\n", "▁the" * 30
    ]  # fmt: skip
    assert reader.fields["tokenizer.ggml.scores"].contents()[2] == pytest.approx(-2.25)
    np.testing.assert_array_equal(reader.tensors[0].data, np.arange(8).reshape(2, 4))


@pytest.mark.slow
def test_the_fast_parse_gives_the_readers_own_fields_on_gemma3s_gguf() -> None:
    """262,144 tokens, scores and token types: the arrays the fast path exists for."""
    from workers.engine.loader import resolve_source

    _, path = resolve_source("gemma3-270m")
    slow, fast, _ = _parse_both(path)
    assert len(fast["tokenizer.ggml.tokens"][1]) == 262144
    assert fast == slow


def test_the_fast_value_is_transformers_own_on_every_value_kind() -> None:
    from transformers.integrations.ggml import _gguf_parse_value

    cases = [
        (np.frombuffer("héllo ▁x".encode(), dtype=np.uint8), [9, 8]),
        (np.frombuffer(b"", dtype=np.uint8), 8),
        (np.array([7], dtype=np.uint32), 4),
        (np.array([-3], dtype=np.int64), [9, 11]),
        (np.array([-2.5], dtype=np.float32), [9, 6]),
        (np.array([1.25], dtype=np.float64), 12),
        (np.array([True]), 7),
    ]
    for value, kind in cases:
        got = gguf_parse._fast_value(value, kind, _gguf_parse_value)
        want = _gguf_parse_value(value, kind)
        assert got == want and type(got) is type(want), (kind, got, want)
    # what it does not know goes to the slow one
    assert gguf_parse._fast_value(np.array([1]), [9, 9, 4], lambda v, t: "slow") == "slow"
