"""Move `workers/` into packages by concern (issue 27, item 6), rewriting every reference.

    python tools/move_packages.py [--dry-run] [--no-ruff]

Run from a clean checkout (it uses `git mv`), then check with ruff, mypy and the tests. The
table below is the whole plan; edit it, not the code. For every row whose source exists the
script

1. creates the target package (an `__init__.py` with the docstring of `PACKAGES`), `git mv`s
   the file;
2. rewrites each reference in every tracked text file (not `data/`): dotted module names
   (`import workers.x`, `from workers.x import y`, `import workers.x as z`, strings such as
   monkeypatch targets `"workers.x.attr"`, logger names, `python -m workers.x`) and paths
   (`workers/x.py`, also without the leading `workers/` when a folder remains, e.g.
   `tm/cache_key.py`); `from workers import x` / `from workers.tm import cache_key` (a
   moved module imported by its parent) become `from <new parent> import <leaf> as <name>`;
3. breaks the prose lines (comments, docstrings) a longer name pushed over 100 characters,
   and sorts and formats the changed Python files with ruff (imports move in their blocks).

A module that becomes its own package comes before the package's other rows. A row whose
source does not exist is skipped with a warning (the other helpers of issue 27
may not have created, or may have removed, a module); a top-level `workers/*.py` module that is
neither a source here nor in `STAYS` is listed at the end as unmapped: add it to the table.
One pass over each file: a name already rewritten is never rewritten again, so a new name may
extend an old one. A module may become its own package (`workers.client` ->
`workers.client.__init__`: the file moves to workers/client/__init__.py, its import name and
every `from workers.client import ...` stay, and the package's other modules join it).

What it does not do: move code between modules (settings' TTL parsing; `tm/formats`' use of
`replay`), move tests (tests/workers/... still mirror the old names), or rewrite a bare file
name without a folder (`client.py` in prose); those are listed in docs/ARCHITECTURE.md's
redraw. The allowed imports of the new layout are `NEW_LAYOUT_RULES` in
tests/test_architecture.py, switched on by the presence of `workers/kafka/`.
"""

# ruff: noqa: E501  (the table below is read as one row per move)
from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

# fmt: off
# old module                   -> new module                          what it is
MOVES: list[tuple[str, str]] = [
    # workers/kafka/: the Kafka side of a record's life, consume to commit
    ("workers.kafka_config",       "workers.kafka.config"),             # client settings, reply topic check
    ("workers.partitions",         "workers.kafka.partitions"),         # assignment, pauses, rewinds
    ("workers.offsets",            "workers.kafka.offsets"),            # commit points
    ("workers.records",            "workers.kafka.records"),            # what is held per record
    ("workers.record_life",        "workers.kafka.record_life"),        # (new, issue 27) one owner of a record's life
    ("workers.record_intake",      "workers.kafka.intake"),             # a consume() batch in
    ("workers.validation",         "workers.kafka.validation"),         # checks on a decoded request
    ("workers.engine_runs",        "workers.kafka.engine_runs"),        # the records in the engine
    ("workers.retries",            "workers.kafka.engine_retries"),     # bounded reruns of failed runs
    ("workers.replies",            "workers.kafka.replies"),            # reply and dead-letter records
    ("workers.reply_publisher",    "workers.kafka.reply_publisher"),    # the reply path
    ("workers.reply_retry",        "workers.kafka.reply_retry"),        # its retries
    ("workers.drain",              "workers.kafka.drain"),              # time to drain (broker lag)
    ("workers.arm_control",        "workers.kafka.arm_control"),        # share sources, control-topic writer
    ("workers.arm_reader",         "workers.kafka.arm_reader"),         # control-topic reader
    ("workers.arm_routing",        "workers.kafka.arm_routing"),        # which records an arm answers
    # workers/client/: the asyncio client for bots
    ("workers.client",             "workers.client.__init__"),          # the client itself: the package's API
    ("workers.client_types",       "workers.client.types"),
    ("workers.client_delivery",    "workers.client.delivery"),
    ("workers.client_replies",     "workers.client.replies"),
    # workers/stages/<name>/: the rules and the stage together
    ("workers.engine_wrapper",     "workers.stages.wrapper"),           # the pass-through base of a stage
    ("workers.serving.retry",      "workers.stages.retry"),             # (new, issue 27) the one retry stage
    ("workers.protected_spans",    "workers.stages.protected.rules"),
    ("workers.protected_engine",   "workers.stages.protected.stage"),
    ("workers.faithful",           "workers.stages.faithful.rules"),
    ("workers.faithful_engine",    "workers.stages.faithful.stage"),
    ("workers.context",            "workers.stages.context.rules"),
    ("workers.context_engine",     "workers.stages.context.stage"),
    ("workers.drill_engine",       "workers.stages.drill.stage"),
    ("workers.tm_engine",          "workers.stages.examples.stage"),    # retrieved TM examples
    ("workers.cache_engine",       "workers.stages.cache.stage"),       # the exact-match cache, out of tm/
    ("workers.tm.cache_key",       "workers.stages.cache.key"),
    ("workers.tm.cache_policy",    "workers.stages.cache.policy"),
    ("workers.tm.lru_k",           "workers.stages.cache.lru_k"),       # L1
    ("workers.tm.redis_cache",     "workers.stages.cache.redis_l2"),    # L2
    ("workers.tm.write_behind",    "workers.stages.cache.write_behind"),
    # workers/serving/: fair engine, admission, the builder (already there: fair_engine,
    # admission, queue_snapshot, group_fairness, sim_*, simulate)
    ("workers.serving.pipeline",   "workers.serving.pipeline"),         # (new, issue 27) the builder: stays
    ("workers.engine_chain",       "workers.serving.chain"),            # the stages' order
    ("workers.deadlines",          "workers.serving.deadlines"),        # the deadline rule
    # workers/store/: the Redis result store and the writes kept for later when Redis is down
    ("workers.results_store",      "workers.store.results"),
    ("workers.unstored",           "workers.store.unstored"),
]
# fmt: on

# top-level modules that stay where they are: the edge (commands, settings, the worker's loop)
# and the process (metrics, probes, traces, logs, ports, hooks)
STAYS = frozenset(
    {
        "workers.reply_metadata",
        "workers.cache_ttl",  # TOLK_CACHE_TTL parsed at the edge (settings)
        "workers.text_normal",  # one normalization: cache key and phrase index  # the reply contract: stages and the Kafka side both write it
        "workers.cli",
        "workers.demo",
        "workers.rollout_cli",
        "workers.settings",
        "workers.worker",
        "workers.health",
        "workers.metrics",
        "workers.metrics_stages",
        "workers.tracing",
        "workers.log_levels",
        "workers.process_hooks",
        "workers.ports",
        "workers.redaction",
        "workers.arms",  # pure arm rules: the worker, the drill stage, settings and replay use them
        "workers.breaker",  # the circuit breaker of both Redis users (result store, L2 cache)
    }
)

PACKAGES: dict[str, str] = {
    "workers.kafka": "The Kafka side of a record's life: consume, check, submit, reply, commit; arms.",
    "workers.stages": "The stages around the engine, each with its rules (`<name>/rules.py`).",
    "workers.stages.protected": "Protected spans: masked before translation, restored after.",
    "workers.stages.faithful": "Faithfulness: length caps and checks, a suspect translation retried.",
    "workers.stages.context": "Conversation context: the turns before, in the prompt.",
    "workers.stages.drill": "A canary made bad on purpose, for rollback drills.",
    "workers.stages.examples": "Retrieved translation-memory examples in the prompt.",
    "workers.stages.cache": "The exact-match translation cache: L1 in memory, L2 in Redis.",
    "workers.store": "The Redis result store, and the writes kept for later while Redis is down.",
}

SKIP_DIRS = ("data/",)
SKIP_SUFFIXES = (
    ".jsonl",
    ".csv",
    ".cpp",
    ".xml",
)  # .avsc: only "doc" names files, not in the fingerprint


def module_path(root: Path, module: str) -> Path:
    """`a.b` -> a/b.py; `a.b.__init__` -> a/b/__init__.py (a module that becomes its package)."""
    return root / (module.replace(".", "/") + ".py")


def dotted(module: str) -> str:
    """The import name of a table entry: `a.b.__init__` is imported as `a.b`."""
    return module.removesuffix(".__init__")


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout


def plan(root: Path) -> tuple[dict[str, str], list[str]]:
    """The rows to apply (old -> new, sources that exist, not identities) and the warnings."""
    moves: dict[str, str] = {}
    warnings = []
    for old, new in MOVES:
        if module_path(root, old) == module_path(root, new):
            continue
        if not module_path(root, old).is_file():
            warnings.append(f"skip {old} -> {new}: {module_path(root, old).relative_to(root)} "
                            "does not exist")  # fmt: skip
            continue
        if module_path(root, new).exists():
            warnings.append(f"skip {old} -> {new}: the target exists already")
            continue
        moves[old] = new
    return moves, warnings


def unmapped(root: Path) -> list[str]:
    sources = {old for old, _ in MOVES}
    out = []
    for f in sorted((root / "workers").glob("*.py")):
        module = f"workers.{f.stem}"
        if f.stem != "__init__" and module not in sources and module not in STAYS:
            out.append(module)
    return out


def _alternation(names: list[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


class Rewriter:
    """Rewrites the references to the moved modules in one text, in one pass."""

    def __init__(self, moves: dict[str, str]) -> None:
        self.moves = {old: dotted(new) for old, new in moves.items() if old != dotted(new)}
        self.paths: dict[str, str] = {}
        for old, new in moves.items():
            o, n = old.replace(".", "/") + ".py", new.replace(".", "/") + ".py"
            self.paths[o] = n
            short_o, short_n = o.removeprefix("workers/"), n.removeprefix("workers/")
            if "/" in short_o:  # `tm/cache_key.py`: a folder left, so the name is not ambiguous
                self.paths[short_o] = short_n
        names = _alternation(list(self.moves))
        paths = _alternation(list(self.paths))
        self.pattern = re.compile(
            rf"(?<![\w./])(?P<path>{paths})(?![\w])|(?<![\w.])(?P<dotted>{names})(?![\w])"
        )

    def _sub(self, match: re.Match[str]) -> str:
        if match.group("path") is not None:
            return self.paths[match.group("path")]
        return self.moves[match.group("dotted")]

    def text(self, text: str) -> str:
        return self.pattern.sub(self._sub, text)

    def python(self, source: str) -> str:
        """`from parent import module` statements regenerated, everything else by `text`."""
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return self.text(source)
        lines = source.splitlines(keepends=True)
        spans: list[tuple[int, int, str]] = []  # (first line, last line, replacement)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not any(f"{node.module}.{a.name}" in self.moves for a in node.names):
                continue
            indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)  # type: ignore[union-attr]
            spans.append((node.lineno, node.end_lineno or node.lineno,
                          self._from_parent(node, indent)))  # fmt: skip
        out, line = [], 1
        for first, last, replacement in sorted(spans):
            out.append(self.text("".join(lines[line - 1 : first - 1])))
            out.append(replacement)
            line = last + 1
        out.append(self.text("".join(lines[line - 1 :])))
        return "".join(out)

    def _from_parent(self, node: ast.ImportFrom, indent: str) -> str:
        assert node.module is not None
        kept: list[str] = []
        statements: list[str] = []
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            if full in self.moves:
                parent, _, leaf = self.moves[full].rpartition(".")
                bound = alias.asname or alias.name
                statements.append(f"from {parent} import {leaf}"
                                  + (f" as {bound}" if bound != leaf else ""))  # fmt: skip
            else:
                kept.append(alias.name + (f" as {alias.asname}" if alias.asname else ""))
        if kept:
            statements.insert(0, f"from {self.text(node.module)} import {', '.join(kept)}")
        return "".join(f"{indent}{s}\n" for s in statements)


MAX_LINE = 100  # ruff's line length (pyproject.toml)


def wrap_long_prose(source: str, before: str = "") -> tuple[str, list[int]]:
    """Lines a longer name pushed past MAX_LINE, broken at a space when they are prose: a
    comment (the rest goes on a comment line below) or a line inside a multi-line string (a
    docstring: the rest on the next line, same indentation). The numbers of the long lines that
    are code, left for a person. A line also in `before` (long already, e.g. ending in a
    `# type: ignore` that ruff lets pass) and a pragma comment are left as they are."""
    unchanged = set(before.splitlines())
    lines = source.splitlines(keepends=True)
    comments: dict[int, int] = {}  # line -> column of its comment
    in_string: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(iter(lines).__next__):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.start[1]
            elif tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                in_string.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        return source, []
    out: list[str] = []
    code: list[int] = []
    for number, line in enumerate(lines, 1):
        body = line.rstrip("\n")
        pragma = number in comments and re.match(
            r"#\s*(type:|noqa|fmt:|pragma|ruff:)", body[comments[number] :]
        )
        if len(body) <= MAX_LINE or body in unchanged or pragma:
            out.append(line)
            continue
        indent = body[: len(body) - len(body.lstrip())]
        stripped = body.lstrip()
        one_line_doc = stripped[:3] in ('"""', "'''") and stripped.endswith(stripped[:3])
        if number in comments:
            first, prefix = comments[number] + 2, indent + "# "
        elif number in in_string or one_line_doc:  # a docstring: break before its end quotes
            first, prefix = len(indent) + 3, indent
        else:
            code.append(number)
            out.append(line)
            continue
        while len(body) > MAX_LINE:
            cut = body.rfind(" ", first, min(MAX_LINE + 1, len(body) - 3))
            if cut <= first:
                break
            out.append(body[:cut].rstrip() + "\n")
            body = prefix + body[cut + 1 :]
            first = len(prefix) + 1
        out.append(body + "\n" if line.endswith("\n") else body)
    return "".join(out), code


def tracked_text_files(root: Path) -> list[Path]:
    files = []
    for name in git(root, "ls-files").splitlines():
        if name.startswith(SKIP_DIRS) or name.endswith(SKIP_SUFFIXES):
            continue
        path = root / name
        if path.is_file():
            files.append(path)
    return files


def ensure_package(root: Path, package: str, created: list[str]) -> None:
    parts = package.split(".")
    for i in range(2, len(parts) + 1):
        sub = ".".join(parts[:i])
        init = root / sub.replace(".", "/") / "__init__.py"
        if init.exists():
            continue
        init.parent.mkdir(parents=True, exist_ok=True)
        doc = PACKAGES.get(sub, f"`{sub}` (issue 27: packages by concern).")
        init.write_text(f'"""{doc}"""\n', encoding="utf-8")
        git(root, "add", str(init.relative_to(root)))
        created.append(str(init.relative_to(root)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--no-ruff", action="store_true", help="do not sort/format afterwards")
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    moves, warnings = plan(root)
    for w in warnings:
        print(f"warning: {w}")
    for old, new in moves.items():
        print(f"move {module_path(root, old).relative_to(root)} -> "
              f"{module_path(root, new).relative_to(root)}")  # fmt: skip
    if args.dry_run:
        for module in unmapped(root):
            print(f"unmapped: {module} (add it to MOVES or STAYS)")
        return 0
    created: list[str] = []
    for old, new in moves.items():
        package = dotted(new) if new.endswith(".__init__") else new.rpartition(".")[0]
        ensure_package(root, package.rpartition(".")[0], created)  # its parents
        if not new.endswith(".__init__"):
            ensure_package(root, package, created)
        module_path(root, new).parent.mkdir(parents=True, exist_ok=True)
        git(root, "mv", str(module_path(root, old).relative_to(root)),
            str(module_path(root, new).relative_to(root)))  # fmt: skip
    rewriter = Rewriter(moves)
    changed: list[Path] = []
    long_code: list[str] = []
    for path in tracked_text_files(root):
        if path.resolve() == Path(__file__).resolve():
            continue  # this table names the old modules on purpose
        try:
            before = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        after = rewriter.python(before) if path.suffix == ".py" else rewriter.text(before)
        if after != before and path.suffix == ".py":
            after, code = wrap_long_prose(after, before)
            long_code.extend(f"{path.relative_to(root)}:{n}" for n in code)
        if after != before:
            path.write_text(after, encoding="utf-8")
            changed.append(path)
    print(f"created {len(created)} package(s): {', '.join(created) or 'none'}")
    print(f"moved {len(moves)} module(s); rewrote references in {len(changed)} file(s)")
    py = [str(p.relative_to(root)) for p in changed if p.suffix == ".py"]
    if py and not args.no_ruff:
        ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
        subprocess.run([ruff, "check", "--select", "I", "--fix", "-q", *py], cwd=root)
        subprocess.run([ruff, "format", "-q", *py], cwd=root)
    if py and not args.no_ruff:
        still = subprocess.run([ruff, "check", "--select", "E501", "--output-format", "concise",
                                "-q", *py], cwd=root, capture_output=True, text=True).stdout  # fmt: skip
        for line in still.splitlines():
            if "E501" in line:
                print(f"line still too long (wrap it by hand): {line.split(': E501')[0]}")
    elif long_code:
        for where in long_code:
            print(f"long line of code after the rename (wrap it by hand): {where}")
    for module in unmapped(root):
        print(f"unmapped: {module} (add it to MOVES or STAYS)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
