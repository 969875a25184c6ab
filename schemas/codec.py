"""Avro encoding of tolk's Kafka record values.

Design notes
------------
* The ``*.avsc`` files beside this module are the source of truth. They are read and parsed
  once per process (``builtin_schemas()``); codecs share the parsed forms. Reading them, the
  fingerprints and the parsed writer forms are ``schemas/schema_files.py``'s (the names,
  ``SchemaError`` and ``schema_fingerprint`` re-exported here); this module is the codec and
  its wire formats.
* Wire format. By default a value is Avro *single-object encoding*: ``C3 01``, the 8-byte
  CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form (little-endian), then
  the Avro binary body. The bytes say which schema wrote them, so a reader can resolve old
  records to its own (newer or older) schema: that is how replaying old logs keeps working.
  Writer schemas other than the current ones are made known with ``register_writer_schema``.
* With a Schema Registry, values use the Confluent wire format instead: ``00``, the 4-byte
  big-endian schema id, the body. The ids come from the deployment (``SchemaIds``), or from a
  live registry (``ids_from``, a ``schemas/registry.py`` ``SchemaRegistry``): a writer id not
  seen yet is fetched once and kept, and ``encode(..., subject=)`` writes the id the registry
  holds for the schema under that subject (looked up once, never registered: workers must not
  register schemas by accident; ``tolk topics create`` does). ``decode`` accepts both formats
  whatever the codec writes.
* Timestamps (``timestamp-millis``) decode as int epoch milliseconds by default: the hot path
  compares them with ``time.time() * 1000`` and needs no datetime objects. ``encode`` takes
  either ints or aware datetimes. ``AvroCodec(timestamps="datetime")`` decodes datetimes.
* Every failure is a ``SchemaError`` (raised ``from`` fastavro's exception), so callers catch
  one type and send the record to the dead-letter topic.
* Limits. Before fastavro sees a body, ``schemas/limits.py`` walks it and rejects one that
  declares a string or bytes value, an array or a map larger than the codec's ``DecodeLimits``
  (or larger than the data it holds), so a crafted record cannot make the decoder allocate
  what it declares (a 2 GB string in a 30-byte record). ``AvroCodec(limits=...)`` configures
  them; the default allows 1 MiB per string, 10,000 items per map or array, nesting 32 deep.

One concern: bytes <-> records for every schema and both wire formats, with the writer-schema
bookkeeping (fingerprints, registry ids) they need; reading the schema files is
``schema_files.py``'s, the body's size check ``limits.py``'s, the registry's HTTP
``registry.py``'s.
"""

from __future__ import annotations

import functools
import io
import json
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import fastavro

from schemas.limits import DEFAULT_LIMITS, BodyScanner, DecodeLimits, LimitExceeded
from schemas.schema_files import (
    ARM_SHARES,
    DEAD_LETTER,
    PREVIOUS_SCHEMA_FILES,
    REQUEST,
    RESULT,
    ROLLOUT_EVENT,
    SchemaError,
    Timestamps,
    Writer,
    builtin_schemas,
    builtin_writers,
    make_writer,
    read_schema_file,
    schema_fingerprint,
)

__all__ = [
    "ARM_SHARES",
    "ROLLOUT_EVENT",
    "DEAD_LETTER",
    "REQUEST",
    "RESULT",
    "AvroCodec",
    "DecodeLimits",
    "SchemaError",
    "SchemaIds",
    "builtin_schemas",
    "decode_arm_shares",
    "decode_dead_letter",
    "decode_request",
    "decode_result",
    "decode_rollout_event",
    "default_codec",
    "encode_arm_shares",
    "encode_dead_letter",
    "encode_request",
    "encode_result",
    "encode_rollout_event",
    "schema_fingerprint",
]

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
SINGLE_OBJECT_HEADER_LEN = 10  # magic (2) + fingerprint (8)
CONFLUENT_MAGIC = 0
CONFLUENT_HEADER_LEN = 5  # magic (1) + schema id (4, big-endian)
FETCH_RETRY_S = 30.0  # an id the registry did not give is asked for again after this
REGISTRY_DOWN_S = 5.0  # a registry not reached is not asked again for this long


class IdSource(Protocol):
    """Where a codec finds registry ids it was not given (`schemas.registry.SchemaRegistry`)."""

    def schema_by_id(self, schema_id: int) -> Mapping[str, Any]: ...

    def lookup(self, subject: str, schema: Mapping[str, Any]) -> int | None: ...


@dataclass(frozen=True)
class SchemaIds:
    """Schema Registry ids fixed by the deployment (a live registry: ``AvroCodec(ids_from=)``).

    ``ids`` maps a schema's full name (``tolk.TranslationRequest``) to the registry id of the
    version this process writes. Ids of older writer versions are given to
    ``AvroCodec.register_writer_schema(schema, schema_id=...)``.
    """

    ids: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, schema_id in self.ids.items():
            if not 0 <= schema_id < 2**31:
                raise ValueError(f"schema id for {name} out of range: {schema_id}")


class AvroCodec:
    """Encodes and decodes tolk's record values (see the module notes for the wire format).

    ``schemas`` are the reader schemas by full name (default: the built-in ones); they are
    also the schemas ``encode`` writes with. A codec is cheap to make and safe to share
    between threads once its writer schemas are registered. ``limits``: what one body may
    declare (checked before decoding, see the module notes).
    """

    def __init__(
        self,
        schemas: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        registry: SchemaIds | None = None,
        ids_from: IdSource | None = None,
        timestamps: Timestamps = "millis",
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        if timestamps not in ("millis", "datetime"):
            raise ValueError(f"timestamps must be 'millis' or 'datetime', not {timestamps!r}")
        self._timestamps: Timestamps = timestamps
        self._scanner = BodyScanner(limits)
        self._registry = registry
        self._ids_from = ids_from
        self._subject_ids: dict[tuple[str, bytes], int] = {}  # (subject, fingerprint) -> id
        self._failed_ids: dict[int, tuple[float, str]] = {}  # id -> (retry after, why)
        self._registry_down_until = 0.0
        # the raw schemas by fingerprint: what a registry lookup sends (`encode(subject=)`)
        self._raw_by_fp: dict[bytes, Mapping[str, Any]] = {}
        if schemas is None:
            readers = dict(builtin_writers(timestamps))
            for name, raw in builtin_schemas().items():
                self._raw_by_fp[readers[name].fingerprint] = raw
        else:
            readers = {}
            for raw in schemas.values():
                writer = make_writer(raw, timestamps)
                readers[writer.name] = writer
                self._raw_by_fp[writer.fingerprint] = raw
        self._readers: dict[str, Writer] = readers
        self._aliases: dict[str, str] = {}
        for name in readers:
            short = name.rsplit(".", 1)[-1]
            self._aliases[name] = name
            self._aliases[short] = name
            self._aliases[_snake(short)] = name
        self._by_fingerprint: dict[bytes, Writer] = {w.fingerprint: w for w in readers.values()}
        self._by_id: dict[int, Writer] = {}
        self._id_of: dict[bytes, int] = {}
        self._by_json: dict[str, Writer] = {}
        if schemas is None:
            for filename in PREVIOUS_SCHEMA_FILES:
                self._writer_for(read_schema_file(filename))
        if registry is not None:
            for name, schema_id in registry.ids.items():
                current = self._readers.get(self._aliases.get(name, name))
                if current is None:
                    raise SchemaError(f"registry id given for unknown schema {name!r}")
                self._by_id[schema_id] = current
                self._id_of[current.fingerprint] = schema_id

    # ------------------------------------------------------------------ schemas

    @property
    def limits(self) -> DecodeLimits:
        """What one body may declare (checked before decoding)."""
        return self._scanner.limits

    @property
    def names(self) -> list[str]:
        """Full names of the reader schemas."""
        return sorted(self._readers)

    def resolve_name(self, name: str) -> str:
        """``tolk.TranslationRequest``, ``TranslationRequest`` or ``translation_request``
        -> the full name."""
        try:
            return self._aliases[name]
        except KeyError:
            raise SchemaError(f"unknown schema {name!r}; known: {', '.join(self.names)}") from None

    def schema(self, name: str) -> Any:
        """The parsed (fastavro) reader schema."""
        return self._readers[self.resolve_name(name)].encode_schema

    def fingerprint(self, name: str) -> bytes:
        """The 8-byte fingerprint of the current schema ``name``."""
        return self._readers[self.resolve_name(name)].fingerprint

    def register_writer_schema(
        self, schema: Mapping[str, Any], *, schema_id: int | None = None
    ) -> bytes:
        """Make another version of a schema known as a writer (older records to decode).

        ``schema`` is a raw JSON schema. ``schema_id`` is its Schema Registry id, for values
        in the Confluent wire format. Returns its fingerprint. Idempotent.
        """
        writer = self._writer_for(schema)
        if schema_id is not None:
            known = self._by_id.get(schema_id)
            if known is not None and known.fingerprint != writer.fingerprint:
                raise SchemaError(f"schema id {schema_id} is already taken by another schema")
            self._by_id[schema_id] = writer
            self._id_of.setdefault(writer.fingerprint, schema_id)
        return writer.fingerprint

    def _writer_for(self, schema: Mapping[str, Any]) -> Writer:
        key = json.dumps(schema, sort_keys=True)
        writer = self._by_json.get(key)
        if writer is None:
            writer = make_writer(schema, self._timestamps)
            writer = self._by_fingerprint.setdefault(writer.fingerprint, writer)
            self._raw_by_fp.setdefault(writer.fingerprint, schema)
            self._by_json[key] = writer
        return writer

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        name_or_schema: str | Mapping[str, Any],
        record: Mapping[str, Any],
        *,
        subject: str | None = None,
    ) -> bytes:
        """Encode ``record`` with the named reader schema or a raw writer schema.

        Fields with defaults may be left out; unknown fields are an error. ``subject``: with a
        live registry (``ids_from``), the id written is the one it holds for the schema under
        that subject (``<topic>-value``).
        """
        if isinstance(name_or_schema, str):
            writer = self._readers[self.resolve_name(name_or_schema)]
        else:
            writer = self._writer_for(name_or_schema)
        if self._ids_from is not None and subject is not None:
            schema_id = self._subject_id(subject, writer)
            header = struct.pack(">bI", CONFLUENT_MAGIC, schema_id)
        elif self._registry is not None:
            configured = self._id_of.get(writer.fingerprint)
            if configured is None:
                raise SchemaError(
                    f"no Schema Registry id configured for {writer.name} "
                    f"(fingerprint {writer.fingerprint.hex()}); the codec never registers schemas"
                )
            header = struct.pack(">bI", CONFLUENT_MAGIC, configured)
        else:
            header = SINGLE_OBJECT_MAGIC + writer.fingerprint
        buf = io.BytesIO()
        buf.write(header)
        try:
            fastavro.schemaless_writer(
                buf, writer.encode_schema, dict(record), strict_allow_default=True
            )
        except Exception as exc:
            raise SchemaError(f"record does not fit {writer.name}: {exc}") from exc
        return buf.getvalue()

    # ------------------------------------------------------------------ decode

    def writer_of(self, data: bytes) -> str:
        """The full name of the schema that wrote ``data`` (from its header)."""
        return self._writer_from_header(data)[0].name

    def decode(self, name: str, data: bytes) -> dict[str, Any]:
        """Decode ``data`` (either wire format) and resolve it to the reader schema ``name``."""
        reader = self._readers[self.resolve_name(name)]
        writer, offset = self._writer_from_header(data)
        if writer.name != reader.name:
            raise SchemaError(f"value was written as {writer.name}, expected {reader.name}")
        reader_schema = None if writer.fingerprint == reader.fingerprint else reader.decode_schema
        return self._read_body(data, offset, writer, reader_schema)

    def decode_any(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """Decode with whatever known schema wrote ``data``: ``(full name, record)``."""
        writer, offset = self._writer_from_header(data)
        reader = self._readers.get(writer.name)
        reader_schema = None
        if reader is not None and reader.fingerprint != writer.fingerprint:
            reader_schema = reader.decode_schema
        return writer.name, self._read_body(data, offset, writer, reader_schema)

    def _writer_from_header(self, data: bytes) -> tuple[Writer, int]:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise SchemaError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < SINGLE_OBJECT_HEADER_LEN:
                raise SchemaError(f"truncated single-object header ({len(data)} bytes)")
            fp = data[2:SINGLE_OBJECT_HEADER_LEN]
            writer = self._by_fingerprint.get(fp)
            if writer is None:
                raise SchemaError(
                    f"unknown writer schema fingerprint {fp.hex()}: written with a schema this "
                    "process does not know (register it with register_writer_schema)"
                )
            return writer, SINGLE_OBJECT_HEADER_LEN
        if data[:1] == bytes([CONFLUENT_MAGIC]):
            if len(data) < CONFLUENT_HEADER_LEN:
                raise SchemaError(f"truncated Confluent wire-format header ({len(data)} bytes)")
            (schema_id,) = struct.unpack(">I", data[1:CONFLUENT_HEADER_LEN])
            writer = self._by_id.get(schema_id)
            if writer is None and self._ids_from is not None:
                writer = self._fetch_writer(schema_id)
            if writer is None:
                configured = "none configured" if not self._by_id else "not configured"
                raise SchemaError(
                    f"unknown Schema Registry id {schema_id} ({configured}); give ids with "
                    "AvroCodec(registry=SchemaIds(...)) or register_writer_schema(schema_id=...)"
                )
            return writer, CONFLUENT_HEADER_LEN
        head = data[:4].hex() or "empty"
        raise SchemaError(
            f"not a tolk Avro value: starts with {head}, expected c301 (single-object "
            "encoding) or 00 (Confluent wire format)"
        )

    def _fetch_writer(self, schema_id: int) -> Writer:
        """The writer schema a live registry gave `schema_id`, fetched once and kept. A failed
        fetch is remembered for `FETCH_RETRY_S` (that id) and a registry not reached for
        `REGISTRY_DOWN_S` (every id): records with ids nobody registered, or a registry that
        hangs, must not cost the worker's poll loop one HTTP call each."""
        assert self._ids_from is not None
        now = time.monotonic()
        failed = self._failed_ids.get(schema_id)
        if failed is not None and now < failed[0]:
            raise SchemaError(f"Schema Registry id {schema_id}: {failed[1]} (remembered)")
        if now < self._registry_down_until:
            raise SchemaError(f"Schema Registry id {schema_id}: the registry was not reached")
        try:
            raw = self._ids_from.schema_by_id(schema_id)
        except Exception as exc:  # RegistryError: the registry's answer, or not reached
            if getattr(exc, "status", None) == 0:
                self._registry_down_until = now + REGISTRY_DOWN_S
            if len(self._failed_ids) >= 10_000:  # ids made up by a broken producer
                self._failed_ids.clear()
            self._failed_ids[schema_id] = (now + FETCH_RETRY_S, str(exc))
            raise SchemaError(f"Schema Registry id {schema_id}: {exc}") from exc
        self.register_writer_schema(raw, schema_id=schema_id)
        return self._by_id[schema_id]

    def _subject_id(self, subject: str, writer: Writer) -> int:
        key = (subject, writer.fingerprint)
        schema_id = self._subject_ids.get(key)
        if schema_id is not None:
            return schema_id
        assert self._ids_from is not None
        raw = self._raw_by_fp.get(writer.fingerprint)
        if raw is None:
            raise SchemaError(f"no raw schema kept for {writer.name}")
        try:
            found = self._ids_from.lookup(subject, raw)
        except Exception as exc:
            raise SchemaError(f"Schema Registry subject {subject!r}: {exc}") from exc
        if found is None:
            raise SchemaError(
                f"{writer.name} is not registered under subject {subject!r} "
                "(tolk topics create registers every topic's schema; workers never do)"
            )
        self._subject_ids[key] = found
        self._by_id.setdefault(found, writer)
        return found

    def _read_body(
        self, data: bytes, offset: int, writer: Writer, reader_schema: Any
    ) -> dict[str, Any]:
        try:
            self._scanner.check(writer.layout, data, offset)
        except LimitExceeded as exc:
            what = "rejected" if exc.over_limit else "malformed"
            raise SchemaError(f"{what} {writer.name} body: {exc}") from exc
        buf = io.BytesIO(data)
        buf.seek(offset)
        try:
            record = fastavro.schemaless_reader(buf, writer.decode_schema, reader_schema)
        except Exception as exc:
            raise SchemaError(f"malformed {writer.name} body: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise SchemaError(
                f"malformed {writer.name} body: {len(data) - buf.tell()} trailing bytes"
            )
        if not isinstance(record, dict):
            raise SchemaError(f"malformed {writer.name} body: not a record")
        return record


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


# ---------------------------------------------------------------------- convenience


@functools.cache
def default_codec() -> AvroCodec:
    """A process-wide codec with the built-in schemas and single-object encoding."""
    return AvroCodec()


def encode_request(record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(REQUEST, record)


def decode_request(data: bytes) -> dict[str, Any]:
    return default_codec().decode(REQUEST, data)


def encode_result(record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(RESULT, record)


def decode_result(data: bytes) -> dict[str, Any]:
    return default_codec().decode(RESULT, data)


def encode_dead_letter(record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(DEAD_LETTER, record)


def decode_dead_letter(data: bytes) -> dict[str, Any]:
    return default_codec().decode(DEAD_LETTER, data)


def encode_arm_shares(record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(ARM_SHARES, record)


def decode_arm_shares(data: bytes) -> dict[str, Any]:
    return default_codec().decode(ARM_SHARES, data)


def encode_rollout_event(record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(ROLLOUT_EVENT, record)


def decode_rollout_event(data: bytes) -> dict[str, Any]:
    return default_codec().decode(ROLLOUT_EVENT, data)
