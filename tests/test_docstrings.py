"""Docstrings and comments true to the code (issue #46, item 5): every module, attribute or path
a docstring names in backticks exists, and every `*.py` file a docstring or comment names is a
file of the repository. A module renamed or moved without its mentions fails here.

Read statically (ast and text, nothing imported): `workers.kafka.records.request_trace` must be
a module `workers/kafka/records.py` defining `request_trace` at its top level (a class, a
function, an assignment or an import); `workers/text/spans.py` must be a path. Names of other
projects' files, said as theirs, are listed in EXTERNAL.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("workers", "topics", "schemas", "kernels", "replay", "bench")
PATH_ROOTS = (*CODE_ROOTS, "tests", "compose", "docs", "deploy", "data", "examples", ".ci")
# other projects' files a docstring compares with (vLLM v1's KV cache manager)
EXTERNAL = frozenset({"kv_cache_manager.py"})
TICKED = re.compile(r"`([^`\s]+)`")
PY_NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")


def code_files() -> list[Path]:
    return [f for root in CODE_ROOTS for f in sorted((ROOT / root).rglob("*.py"))]


def docstrings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield text


def top_level_names(path: Path) -> set[str]:
    """What `from module import name` could take from `path`: its top-level definitions,
    assignments and imports (also inside top-level `if` and `try` blocks)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        inner = ast.walk(node) if isinstance(node, ast.If | ast.Try) else iter((node,))
        for n in inner:
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(n.name)
            elif isinstance(n, ast.Assign):
                names.update(t.id for t in n.targets if isinstance(t, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
            elif isinstance(n, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
    return names


def module_file(parts: list[str], root: Path = ROOT) -> Path | None:
    base = root.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def problem_of(token: str, root: Path = ROOT) -> str | None:
    """Why a backticked `token` names nothing that exists; None when it does or is no name of
    ours (code, a command line, another project's name)."""
    name = re.split(r"[(\[:]", token, maxsplit=1)[0].rstrip(".,;")
    if "/" in name:
        if name.split("/")[0] not in PATH_ROOTS or re.search(r"[<*{]", name):
            return None
        return None if (root / name).exists() else f"no such path {name}"
    parts = name.split(".")
    if parts[0] not in CODE_ROOTS or len(parts) < 2:
        return None
    if not all(re.fullmatch(r"[A-Za-z_]\w*", p) for p in parts):
        return None
    for i in range(len(parts), 0, -1):
        found = module_file(parts[:i], root)
        if found is not None:
            if i == len(parts) or parts[i] in top_level_names(found):
                return None
            return f"{'.'.join(parts[:i])} defines no {parts[i]}"
    return f"no such module {name}"


def test_every_name_a_docstring_puts_in_backticks_exists() -> None:
    bad = [
        f"{f.relative_to(ROOT)}: `{token}`: {why}"
        for f in code_files()
        for text in docstrings(ast.parse(f.read_text(encoding="utf-8")))
        for token in TICKED.findall(text)
        if (why := problem_of(token)) is not None
    ]
    assert not bad, "\n".join(bad)


def test_every_python_file_a_docstring_or_comment_names_exists() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    paths = set(tracked)
    basenames = {Path(p).name for p in tracked} | EXTERNAL
    bad = []
    for f in code_files():
        for number, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for name in PY_NAME.findall(line):
                known = (
                    name in paths or any(p.endswith("/" + name) for p in paths)
                    if "/" in name
                    else name in basenames
                )
                if not known:
                    bad.append(f"{f.relative_to(ROOT)}:{number}: {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("workers.pkg.mod.present", None),
        ("workers.pkg.mod.absent", "workers.pkg.mod defines no absent"),
        ("workers.pkg.gone", "workers.pkg defines no gone"),  # nor is it a module
        ("tools_x.mod", None),  # not one of our roots
        ("workers/pkg/mod.py", None),
        ("workers/pkg/gone.py", "no such path workers/pkg/gone.py"),
        ("workers.pkg.mod.present(x)", None),  # a call shown in backticks
        ("pip install x", None),  # not a name of ours
        ("torch.compile", None),
    ],
)
def test_the_check_tells_a_stale_name_from_a_live_one(
    tmp_path: Path, token: str, problem: str | None
) -> None:
    pkg = tmp_path / "workers" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "mod.py").write_text("def present():\n    pass\n", encoding="utf-8")
    assert problem_of(token, tmp_path) == problem
