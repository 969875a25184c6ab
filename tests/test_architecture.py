"""The import rules of docs/ARCHITECTURE.md, checked on the source (ast, no imports run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package (folder) -> module prefixes it must never import
RULES: dict[str, tuple[str, ...]] = {
    "workers/engine": (
        "confluent_kafka",
        "redis",
        "faust",
        "workers.worker",
        "workers.client",
        "schemas",
        "topics",
        "replay",
        "prometheus_client",
    ),
    "kernels": ("workers", "schemas", "topics", "replay", "confluent_kafka", "redis"),
    # pure logic; admission.py builds an Engine lazily inside build_fair_engine() only
    "workers/fairness": ("torch", "confluent_kafka", "redis", "workers.worker"),
    "replay": ("workers.worker", "workers.engine"),
    "schemas": ("workers", "torch", "confluent_kafka"),
    "topics": ("workers", "torch"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_never_imports_forbidden_modules(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}"
    bad = []
    for f in files:
        for mod in imported_modules(f):
            if any(mod == p or mod.startswith(p + ".") for p in RULES[package]):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_rules_see_real_imports() -> None:
    # guard against a checker that finds nothing: the engine does import torch
    assert "torch" in imported_modules(ROOT / "workers/engine/engine.py")
