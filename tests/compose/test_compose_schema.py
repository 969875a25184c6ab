"""compose/docker-compose.yml against the Compose Specification's JSON schema, without Docker.

The schema is vendored (`compose/compose-spec.schema.json`, provenance and checksum in
`compose/SCHEMA-SOURCE.md`) and declares draft 2019-09, so the validator is fixed to
`Draft201909Validator` rather than guessed from the misspelt `$schema` URI. The schema forbids
unknown keys in a service (only `x-` extensions), so a typo like `helthcheck:` fails here. The
broken-copy cases prove that the check can fail: each takes the real file and breaks one thing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft201909Validator

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
SCHEMA_FILE = COMPOSE_DIR / "compose-spec.schema.json"
SCHEMA_SOURCE = COMPOSE_DIR / "SCHEMA-SOURCE.md"


@pytest.fixture(scope="module")
def validator() -> Draft201909Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    Draft201909Validator.check_schema(schema)  # the vendored file is itself a valid schema
    return Draft201909Validator(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def error_messages(validator: Draft201909Validator, document: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_schema_file_is_the_recorded_copy():
    recorded = re.search(r"sha256 of the copy \| `([0-9a-f]{64})`", SCHEMA_SOURCE.read_text())
    assert recorded is not None, "compose/SCHEMA-SOURCE.md must record the schema's sha256"
    assert hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest() == recorded.group(1)


def test_compose_file_matches_the_compose_spec(validator, compose):
    assert error_messages(validator, compose) == []
    assert set(compose["services"]) == {"kafka", "redis", "worker", "prometheus"}


def test_unknown_service_key_is_rejected(validator, compose):
    broken = copy.deepcopy(compose)
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")
    errors = error_messages(validator, broken)
    assert len(errors) == 1, errors
    assert errors[0].startswith("services/redis:") and "helthcheck" in errors[0]


def test_unknown_depends_on_condition_is_rejected(validator, compose):
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["depends_on"]["kafka"]["condition"] = "service_ready"
    (error,) = validator.iter_errors(broken)  # depends_on is a oneOf (list or mapping)
    assert list(error.absolute_path) == ["services", "worker", "depends_on"]
    # in the mapping branch, the reason is the condition's enum
    reasons = [c.message for c in error.context or []]
    assert (
        "'service_ready' is not one of ['service_started', 'service_healthy', "
        "'service_completed_successfully']" in reasons
    ), reasons


def test_unknown_top_level_key_is_rejected(validator, compose):
    broken = copy.deepcopy(compose) | {"service": {}}  # singular: a typo
    assert any("'service'" in e for e in error_messages(validator, broken))
