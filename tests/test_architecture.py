"""The import rules of docs/ARCHITECTURE.md, checked on the source (ast, no imports run).

Each package has prefixes it must never import and, optionally, exceptions inside them: the
fair-share logic (`workers/fairness`) may take the engine's boundary types
(`workers.engine.types`) but nothing else of the engine, and no threads; the engine imports
neither the fair-share logic nor the serving package that composes the two. Every import
statement counts, wherever it sits (inside a function, under `TYPE_CHECKING`); `from a import b`
is read as `a.b` and relative imports are resolved against the file's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_KAFKA_REDIS = ("confluent_kafka", "redis", "faust", "prometheus_client", "opentelemetry")
_OUTSIDE_THE_ENGINE = ("workers.worker", "workers.client", "schemas", "topics", "replay")

# package (folder) -> module prefixes it must never import
RULES: dict[str, tuple[str, ...]] = {
    "workers/engine": (
        *_KAFKA_REDIS,
        *_OUTSIDE_THE_ENGINE,
        "workers.fairness",  # the engine owns its FCFS default queue
        "workers.serving",
    ),
    "kernels": ("workers", "schemas", "topics", "replay", "confluent_kafka", "redis"),
    # pure, single-threaded logic: threads and the Engine live in workers/serving
    "workers/fairness": (
        "torch",
        "threading",
        "confluent_kafka",
        "redis",
        "workers.worker",
        "workers.engine",  # except its boundary types and the FCFS queue, see ALLOWED
        "workers.serving",
    ),
    # composes engine and fair share; the worker composes it with Kafka
    "workers/serving": (*_KAFKA_REDIS, *_OUTSIDE_THE_ENGINE),
    # replay talks to workers only through Kafka: of `workers` it may use the pure arm and
    # span helpers and the client settings, never the serving side
    "replay": (
        "workers.worker",
        "workers.engine",
        "workers.engine_runs",
        "workers.reply_publisher",
        "workers.reply_retry",
        "workers.record_intake",
        "workers.serving",
        "workers.protected_engine",
        "workers.faithful_engine",
    ),
    "schemas": ("workers", "torch", "confluent_kafka"),
    "topics": ("workers", "torch"),
}

# package -> module prefixes allowed although a rule above forbids a prefix of them
ALLOWED: dict[str, tuple[str, ...]] = {
    # the deadline rule is one pure module that the scheduler and the admission share
    "workers/fairness": ("workers.engine.types", "workers.engine.fcfs", "workers.engine.deadlines"),
}


def _package_of(path: Path, root: Path) -> list[str]:
    """The package a file belongs to, as parts (for relative imports)."""
    return list(path.relative_to(root).parent.parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports; `from a import b` gives `a.b` (b may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path, root)
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                names.add(module if alias.name == "*" else f"{module}.{alias.name}")
    return names


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(package: str, root: Path = ROOT) -> list[str]:
    """`file imports module` for every import of `package` that its rule forbids."""
    forbidden, allowed = RULES[package], ALLOWED.get(package, ())
    bad = []
    for f in sorted((root / package).rglob("*.py")):
        for mod in sorted(imported_modules(f, root)):
            if any(_matches(mod, p) for p in forbidden) and not any(
                _matches(mod, a) for a in allowed
            ):
                bad.append(f"{f.relative_to(root)} imports {mod}")
    return bad


# single modules of pure logic (shared by the worker and replay): no Kafka, no model, no threads
PURE_MODULES = (
    "workers/arms.py",
    "workers/faithful.py",
    "workers/protected_spans.py",
    "workers/retries.py",
)
_NOT_PURE = ("confluent_kafka", "redis", "faust", "prometheus_client", "torch", "threading")


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_no_io_or_model(module: str) -> None:
    imported = imported_modules(ROOT / module)
    assert imported, f"{module}: the checker found no imports at all"
    bad = sorted(m for m in imported if any(_matches(m, p) for p in _NOT_PURE))
    bad += sorted(m for m in imported if m.startswith("workers.") and "types" not in m)
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_never_imports_forbidden_modules(package: str) -> None:
    assert any((ROOT / package).rglob("*.py")), f"no sources under {package}"
    bad = violations(package)
    assert not bad, "\n".join(bad)


def test_rules_see_real_imports() -> None:
    # guard against a checker that finds nothing: the engine does import torch, and the
    # fair-share queue the engine's request type
    assert "torch" in imported_modules(ROOT / "workers/engine/engine.py")
    assert "workers.engine.types.GenerationRequest" in imported_modules(
        ROOT / "workers/fairness/vtc.py"
    )


def test_rules_catch_each_kind_of_forbidden_import(tmp_path: Path) -> None:
    """A fake fairness package and a fake engine breaking the rules in every way they can."""
    fairness = tmp_path / "workers" / "fairness"
    fairness.mkdir(parents=True)
    (fairness / "ok.py").write_text(
        "from workers.engine.types import GenerationRequest\n"
        "from workers.engine import types\n"
        "from . import policy\n"
        "import numpy as np\n",
        encoding="utf-8",
    )
    (fairness / "bad.py").write_text(
        "import threading\n"
        "from workers.engine.scheduler import AdmissionDecision\n"
        "from workers.engine import engine\n"
        "from ..serving import fair_engine\n"
        "def later():\n"
        "    import torch.nn\n",
        encoding="utf-8",
    )
    engine = tmp_path / "workers" / "engine"
    engine.mkdir()
    (engine / "queue.py").write_text(
        "from workers.fairness.vtc import FCFSQueue\nimport workers.serving.fair_engine\n",
        encoding="utf-8",
    )
    assert violations("workers/fairness", tmp_path) == [
        "workers/fairness/bad.py imports threading",
        "workers/fairness/bad.py imports torch.nn",
        "workers/fairness/bad.py imports workers.engine.engine",
        "workers/fairness/bad.py imports workers.engine.scheduler.AdmissionDecision",
        "workers/fairness/bad.py imports workers.serving.fair_engine",
    ]
    assert violations("workers/engine", tmp_path) == [
        "workers/engine/queue.py imports workers.fairness.vtc.FCFSQueue",
        "workers/engine/queue.py imports workers.serving.fair_engine",
    ]
