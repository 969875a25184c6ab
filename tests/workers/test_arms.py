"""Routing to arms, pure logic (workers/arms.py): the hash, cumulative shares, mirror, named
arms, the default entry, tombstones, and the share and name checks."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from schemas.wire import WireRequest
from workers.arms import (
    DEFAULT_LANGUAGE,
    MIRROR_METADATA_KEY,
    ShareTable,
    arm_model_version,
    bucket,
    choose_arm,
    named_arm,
    parse_share_args,
    route_request,
    routing_key,
    split_arm,
    validate_arm_name,
    validate_shares,
)

KEYS = [f"conv-{i:05d}" for i in range(20_000)]


def request(**kw: Any) -> WireRequest:
    base: dict[str, Any] = {
        "request_id": "r-1",
        "conversation_id": "conv-1",
        "source_lang": "en",
        "target_lang": "de",
        "text": "x",
        "created_at": 0,
        "reply_topic": "tolk.replies",
    }
    return WireRequest(**{**base, **kw})


def arms_serving(req: WireRequest, table: ShareTable, arms=("A", "B"), lang="de") -> set[str]:
    return {a for a in arms if route_request(req, arm=a, lang=lang, table=table).serve}


def key_with_bucket(low: float, high: float) -> str:
    return next(k for k in KEYS if low <= bucket(k) < high)


# -- the hash -------------------------------------------------------------------------------------


def test_bucket_is_the_contracts_blake2b_and_pinned():
    # Pinned: a change of the hash would move every conversation to another arm, and the
    # replay job (another process) must compute the same bucket.
    assert bucket("conv-1") == pytest.approx(60.11535271499797, abs=1e-12)
    assert bucket("r-1") == pytest.approx(49.06258616745009, abs=1e-12)
    digest = hashlib.blake2b(b"conv-1", digest_size=8).digest()
    assert bucket("conv-1") == int.from_bytes(digest, "big") / 2**64 * 100


def test_bucket_is_uniform_on_0_100():
    values = [bucket(k) for k in KEYS]
    assert min(values) >= 0.0 and max(values) < 100.0
    deciles = [0] * 10
    for v in values:
        deciles[int(v // 10)] += 1
    # 20,000 keys: each decile ~2,000 (binomial sd ~42); 10 % slack is > 4 sd
    assert all(1800 <= n <= 2200 for n in deciles), deciles


# -- cumulative shares ----------------------------------------------------------------------------


def test_cumulative_shares_in_sorted_name_order():
    shares = {"B": 70.0, "A": 30.0}  # dict order must not matter: A (sorted first) gets [0, 30)
    low, high = key_with_bucket(0, 30), key_with_bucket(30, 100)
    assert choose_arm(shares, low) == "A"
    assert choose_arm(shares, high) == "B"
    assert choose_arm({"A": 30.0, "B": 70.0}, low) == "A"
    edge = key_with_bucket(29.9, 30.1)
    assert choose_arm(shares, edge) == ("A" if bucket(edge) < 30 else "B")


def test_split_follows_the_shares_and_zero_shares_get_nothing():
    shares = {"A": 30.0, "B": 70.0, "C": 0.0}
    chosen = [choose_arm(shares, k) for k in KEYS]
    assert chosen.count("C") == 0
    assert abs(chosen.count("A") / len(KEYS) - 0.30) < 0.01
    assert abs(chosen.count("B") / len(KEYS) - 0.70) < 0.01
    assert choose_arm({"A": 0.0}, "x") is None


def test_shares_a_hair_under_100_still_place_every_key():
    shares = validate_shares({"A": 33.333, "B": 33.333, "C": 33.329})  # 99.995: within tolerance
    assert bucket("k-10386") >= 99.995  # above the cumulative total: the last arm takes it
    assert choose_arm(shares, "k-10386") == "C"
    assert all(choose_arm(shares, k) in ("A", "B", "C") for k in KEYS)


def test_a_share_change_moves_only_the_band_that_moved():
    before = {"A": 30.0, "B": 70.0}
    after = {"A": 40.0, "B": 60.0}
    moved = [k for k in KEYS if choose_arm(before, k) != choose_arm(after, k)]
    assert moved, "some keys must move"
    assert all(30 <= bucket(k) < 40 for k in moved)
    assert all(choose_arm(after, k) == "A" for k in moved)


# -- route_request --------------------------------------------------------------------------------


def test_shares_route_each_request_to_exactly_one_arm():
    table = ShareTable({"de": {"A": 30.0, "B": 70.0}})
    for k in KEYS[:500]:
        served = arms_serving(request(conversation_id=k), table)
        assert served == {choose_arm({"A": 30.0, "B": 70.0}, k)}


def test_routing_key_is_conversation_then_request_then_record_key():
    assert routing_key(request(conversation_id="c", request_id="r")) == "c"
    assert routing_key(request(conversation_id=None, request_id="r")) == "r"
    assert routing_key(None, b"k-1") == "k-1"
    assert routing_key(None) == ""
    table = ShareTable({"de": {"A": 50.0, "B": 50.0}})
    k = key_with_bucket(0, 50)  # A's half
    assert arms_serving(request(conversation_id=None, request_id=k), table) == {"A"}
    # an undecodable record (None as request) is routed by its key like its request would be
    undecodable = {
        a
        for a in "AB"
        if route_request(None, arm=a, lang="de", table=table, record_key=k.encode()).serve
    }
    assert undecodable == {"A"}


def test_mirror_is_answered_by_every_arm():
    table = ShareTable({"de": {"A": 100.0, "B": 0.0}})
    mirrored = request(metadata={MIRROR_METADATA_KEY: "1"})
    assert arms_serving(mirrored, table) == {"A", "B"}
    assert route_request(mirrored, arm="B", lang="de", table=table).rule == "mirror"
    assert arms_serving(request(metadata={MIRROR_METADATA_KEY: "0"}), table) == {"A"}


def test_a_named_arm_alone_answers():
    table = ShareTable({"de": {"A": 100.0, "B": 0.0}})
    assert arms_serving(request(model_version="gemma3-270m@B"), table) == {"B"}
    assert arms_serving(request(model_version="B"), table) == {"B"}  # B is in the table
    # an arm that no worker runs: nobody answers (the replay report shows it unanswered)
    assert arms_serving(request(model_version="x@C"), table) == set()
    # a plain version that names no arm is an ordinary wanted version: shares decide
    assert arms_serving(request(model_version="gemma3-270m"), table) == {"A"}
    assert named_arm("C", arm="C", known=frozenset()) == "C"  # its own name, even untabled
    assert named_arm(None, arm="A", known=frozenset({"A"})) is None


def test_the_default_entry_covers_languages_without_their_own():
    table = ShareTable({DEFAULT_LANGUAGE: {"A": 0.0, "B": 100.0}, "fr": {"A": 100.0}})
    assert arms_serving(request(), table, lang="de") == {"B"}
    assert arms_serving(request(), table, lang="fr") == {"A"}


def test_a_tombstone_falls_back_to_the_default_then_to_every_arm():
    table = ShareTable({DEFAULT_LANGUAGE: {"B": 100.0}, "de": {"A": 100.0}})
    assert arms_serving(request(), table) == {"A"}
    no_de = table.with_entry("de", None)
    assert arms_serving(request(), no_de) == {"B"}
    empty = no_de.with_entry(DEFAULT_LANGUAGE, None)
    assert not empty
    assert arms_serving(request(), empty) == {"A", "B"}
    assert route_request(request(), arm="A", lang="de", table=empty).rule == "unconfigured"
    assert arms_serving(request(), table) == {"A"}  # the original table is unchanged


def test_share_table_is_immutable():
    source = {"de": {"A": 100.0}}
    table = ShareTable(source)
    source["de"]["A"] = 0.0  # the caller's dict changing later does not reach the table
    assert table.shares_for("de") == {"A": 100.0}
    with pytest.raises(TypeError):
        table.entries["fr"] = {"A": 100.0}  # type: ignore[index]
    assert table.arms() == frozenset({"A"})


# -- names, versions, share checks ----------------------------------------------------------------


def test_model_version_carries_the_arm_and_splits_back():
    assert arm_model_version("gemma3-270m", "B") == "gemma3-270m@B"
    assert arm_model_version("gemma3-270m", None) == "gemma3-270m"
    assert split_arm("gemma3-270m@B") == ("gemma3-270m", "B")
    assert split_arm("gemma3-270m") == ("gemma3-270m", None)
    assert split_arm("@B") == ("", "B")
    assert split_arm("") == ("", None)


@pytest.mark.parametrize("bad", ["", "a@b", "a b", "-a", "x" * 65])
def test_bad_arm_names_are_refused(bad):
    with pytest.raises(ValueError):
        validate_arm_name(bad)


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ({"A": 30.0, "B": 60.0}, "sum to 100"),
        ({"A": -10.0, "B": 110.0}, "within 0..100"),
        ({"A": float("nan"), "B": 100.0}, "within 0..100"),
        ({}, "empty"),
        ({"a@b": 100.0}, "invalid arm name"),
    ],
)
def test_invalid_shares_are_refused(shares, message):
    with pytest.raises(ValueError, match=message):
        validate_shares(shares)


def test_parse_share_args():
    assert parse_share_args(["A=30", "B=70"]) == {"A": 30.0, "B": 70.0}
    assert parse_share_args(["A=33.5", "B=66.5"]) == {"A": 33.5, "B": 66.5}
    for bad, message in [
        (["A30", "B=70"], "ARM=PERCENT"),
        (["A=x", "B=70"], "not a number"),
        (["A=30", "A=70"], "twice"),
        (["A=30"], "sum to 100"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_share_args(bad)
