"""Each topic's value schema registered in a Schema Registry: `tolk topics create` with
`TOLK_SCHEMA_REGISTRY_URL` (or `--registry`).

A bot's serializer looks the schema up under `<topic>-value` (TopicNameStrategy, the default of
Confluent's, Apicurio's and `@kafkajs/confluent-schema-registry`'s serializers), so every topic
of the catalog with a value schema gets its subject, with BACKWARD compatibility (a reader of
the new schema reads what the old one wrote: the registry refuses a field added without a
default; a subject that exists keeps its rule). A schema already there is left alone; one the
subject's rule refuses stops the command with the registry's own reason (`SubjectRefused`: its
409 answer names the field, e.g. Apicurio's "tenant at /fields/10"); the topics are made only
after every subject is registered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from schemas.codec import builtin_schemas
from schemas.registry import RegistryError, SchemaRegistry, value_subject
from topics.catalog import TopicSpec

__all__ = ["DEFAULT_COMPATIBILITY", "SubjectRefused", "register_subjects"]

DEFAULT_COMPATIBILITY = "BACKWARD"


class SubjectRefused(RuntimeError):
    """The registry refuses a schema under its subject; `reasons` are its own words."""

    def __init__(self, subject: str, reasons: list[str]) -> None:
        super().__init__(f"{subject}: the registry refuses the schema: " + "; ".join(reasons))
        self.subject = subject
        self.reasons = reasons


def register_subjects(
    registry: SchemaRegistry,
    specs: Iterable[TopicSpec],
    *,
    schemas: Mapping[str, Mapping[str, Any]] | None = None,
    compatibility: str = DEFAULT_COMPATIBILITY,
) -> dict[str, str]:
    """subject -> what happened ("registered, id N (BACKWARD)" / "exists, id N") for every
    spec with a value schema; `schemas`: full name -> raw schema (the built-in ones)."""
    known = builtin_schemas() if schemas is None else schemas
    existing = set(registry.subjects())
    out: dict[str, str] = {}
    for spec in specs:
        if not spec.value_schema:
            continue
        subject, schema = value_subject(spec.name), known[spec.value_schema]
        found = registry.lookup(subject, schema) if subject in existing else None
        if found is not None:
            out[subject] = f"exists, id {found}"
            continue
        try:
            schema_id = registry.register(subject, schema)
        except RegistryError as exc:
            if exc.status == 409:  # the registry's own words: which field, which rule
                raise SubjectRefused(subject, [str(exc)]) from None
            raise
        # the rule after the first version (a first version has nothing to be compatible
        # with; Apicurio answers a rule set before it with "artifact already exists" at times);
        # a subject someone made keeps the rule it was given
        if subject not in existing:
            registry.set_compatibility(subject, compatibility)
        out[subject] = f"registered, id {schema_id} ({compatibility})"
    return out
