"""A GGUF's metadata parsed once, fast: what a first start's conversion spends most of its time on.

The conversion (`loader._convert_gguf`) reads a GGUF through transformers (config, tokenizer,
tensors) and our tokenizer reader (`gguf_tokenizer.py`), and each of them opens the file with
`gguf.GGUFReader`. Two costs, both in that reader's metadata parse, both removed here for the
duration of `one_gguf_parse()`:

- **parsed again by every caller**: transformers opens the file three times, our tokenizer once.
  Within the context one parsed reader serves every caller (it is read-only once parsed;
  transformers imports the class at call time, so the patched name reaches it);
- **one numpy view per array element**, built by a recursive per-element call: Gemma 3's
  tokenizer arrays hold 3 x 262,144 elements, ~1 M views and 0.8 M recursive calls, 12-19 s of
  a first start on an AMD EPYC (family 25 model 1), most of the conversion. `_fast_field_parts`
  builds the same parts (the same values, dtypes and shapes, tests/engine/test_gguf_parse.py
  holds them equal to the reader's own on a written file and on the real Gemma GGUF): the
  elements of a scalar array as the rows of one reshaped view (made in C), a string array's
  lengths read with `struct` in one pass. Nested arrays and a byte-swapped file go through
  the reader's own code.

transformers then turns every field into Python values, one call per array element
(`_gguf_parse_value`, whose string case builds a list of the bytes first): `_fast_value` gives
the same values without that (7 s of the conversion).

The file is read into memory instead of `np.memmap`-ped (a memmap's per-slice overhead was most
of a parse; the copy is dropped with the reader when the context ends).

Imports gguf and numpy inside the functions (only a conversion needs them).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["one_gguf_parse"]

_U64 = struct.Struct("<Q")


@contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within: `gguf.GGUFReader` parses each file once, from memory, with the fast field
    parts; the reader's own class and functions are back when the context ends."""
    import gguf
    import gguf.gguf_reader as gguf_reader
    import numpy as np

    class _InMemory:  # gguf_reader's `np`, with `memmap` reading the file instead
        def __getattr__(self, name: str) -> Any:
            return getattr(np, name)

        @staticmethod
        def memmap(path: Any, mode: str = "r", **kw: Any) -> Any:
            if mode != "r":
                return np.memmap(path, mode=mode, **kw)  # type: ignore[call-overload]
            return np.fromfile(path, dtype=np.uint8)

    cls = gguf_reader.GGUFReader
    original, original_np, original_parts = gguf.GGUFReader, gguf_reader.np, cls._get_field_parts
    parsed: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in parsed:
            parsed[key] = original(path, mode)  # type: ignore[arg-type]
        return parsed[key]

    def fast_parts(self: Any, orig_offs: int, raw_type: int) -> Any:
        return _fast_field_parts(self, orig_offs, raw_type, original_parts)

    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    original_value = hf_gguf._gguf_parse_value

    def fast_value(value: Any, data_type: Any) -> Any:
        return _fast_value(value, data_type, original_value)

    gguf.GGUFReader = reader  # type: ignore[misc, assignment]
    gguf_reader.np = _InMemory()  # type: ignore[assignment]
    cls._get_field_parts = fast_parts  # type: ignore[method-assign]
    hf_gguf._gguf_parse_value = fast_value
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
        gguf_reader.np = original_np
        cls._get_field_parts = original_parts  # type: ignore[method-assign]
        hf_gguf._gguf_parse_value = original_value


_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})  # GGUFValueType: (u)int8..64
_FLOAT_TYPES = frozenset({6, 12})
_BOOL, _STRING, _ARRAY = 7, 8, 9


def _fast_value(value: Any, data_type: Any, slow: Any) -> Any:
    """transformers' `_gguf_parse_value` (one metadata value from its parts) for a scalar or an
    array's element, the same value without its per-call list and type dispatch: a string as
    `bytes(part).decode()` where it builds `array("B", list(part))` first (7 s of Gemma 3's
    conversion, called once per vocabulary entry and field). Anything else goes to `slow`."""
    types = data_type if isinstance(data_type, list) else [data_type]
    if len(types) == 2 and types[0] == _ARRAY:
        kind = types[1]
    elif len(types) == 1:
        kind = types[0]
    else:
        return slow(value, data_type)
    if kind == _STRING:
        return bytes(value).decode()
    if kind in _INT_TYPES:
        return int(value[0])
    if kind in _FLOAT_TYPES:
        return float(value[0])
    if kind == _BOOL:
        return bool(value[0])
    return slow(value, data_type)


def _fast_field_parts(reader: Any, orig_offs: int, raw_type: int, slow: Any) -> Any:
    """`GGUFReader._get_field_parts` for an array of scalars or strings, without a view and a
    call per element: (size in bytes, parts, indices of the value parts, types), as the
    reader's own. Anything else (scalars, nested arrays, a byte-swapped file) goes to `slow`."""
    import numpy as np
    from gguf.constants import GGUFValueType

    gtype = GGUFValueType(raw_type)
    if gtype != GGUFValueType.ARRAY or reader.byte_order != "I" or sys.byteorder != "little":
        return slow(reader, orig_offs, raw_type)
    data = reader.data
    offs = orig_offs
    raw_itype = reader._get(offs, np.uint32)
    alen = reader._get(offs + raw_itype.nbytes, np.uint64)
    offs += int(raw_itype.nbytes) + int(alen.nbytes)
    itype, count = GGUFValueType(raw_itype[0]), int(alen[0])
    types = [gtype, itype] if count else [gtype]  # the reader records the item type from item 0
    parts: list[Any] = [raw_itype, alen]
    nptype = reader.gguf_scalar_to_np.get(itype)
    if nptype is not None:
        size = count * np.dtype(nptype).itemsize
        items = data[offs : offs + size].view(nptype).reshape(count, 1)
        parts += list(items)  # rows of one view: each a [1] array, as `_get` returns
        return offs + size - orig_offs, parts, list(range(2, 2 + count)), types
    if itype != GGUFValueType.STRING:
        return slow(reader, orig_offs, raw_type)
    view = memoryview(data)
    index: list[int] = []
    for _ in range(count):
        (length,) = _U64.unpack_from(view, offs)
        parts.append(data[offs : offs + 8].view(np.uint64))
        parts.append(data[offs + 8 : offs + 8 + length])
        index.append(len(parts) - 1)
        offs += 8 + length
    return offs - orig_offs, parts, index, types
