"""`tolk demo`: the shipped sample, the message pick, and one short run on the real stack."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from tests.kafka_fixtures import kafka_bootstrap, redis_url, unique_name  # noqa: F401
from workers import demo
from workers.demo import load_sample, main, pick_messages


def test_sample_is_shipped_with_its_licenses() -> None:
    data = resources.files("workers").joinpath("data")
    names = {p.name for p in data.iterdir()}
    assert {"support_sample.jsonl", "SOURCE.md", "LICENSE-CC-BY-SA-4.0"} <= names
    assert "LICENSE-TATOEBA.md" in names
    sample = load_sample()
    assert len(sample) >= 60
    assert len({m.id for m in sample}) == len(sample)
    pairs = {(m.source_lang, m.target_lang) for m in sample}
    assert {("de", "en"), ("en", "de"), ("en", "fr"), ("en", "es"), ("en", "it")} <= pairs
    assert all(m.text.strip() and m.reference.strip() for m in sample)


def test_pick_round_robins_over_target_languages() -> None:
    sample = load_sample()
    picked = pick_messages(sample, 10, ["en", "de", "fr", "es", "it"])
    assert [m.target_lang for m in picked] == ["en", "de", "fr", "es", "it"] * 2
    only_de = pick_messages(sample, 5, ["de"])
    assert [m.id for m in only_de] == [m.id for m in sample if m.target_lang == "de"][:5]
    assert len(pick_messages(sample, 10_000, ["fr"])) == 6  # all there is


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.redis
def test_demo_runs_end_to_end_on_the_stack(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOLK_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("TOLK_REDIS_URL", redis_url)
    # Topics, group and probe port of this run only: `tolk demo` has fixed ones, and another
    # run on the shared broker (a second session, a person's demo) would share its group.
    monkeypatch.setattr(demo, "DEMO_PREFIX", unique_name("demo") + ".")
    monkeypatch.setattr(demo, "DEMO_GROUP", unique_name("tolk-demo"))
    monkeypatch.setenv("TOLK_HEALTH_PORT", "0")
    lines: list[str] = []
    rc = main(model="smollm2-135m", count=8, languages=["de", "en", "fr"], echo=lines.append)
    out = "\n".join(lines)
    assert rc == 0, out
    assert "[8/8]" in out.replace("[  8/8]", "[8/8]")
    # every message answered: translated, or withheld by the faithfulness guards with the
    # reason and the candidate shown (SmolLM2 answers some chat turns instead of translating)
    summary = re.search(r"summary: (\d+)/8 translated, (\d+) withheld as unfaithful, 0 failed", out)
    assert summary is not None, out
    assert int(summary[1]) + int(summary[2]) == 8 and int(summary[1]) >= 4, out
    assert out.count("(withheld: unfaithful translation withheld: ") == int(summary[2]), out
    assert "p50 ms" in out and "de->en" in out
