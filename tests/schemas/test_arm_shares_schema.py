"""The control topic's value, `ArmShares` (schemas/arm_shares.avsc): round trip, the codec's
checks, and evolution both ways (a later field with a default)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from schemas.codec import (
    ARM_SHARES,
    AvroCodec,
    SchemaError,
    builtin_schemas,
    decode_arm_shares,
    encode_arm_shares,
)

RECORD: dict[str, Any] = {
    "language": "de",
    "shares": {"A": 30.0, "B": 70.0},
    "updated_at": 1_767_225_600_000,
    "updated_by": "ops@host",
}


def _with_reason_field() -> dict[str, Any]:
    v2 = copy.deepcopy(dict(builtin_schemas()[ARM_SHARES]))
    v2["fields"].append({"name": "reason", "type": ["null", "string"], "default": None})
    return v2


def test_round_trip_keeps_shares_exactly():
    data = encode_arm_shares(RECORD)
    assert data[:2] == b"\xc3\x01"  # single-object encoding, like every tolk value
    assert decode_arm_shares(data) == RECORD
    default = {**RECORD, "language": "*", "shares": {"A": 100.0 / 3, "B": 200.0 / 3}}
    assert decode_arm_shares(encode_arm_shares(default))["shares"] == default["shares"]


def test_records_that_do_not_fit_are_schema_errors():
    with pytest.raises(SchemaError):
        encode_arm_shares({**RECORD, "shares": {"A": "thirty"}})
    with pytest.raises(SchemaError):
        encode_arm_shares({k: v for k, v in RECORD.items() if k != "updated_by"})
    with pytest.raises(SchemaError):
        decode_arm_shares(encode_arm_shares(RECORD)[:-3])


def test_new_reader_reads_old_records():
    new_reader = AvroCodec({ARM_SHARES: _with_reason_field()})
    new_reader.register_writer_schema(builtin_schemas()[ARM_SHARES])
    decoded = new_reader.decode(ARM_SHARES, encode_arm_shares(RECORD))
    assert decoded == {**RECORD, "reason": None}


def test_old_reader_reads_new_records():
    v2 = _with_reason_field()
    new_writer = AvroCodec({ARM_SHARES: v2})
    old_reader = AvroCodec()
    old_reader.register_writer_schema(v2)
    data = new_writer.encode(ARM_SHARES, {**RECORD, "reason": "canary step 2"})
    assert old_reader.decode(ARM_SHARES, data) == RECORD
