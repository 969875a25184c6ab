"""topics/subjects.py and `tolk topics create --registry`: every topic's value schema under
`<topic>-value` with BACKWARD compatibility, nothing registered twice, and a refused change
stopping the command with the registry's own reason before any topic is made (against the
in-memory registry of tests/schemas/fake_registry.py)."""

from __future__ import annotations

import copy
import uuid

import pytest
from typer.testing import CliRunner

from schemas.codec import REQUEST, builtin_schemas
from schemas.registry import SchemaRegistry, value_subject
from tests.registry_fixtures import schema_registry_url  # noqa: F401
from tests.schemas.fake_registry import serve
from topics.catalog import catalog
from topics.subjects import SubjectRefused, register_subjects


def test_every_topic_with_a_value_schema_gets_its_subject_once() -> None:
    specs = catalog(("de", "en"))
    with serve() as (fake, url):
        registry = SchemaRegistry(url)
        first = register_subjects(registry, specs)
        expected = {value_subject(s.name) for s in specs if s.value_schema}
        assert set(first) == expected and len(expected) >= 4
        assert all(what.startswith("registered, id ") for what in first.values())
        assert set(fake.compatibility.values()) == {"BACKWARD"}
        again = register_subjects(registry, specs)
        assert all(what.startswith("exists, id ") for what in again.values())
        assert sorted(registry.subjects()) == sorted(expected)


def _breaking_request_schema() -> dict:
    schema = copy.deepcopy(dict(builtin_schemas()[REQUEST]))
    schema["fields"] = [*schema["fields"], {"name": "tenant", "type": "string"}]
    return schema


def test_a_refused_change_names_the_subject_and_the_registrys_reason() -> None:
    specs = [s for s in catalog(("de",)) if s.name.endswith(".de")]
    with serve() as (_, url):
        registry = SchemaRegistry(url)
        register_subjects(registry, specs)
        schemas = {**builtin_schemas(), REQUEST: _breaking_request_schema()}
        with pytest.raises(SubjectRefused) as err:
            register_subjects(registry, specs, schemas=schemas)
        assert err.value.subject == "tolk.requests.de-value"
        assert "tenant" in str(err.value) and "default" in str(err.value)


def test_the_cli_prints_the_refusal_and_makes_no_topic() -> None:
    from workers.cli import app

    with serve() as (fake, url):
        # the subject already holds a schema the built-in one may not follow (BACKWARD)
        registry = SchemaRegistry(url)
        registry.register("tolk.requests.de-value", _breaking_request_schema())
        fake.compatibility["tolk.requests.de-value"] = "FULL"
        result = CliRunner().invoke(
            app,
            ["topics", "create", "-l", "de", "--registry", url],
            env={"TOLK_BOOTSTRAP": "127.0.0.1:1"},  # never reached: refused before the broker
        )
    assert result.exit_code == 1, result.output
    assert "tolk.requests.de-value" in result.output and "refuses" in result.output


@pytest.mark.registry
def test_the_stacks_registry_refuses_a_breaking_change_and_the_cli_prints_why(
    schema_registry_url: str,  # noqa: F811
) -> None:
    """The same against the local stack's registry (Apicurio): its own reason, printed."""
    from workers.cli import app

    prefix = f"ts{uuid.uuid4().hex[:8]}."
    subject = f"{prefix}tolk.requests.de-value"
    registry = SchemaRegistry(schema_registry_url)
    registry.set_compatibility(subject, "FULL")
    registry.register(subject, _breaking_request_schema())  # tolk's schema lacks its field
    result = CliRunner().invoke(
        app,
        ["topics", "create", "-l", "de", "--registry", schema_registry_url],
        env={"TOLK_BOOTSTRAP": "127.0.0.1:1", "TOLK_TOPIC_PREFIX": prefix},
    )
    assert result.exit_code == 1, result.output
    assert subject in result.output and "409" in result.output
    assert "tenant" in result.output  # the field the registry names
