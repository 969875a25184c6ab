"""tolk's Avro schema files: their names, the parsed forms every codec shares, fingerprints.

Split out of schemas/codec.py (issue 27: no product file over 400 lines), bodies unchanged;
the codec (wire formats, encode/decode, limits) stays there and re-exports the names, the
error and `schema_fingerprint`.

* The ``*.avsc`` files beside this module are the source of truth: `SCHEMA_FILES` maps each
  built-in schema's full name to its file, `builtin_schemas()` reads them once per process and
  checks each declares the name it is filed under. `PREVIOUS_SCHEMA_FILES` are earlier
  versions every codec knows as writers, so records they wrote still decode.
* A `Writer` is one known writer schema as a codec needs it: its full name, its CRC-64-AVRO
  fingerprint (`schema_fingerprint`: the 8 bytes single-object encoding writes), the parsed
  schema to encode with, the one to decode with (timestamps as plain longs in "millis" mode,
  `Timestamps`), and its wire layout for the size limits (schemas/limits.py). `make_writer`
  builds one, `builtin_writers` the built-ins once per timestamp mode.
* Every failure is a `SchemaError`.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

import fastavro
from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from schemas.limits import WireLayout
from schemas.limits import compile_layout as _compile_layout

__all__ = [
    "ARM_SHARES",
    "DEAD_LETTER",
    "PREVIOUS_SCHEMA_FILES",
    "REQUEST",
    "RESULT",
    "ROLLOUT_EVENT",
    "SCHEMA_FILES",
    "SchemaError",
    "Timestamps",
    "Writer",
    "builtin_schemas",
    "builtin_writers",
    "full_name",
    "make_writer",
    "read_schema_file",
    "schema_fingerprint",
]

# Full names of the built-in schemas.
REQUEST = "tolk.TranslationRequest"
RESULT = "tolk.TranslationResult"
DEAD_LETTER = "tolk.DeadLetter"
ARM_SHARES = "tolk.ArmShares"  # the control topic's values (workers.kafka.arm_control)
ROLLOUT_EVENT = "tolk.RolloutEvent"  # the canary guard's events (workers.guard)

SCHEMA_FILES = {
    REQUEST: "translation_request.avsc",
    RESULT: "translation_result.avsc",
    DEAD_LETTER: "dead_letter.avsc",
    ARM_SHARES: "arm_shares.avsc",
    ROLLOUT_EVENT: "rollout_event.avsc",
}
# Earlier versions of the built-in schemas: known as writers by every codec with the built-in
# schemas, so records they wrote (single-object encoding names its writer) still decode.
PREVIOUS_SCHEMA_FILES = ("translation_result.v1.avsc",)

_TIMESTAMP_TYPES = frozenset(
    {"timestamp-millis", "timestamp-micros", "local-timestamp-millis", "local-timestamp-micros"}
)

Timestamps = Literal["millis", "datetime"]


class SchemaError(ValueError):
    """A value could not be encoded or decoded with tolk's Avro schemas."""


@dataclass(frozen=True, slots=True)
class Writer:
    """One known writer schema."""

    name: str  # full name of the top-level record
    fingerprint: bytes  # 8 bytes as on the wire
    encode_schema: Any  # parsed, with logical types: accepts ints and datetimes
    decode_schema: Any  # parsed, timestamps stripped in "millis" mode
    layout: WireLayout  # for the size check before decoding (schemas/limits.py)


def schema_fingerprint(schema: Mapping[str, Any] | str) -> bytes:
    """CRC-64-AVRO fingerprint of a raw (JSON) schema, as the 8 bytes single-object encoding
    writes (the 64-bit value little-endian)."""
    canonical = to_parsing_canonical_form(schema if isinstance(schema, str) else dict(schema))
    # fastavro's hex string is already the little-endian byte order of the 64-bit value.
    return bytes.fromhex(_fastavro_fingerprint(canonical, "CRC-64-AVRO"))


def full_name(schema: Mapping[str, Any]) -> str:
    name = str(schema["name"])
    namespace = schema.get("namespace")
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def _strip_timestamps(schema: Any) -> Any:
    """A copy of a raw schema whose timestamp logical types are plain longs."""
    if isinstance(schema, dict):
        out = {k: _strip_timestamps(v) for k, v in schema.items()}
        if out.get("logicalType") in _TIMESTAMP_TYPES:
            del out["logicalType"]
        return out
    if isinstance(schema, list):
        return [_strip_timestamps(v) for v in schema]
    return schema


@functools.cache
def read_schema_file(filename: str) -> Mapping[str, Any]:
    raw: Mapping[str, Any] = json.loads(
        resources.files(__package__).joinpath(filename).read_text("utf-8")
    )
    return raw


@functools.cache
def builtin_schemas() -> Mapping[str, Mapping[str, Any]]:
    """The raw (JSON) built-in schemas by full name, read once."""
    out: dict[str, Mapping[str, Any]] = {}
    for name, filename in SCHEMA_FILES.items():
        raw = read_schema_file(filename)
        if full_name(raw) != name:
            raise SchemaError(f"{filename} declares {full_name(raw)}, expected {name}")
        out[name] = raw
    return out


@functools.cache
def builtin_writers(timestamps: Timestamps) -> Mapping[str, Writer]:
    return {name: make_writer(raw, timestamps) for name, raw in builtin_schemas().items()}


def make_writer(raw: Mapping[str, Any], timestamps: Timestamps) -> Writer:
    if not isinstance(raw, Mapping) or raw.get("type") != "record":
        raise SchemaError("a tolk value schema must be a JSON object of type 'record'")
    try:
        raw_copy = copy.deepcopy(dict(raw))
        encode_schema = fastavro.parse_schema(raw_copy)
        if timestamps == "millis":
            decode_schema = fastavro.parse_schema(_strip_timestamps(raw_copy))
        else:
            decode_schema = encode_schema
        fp = schema_fingerprint(raw_copy)
        layout = _compile_layout(raw_copy)
    except Exception as exc:
        raise SchemaError(f"invalid Avro schema {raw.get('name')!r}: {exc}") from exc
    return Writer(full_name(raw), fp, encode_schema, decode_schema, layout)
