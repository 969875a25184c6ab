"""The import rules of docs/ARCHITECTURE.md, checked on the source (ast, no imports run).

Besides imports: no import cycle, the layer order (`LAYERS`), the file-length rule, and no
request or result field read by string key outside schemas/ (`string_key_reads`).

Each package has prefixes it must never import and, optionally, exceptions inside them: the
fair-share logic (`workers/fairness`) may take the engine's boundary types
(`workers.engine.types`) but nothing else of the engine, and no threads; the engine imports
neither the fair-share logic nor the serving package that composes the two. Every import
statement counts, wherever it sits (inside a function, under `TYPE_CHECKING`); `from a import b`
is read as `a.b` and relative imports are resolved against the file's package.
"""

from __future__ import annotations

import ast
import json
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
        "workers.kafka.engine_runs",
        "workers.kafka.reply_publisher",
        "workers.kafka.reply_retry",
        "workers.kafka.intake",
        "workers.serving",
        "workers.stages.protected.stage",
        "workers.stages.faithful.stage",
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


# single modules of pure logic (shared by the worker and replay): no Kafka, no model, no threads;
# they import nothing of the project but types and each other
PURE_MODULES = (
    "workers/arms.py",
    "workers/text/language.py",
    "workers/stages/faithful/names.py",
    "workers/stages/faithful/numbers.py",
    "workers/stages/faithful/rules.py",
    "workers/stages/faithful/spans.py",
    "workers/text/spans.py",
    "workers/kafka/engine_retries.py",
)
_PURE_NAMES = {m.removesuffix(".py").replace("/", ".") for m in PURE_MODULES}
_NOT_PURE = ("confluent_kafka", "redis", "faust", "prometheus_client", "torch", "threading")


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_no_io_or_model(module: str) -> None:
    imported = imported_modules(ROOT / module)
    assert imported, f"{module}: the checker found no imports at all"
    bad = sorted(m for m in imported if any(_matches(m, p) for p in _NOT_PURE))
    bad += sorted(
        m
        for m in imported
        if m.startswith("workers.")
        and "types" not in m
        and not any(_matches(m, p) for p in _PURE_NAMES)
    )
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


# -- no import cycle, no product file over 400 lines (issue 27) ---------------------------------
#
# The import graph's nodes are the modules of product code and bench; an edge a -> b for every
# import statement of a that names b or something inside b, wherever it sits: at module level,
# inside a function, under `TYPE_CHECKING`. A function-level import still ties the two modules
# together (each needs the other to work, and one cannot be read or moved without the other),
# and an import under `TYPE_CHECKING` still means one module's types are declared by the
# other's; so every one counts, and the cure for a cycle is a module both sides import, never a
# late import. `import a.b.c` is an edge to `a.b.c` only, not to the packages `a` and `a.b`
# whose `__init__` it also runs (a package's `__init__` that re-exports its modules would
# otherwise be a cycle with each of them).

CYCLE_ROOTS = ("workers", "topics", "schemas", "kernels", "replay", "bench")
PRODUCT = ("workers", "topics", "schemas", "kernels", "replay")
MAX_LINES = 600  # the test's limit
REVIEW_LINES = 400  # past this a file says in its opening docstring why it is one concern

# The cap is a smell detector, not a shape (issue #46: no class cut in two to fit it). A
# product file over REVIEW_LINES keeps its length only with a reason a reviewer can read: its
# module docstring holds a paragraph starting "One concern" that says why it is not split.
ONE_CONCERN = "One concern"


def module_files(root: Path = ROOT, packages: tuple[str, ...] = CYCLE_ROOTS) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `packages` (a package is its __init__)."""
    found: dict[str, Path] = {}
    for package in packages:
        for f in sorted((root / package).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = CYCLE_ROOTS) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (the longest known prefix of each name)."""
    files = module_files(root, packages)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, f in files.items():
        targets = {known(name) for name in imported_modules(f, root)}
        if f.name == "__init__.py":  # relative imports of a package resolve inside it
            targets |= {known(name) for name in _package_relative(f, root)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _package_relative(init: Path, root: Path) -> set[str]:
    """`from .x import y` in a package's __init__ (imported_modules resolves it one level up)."""
    names: set[str] = set()
    package = list(init.relative_to(root).parent.parts)
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"  {a} -> {b}" for a in cycle for b in sorted(graph[a] & set(cycle))]
    return "cycle: " + ", ".join(cycle) + "\n" + "\n".join(edges)


def test_no_import_cycle_in_product_code_or_bench() -> None:
    graph = import_graph()
    assert len(graph) > 100, "the graph found too few modules"
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(_describe(c, graph) for c in cycles)


def test_cycle_check_sees_each_kind_of_edge(tmp_path: Path) -> None:
    """A fake package whose cycles go through a function-level, a TYPE_CHECKING and a
    relative import; and a package __init__ re-exporting its module is not a cycle."""
    pkg = tmp_path / "workers" / "p"
    pkg.mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "__init__.py").write_text("from .a import A\n", encoding="utf-8")
    (pkg / "a.py").write_text(
        "from workers.p.b import B\nfrom workers.p import helper\nclass A: ...\n",
        encoding="utf-8",
    )
    (pkg / "b.py").write_text("def late():\n    from . import a\nB = 1\n", encoding="utf-8")
    (pkg / "helper.py").write_text("import workers.p.a as z\n", encoding="utf-8")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.p.d import D\n",
        encoding="utf-8",
    )
    (pkg / "d.py").write_text("from workers.p.c import x\n", encoding="utf-8")
    (pkg / "e.py").write_text("from workers.p.a import A\n", encoding="utf-8")
    graph = import_graph(tmp_path, ("workers",))
    assert graph["workers.p"] == {"workers.p.a"}
    assert import_cycles(graph) == [
        ["workers.p.a", "workers.p.b", "workers.p.helper"],
        ["workers.p.c", "workers.p.d"],
    ]


def product_line_counts(root: Path = ROOT) -> dict[str, int]:
    return {
        str(f.relative_to(root)): len(f.read_text(encoding="utf-8").splitlines())
        for package in PRODUCT
        for f in sorted((root / package).rglob("*.py"))
    }


def test_no_product_file_over_600_lines_and_one_over_400_says_why() -> None:
    counts = product_line_counts()
    assert len(counts) > 100, "found too few product files"
    over = sorted(f"{f}: {n} lines" for f, n in counts.items() if n > MAX_LINES)
    assert not over, "split by concern:\n" + "\n".join(over)
    unexplained = sorted(
        f"{f}: {n} lines"
        for f, n in counts.items()
        if n > REVIEW_LINES and ONE_CONCERN not in (ast.get_docstring(_parse(ROOT / f)) or "")
    )
    assert not unexplained, (
        f"over {REVIEW_LINES} lines: say in the module docstring why it is one concern "
        f"('{ONE_CONCERN}: ...'), or split it by concern:\n" + "\n".join(unexplained)
    )


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


# -- the layer order (issue #46) ----------------------------------------------------------------
#
# Every product module sits in one layer; a module imports only from its own layer or below
# (an import anywhere counts: function-level and TYPE_CHECKING ones too). Lowest first. A new
# module must be placed (the test names it): the order is a decision, not an accident.
LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: kernels, the Avro schemas, pure helpers and vocabularies both sides share
    (
        "kernels",
        "schemas",
        "workers.arms",
        "workers.breaker",
        "workers.cache_ttl",
        "workers.context_layouts",
        "workers.log_levels",
        "workers.ports",
        "workers.redaction",
        "workers.reply_metadata",
        "workers.text",
        "workers.text_normal",
        "workers.tracing",
    ),
    ("topics", "workers.engine"),  # the topic catalog and cluster check; the decoder
    ("workers.fairness", "workers.store"),  # fair share over the engine's types; Redis results
    ("workers.settings",),  # read once at the edge, by everyone above
    # the replay job: a Kafka client of the workers, below every part of the serving side, so
    # it cannot reach into one (it talks to workers only through Kafka)
    ("replay",),
    ("workers.tm",),  # the phrase index (reads replay's log format)
    ("workers.stages",),  # the pipeline's stages around the engine
    ("workers.serving", "workers.metrics", "workers.metrics_engine", "workers.metrics_stages"),
    # Kafka clients: the worker's Kafka side, the bots' client, the guard; the probe servers
    (
        "workers.kafka",
        "workers.client",
        "workers.guard",
        "workers.health",
        "workers.process_hooks",
    ),
    ("workers.worker", "workers.loadtest", "workers.rollout_cli"),
    ("workers.worker_start", "workers.demo"),
    ("workers.cli", "=workers"),  # the CLI composes everything; "=": the package itself only
)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The index of the layer whose longest prefix matches `module` ("=name": that module
    only, not its submodules), None when none does."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            exact = prefix.startswith("=")
            hit = module == prefix[1:] if exact else _matches(module, prefix)
            if hit and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    return None if best is None else best[1]


def upward_imports(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> tuple[list[str], list[str]]:
    """(`a (layer i) imports b (layer j > i)` for every upward edge, modules in no layer)."""
    unplaced = sorted(m for m in graph if layer_of(m, layers) is None)
    upward = []
    for a in sorted(graph):
        la = layer_of(a, layers)
        for b in sorted(graph[a]):
            lb = layer_of(b, layers)
            if la is not None and lb is not None and lb > la:
                upward.append(f"{a} (layer {la}) imports {b} (layer {lb})")
    return upward, unplaced


def test_no_module_imports_a_layer_above_its_own() -> None:
    graph = import_graph(ROOT, PRODUCT)
    assert len(graph) > 100, "the graph found too few modules"
    upward, unplaced = upward_imports(graph)
    assert not unplaced, "place these modules in LAYERS:\n" + "\n".join(unplaced)
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_layer_check_sees_an_upward_import_and_an_unplaced_module(tmp_path: Path) -> None:
    (tmp_path / "workers" / "low").mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "workers" / "low" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "workers" / "low" / "a.py").write_text(
        "def late():\n    from workers.high import b\n", encoding="utf-8"
    )
    (tmp_path / "workers" / "high.py").write_text("from workers.low.a import late\n")
    (tmp_path / "workers" / "stray.py").write_text("X = 1\n", encoding="utf-8")
    layers = (("workers.low",), ("workers.high", "=workers"))
    graph = import_graph(tmp_path, ("workers",))
    upward, unplaced = upward_imports(graph, layers)
    assert upward == ["workers.low.a (layer 0) imports workers.high (layer 1)"]
    assert unplaced == ["workers.stray"]  # "=workers" places the package, not its modules


# -- the allowed imports of the layout by concern (issue 27, item 6) ----------------------------
#
# tools/move_packages.py moves workers/ into packages by concern; these are the rules of that
# layout, checked once it exists (the test skips while workers/kafka/ is absent). Same reading as
# RULES above: package -> prefixes it must never import, NEW_LAYOUT_ALLOWED the exceptions.
# Single modules (settings at the edge) are checked as one-file "packages". Right after the move
# two rules fail on purpose, naming the code moves issue 27 asks for: settings imports the TTL
# parsing of the L2 cache (it moves into settings), and tm/formats imports replay's text checks
# and the cache key's normalize_text (both move to a module that tm and replay/cache import).

_ENGINE_INSIDE = ("workers.engine",)  # a stage or the Kafka side sees the engine's boundary types
NEW_LAYOUT_RULES: dict[str, tuple[str, ...]] = {
    # the Kafka side of a record's life: no model, no stage internals, no Redis cache
    "workers/kafka": (
        "torch",
        *_ENGINE_INSIDE,
        "workers.stages",
        "workers.tm",
        "workers.client",
        "workers.cli",
    ),
    # the stages know an engine by its protocol; never Kafka, the worker, the client
    "workers/stages": (
        "confluent_kafka",
        "workers.kafka",
        "workers.worker",
        "workers.client",
        "workers.cli",
        "workers.store",
        "schemas",
        "topics",
        "replay",
    ),
    # the bots' client: Kafka and the schemas, nothing of the server
    "workers/client": (
        "torch",
        "redis",
        "workers.engine",
        "workers.serving",
        "workers.stages",
        "workers.tm",
        "workers.store",
        "workers.kafka",
        "workers.worker",
        "workers.settings",
    ),
    # the phrase index: the exact-match cache moved out, and no replay (its text checks belong
    # to a shared module both import)
    "workers/tm": ("workers.stages", "workers.kafka", "workers.serving", "replay"),
    # the Redis result store and its breaker: no model, no Kafka side, no stages
    "workers/store": ("torch", "workers.engine", "workers.kafka", "workers.stages"),
    # composes engine and fair share (and, in the builder, the stages); the worker adds Kafka
    "workers/serving": (*_KAFKA_REDIS, *_OUTSIDE_THE_ENGINE, "workers.kafka", "workers.store"),
    # settings at the edge: read by everyone, importing nothing above it
    "workers/settings.py": (
        "workers.stages",
        "workers.tm",
        "workers.kafka",
        "workers.serving",
        "workers.store",
        "workers.worker",
    ),
}
NEW_LAYOUT_ALLOWED: dict[str, tuple[str, ...]] = {
    "workers/kafka": ("workers.engine.types", "workers.engine.deadlines"),  # pure: records, rule
    # a TM built from replay logs reads them with the replay job's own reader (one definition of
    # the log format) and checks rows with its checks (replay/log_records.py)
    "workers/tm": ("replay.logs", "replay.log_records"),
}


def new_layout_violations(package: str, root: Path = ROOT) -> list[str]:
    forbidden, allowed = NEW_LAYOUT_RULES[package], NEW_LAYOUT_ALLOWED.get(package, ())
    target = root / package
    files = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    bad = []
    for f in files:
        for mod in sorted(imported_modules(f, root)):
            if any(_matches(mod, p) for p in forbidden) and not any(
                _matches(mod, a) for a in allowed
            ):
                bad.append(f"{f.relative_to(root)} imports {mod}")
    return bad


@pytest.mark.parametrize("package", sorted(NEW_LAYOUT_RULES))
def test_new_layout_package_imports(package: str) -> None:
    if not (ROOT / "workers" / "kafka").is_dir():
        pytest.skip("the layout by concern is not applied yet (tools/move_packages.py)")
    assert (ROOT / package).exists(), f"{package} is missing from the new layout"
    bad = new_layout_violations(package)
    assert not bad, "\n".join(bad)


# -- the request and the result are typed outside schemas/ (schemas/wire.py) -----------------

_DICT_CODEC = {"decode_request", "decode_result", "encode_request", "encode_result"}
# the fields only a TranslationRequest / TranslationResult has ("text", "status", "error",
# "metadata" name other records' fields too: run summaries, window counts, HTTP bodies)
WIRE_FIELDS = {
    f["name"]
    for name in ("translation_request", "translation_result")
    for f in json.loads((ROOT / "schemas" / f"{name}.avsc").read_text())["fields"]
} - {"text", "status", "error", "metadata", "timings"}
# other records whose keys share a wire field's name: (module, key) -> what the record is
OTHER_RECORDS = {
    ("replay/job.py", "reply_topic"): "run.json's settings",
    ("replay/job_report.py", "reply_topic"): "run.json's settings",
    ("replay/logs.py", "conversation_id"): "a row of a user's JSON Lines log",
    ("replay/logs.py", "source_lang"): "a row of a user's JSON Lines log",
    ("replay/logs.py", "target_lang"): "a row of a user's JSON Lines log",
    ("workers/demo.py", "source_lang"): "a line of the demo's sample file",
    ("workers/demo.py", "target_lang"): "a line of the demo's sample file",
    ("workers/demo.py", "conversation_id"): "a line of the demo's sample file",
    ("workers/loadtest/texts.py", "source_lang"): "a row of a parallel-sentence file",
    ("workers/loadtest/texts.py", "target_lang"): "a row of a parallel-sentence file",
}


def string_key_reads(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> list[str]:
    """`x["f"]`, `x.get("f")` / `x.pop("f")` of a wire field, and imports of the dict codec,
    in the product modules outside schemas/."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel.startswith("schemas/"):
                continue
            for node in ast.walk(_parse(path)):
                key: object = None
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                    key = getattr(node.slice, "value", None)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    if node.func.attr in ("get", "pop") and node.args:
                        key = getattr(node.args[0], "value", None)
                elif isinstance(node, ast.ImportFrom) and node.module == "schemas.codec":
                    for alias in node.names:
                        if alias.name in _DICT_CODEC:
                            found.append(f"{rel}:{node.lineno} imports {alias.name}")
                if key in WIRE_FIELDS and (rel, key) not in OTHER_RECORDS:
                    found.append(f"{rel}:{node.lineno} reads [{key!r}]")
    return found


def test_no_request_or_result_field_read_by_string_key_outside_schemas() -> None:
    assert {"request_id", "reply_topic", "completed_at"} <= WIRE_FIELDS
    found = string_key_reads()
    assert not found, "read the typed schemas.wire values instead:\n" + "\n".join(found)


def test_string_key_check_sees_a_read_a_get_and_a_dict_decoder(tmp_path: Path) -> None:
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "bad.py").write_text(
        "from schemas.codec import decode_request\n"
        "def f(r):\n    return r['request_id'], r.get('reply_topic'), r.text\n"
    )
    found = string_key_reads(tmp_path, ("workers",))
    assert [line.split(" ", 1)[1] for line in found] == [
        "imports decode_request",
        "reads ['request_id']",
        "reads ['reply_topic']",
    ]
