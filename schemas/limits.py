"""Size limits on Avro bodies, checked before anything is decoded.

Why: an Avro body declares its sizes up front. A string or bytes value is a varint length and
then the bytes; an array or map is a sequence of blocks, each a varint item count (negative:
followed by the block's byte size) and then the items. A decoder that trusts those numbers can
be made to allocate far more than the record's size: a 20-byte record may declare a 2 GB
string, or a map of a billion entries whose values take no bytes (null), and fastavro builds
what is declared. Requests come from any producer that can write to a topic, so the worker
must not trust them.

How: `compile_layout(schema)` turns a raw (JSON) writer schema into a tree of small nodes once
per writer schema; `BodyScanner(limits).check(layout, data, offset)` walks a body with it,
reading only varints
and skipping over values by index arithmetic, and raises `LimitExceeded` when a declared
length or count is over `DecodeLimits`, runs past the end of the data, or a union or enum
index is out of range. Nothing is allocated in proportion to a declared size: the scan costs
O(encoded size) time and O(schema depth) memory. Only bodies that pass are handed to fastavro
(`schemas/codec.py`).

The limits apply per value: every string and bytes value (`max_string_bytes`), every array or
map over all its blocks (`max_collection_items`), and the nesting of records, arrays, maps and
unions (`max_depth`, which also bounds recursive schemas).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_LIMITS",
    "BodyScanner",
    "DecodeLimits",
    "LimitExceeded",
    "WireLayout",
    "compile_layout",
]


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """What one Avro body may declare."""

    max_string_bytes: int = 1 << 20  # per string or bytes value (Kafka's default record: 1 MB)
    max_collection_items: int = 10_000  # per array or map, over all its blocks
    max_depth: int = 32  # nesting of records, arrays, maps and unions

    def __post_init__(self) -> None:
        for name in ("max_string_bytes", "max_collection_items", "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")


DEFAULT_LIMITS = DecodeLimits()


class LimitExceeded(ValueError):
    """A body declares more than the limits allow (`over_limit`), or more than it holds or
    what its schema allows (malformed)."""

    def __init__(self, message: str, over_limit: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.over_limit = over_limit
        self.path: list[str] = []  # field names, innermost first (filled while unwinding)

    def __str__(self) -> str:
        where = ".".join(reversed(self.path))
        return f"{where}: {self.message}" if where else self.message


# Node kinds. A node is a tuple (kind, arg); records are a mutable class so that a recursive
# schema can refer to itself.
_NULL, _BOOL, _VARINT, _FLOAT, _DOUBLE, _BYTES, _FIXED, _ENUM = range(8)
_ARRAY, _MAP, _UNION, _RECORD = range(8, 12)

_PRIMITIVES = {
    "null": (_NULL, None),
    "boolean": (_BOOL, None),
    "int": (_VARINT, None),
    "long": (_VARINT, None),
    "float": (_FLOAT, None),
    "double": (_DOUBLE, None),
    "bytes": (_BYTES, None),
    "string": (_BYTES, None),  # on the wire a string is bytes (UTF-8)
}


class _Record:
    __slots__ = ("fields", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.fields: list[tuple[str, Any]] = []


def _full_name(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _compile(schema: Any, names: dict[str, Any], namespace: str) -> Any:
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        for candidate in (_full_name(schema, namespace), schema):
            if candidate in names:
                return names[candidate]
        raise ValueError(f"unknown Avro type {schema!r}")
    if isinstance(schema, list):
        return (_UNION, tuple(_compile(branch, names, namespace) for branch in schema))
    if not isinstance(schema, Mapping):
        raise ValueError(f"not an Avro schema: {schema!r}")
    kind = schema.get("type")
    if kind == "record" or kind == "error":
        full = _full_name(str(schema["name"]), str(schema.get("namespace", namespace)))
        record = _Record(full)
        names[full] = (_RECORD, record)
        inner_ns = full.rpartition(".")[0]
        record.fields = [
            (str(f["name"]), _compile(f["type"], names, inner_ns)) for f in schema["fields"]
        ]
        return names[full]
    if kind == "enum":
        node = (_ENUM, len(schema["symbols"]))
    elif kind == "fixed":
        node = (_FIXED, int(schema["size"]))
    elif kind == "array":
        return (_ARRAY, _compile(schema["items"], names, namespace))
    elif kind == "map":
        return (_MAP, _compile(schema["values"], names, namespace))
    else:
        return _compile(kind, names, namespace)  # {"type": "long", "logicalType": ...}
    names[_full_name(str(schema["name"]), str(schema.get("namespace", namespace)))] = node
    return node


@dataclass(frozen=True, slots=True)
class WireLayout:
    """One writer schema compiled for scanning (`compile_layout`)."""

    root: Any  # the top node


def compile_layout(schema: Mapping[str, Any]) -> WireLayout:
    """The scan tree of the raw (JSON) writer schema `schema`; ValueError when unreadable."""
    return WireLayout(_compile(schema, {}, ""))


class BodyScanner:
    """Checks bodies against `DecodeLimits` (see the module notes); stateless, thread-safe."""

    def __init__(self, limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits

    def check(self, layout: WireLayout, data: bytes, offset: int = 0) -> int:
        """Walk the body at `data[offset:]` written with `layout`'s schema; returns where it
        ends, raises `LimitExceeded`."""
        try:
            return self._scan(layout.root, data, offset, 0)
        except IndexError:
            raise LimitExceeded("the body ends in the middle of a value") from None

    def _long(self, data: bytes, pos: int) -> tuple[int, int]:
        """A zig-zag varint at `pos`: (value, next position)."""
        shift = result = 0
        while True:
            byte = data[pos]  # IndexError past the end: truncated
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1), pos
            shift += 7
            if shift > 63:
                raise LimitExceeded("a varint longer than 10 bytes")

    def _skip(self, data: bytes, pos: int, size: int, what: str) -> int:
        if size > len(data) - pos:
            raise LimitExceeded(
                f"declares {size} bytes of {what} but only {len(data) - pos} remain"
            )
        return pos + size

    def _scan(self, node: Any, data: bytes, pos: int, depth: int) -> int:
        kind, arg = node
        if kind <= _ENUM:  # leaves
            if kind == _NULL:
                return pos
            if kind == _VARINT:
                return self._long(data, pos)[1]
            if kind == _BYTES:
                size, pos = self._long(data, pos)
                if size < 0:
                    raise LimitExceeded(f"a negative length ({size})")
                if size > self.limits.max_string_bytes:
                    raise LimitExceeded(
                        f"declares a {size}-byte string/bytes value, over the limit of "
                        f"{self.limits.max_string_bytes} bytes",
                        over_limit=True,
                    )
                return self._skip(data, pos, size, "string/bytes")
            if kind == _ENUM:
                index, pos = self._long(data, pos)
                if not 0 <= index < arg:
                    raise LimitExceeded(f"enum index {index} out of range (0..{arg - 1})")
                return pos
            size = {_BOOL: 1, _FLOAT: 4, _DOUBLE: 8}.get(kind, arg)  # _FIXED: its size
            return self._skip(data, pos, size, "fixed-size value")
        depth += 1
        if depth > self.limits.max_depth:
            raise LimitExceeded(
                f"nested deeper than {self.limits.max_depth} levels", over_limit=True
            )
        if kind == _RECORD:
            fields = arg.fields
            index = 0
            try:
                for index in range(len(fields)):
                    pos = self._scan(fields[index][1], data, pos, depth)
            except LimitExceeded as exc:
                exc.path.append(fields[index][0])
                raise
            return pos
        if kind == _UNION:
            index, pos = self._long(data, pos)
            if not 0 <= index < len(arg):
                raise LimitExceeded(f"union branch {index} out of range (0..{len(arg) - 1})")
            return self._scan(arg[index], data, pos, depth)
        return self._scan_blocks(kind, arg, data, pos, depth)

    def _scan_blocks(self, kind: int, item: Any, data: bytes, pos: int, depth: int) -> int:
        """An array's or a map's blocks; the item count is checked before any item."""
        total = 0
        what = "array" if kind == _ARRAY else "map"
        while True:
            count, pos = self._long(data, pos)
            if count == 0:
                return pos
            if count < 0:  # a block with its byte size: -count items, then the size
                count = -count
                block_bytes, pos = self._long(data, pos)
                if block_bytes < 0:
                    raise LimitExceeded(f"a {what} block of negative size ({block_bytes})")
                self._skip(data, pos, block_bytes, f"{what} block")
            total += count
            if total > self.limits.max_collection_items:
                raise LimitExceeded(
                    f"declares a {what} of {total}+ items, over the limit of "
                    f"{self.limits.max_collection_items}",
                    over_limit=True,
                )
            for _ in range(count):
                if kind == _MAP:
                    pos = self._scan((_BYTES, None), data, pos, depth)  # the key
                pos = self._scan(item, data, pos, depth)
