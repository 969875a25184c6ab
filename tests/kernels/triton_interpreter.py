"""Running tolk's Triton kernel tests on the CPU, under Triton's interpreter, inside any pytest run.

Triton reads `TRITON_INTERPRET` when `@triton.jit` decorates a function, and that includes its
own standard library (`tl.sum`, `tl.max`, `tl.cdiv`, ... are jit functions of
`triton.language.standard`, decorated when `triton.language` is first imported). A kernel
interpreted while the library was decorated for a GPU fails at its first `tl.sum` ("Cannot call
@triton.jit'd outside of the scope of a kernel"). So the variable must be set before triton is
imported at all, and in a full test run something else (torch's inductor) may have imported it
already. Hence:

- a process started with `TRITON_INTERPRET=1` (`INTERPRETING`) runs the cases itself;
- any other process runs them once in a child pytest with the variable set (all the
  `test_triton_*` files collected in this session, one child for all, its JUnit XML read back),
  and each case asserts the outcome its namesake had in the child: a failure shows the child's
  message, a case the child did not run fails.

`checked_in_child(request)` is the first line of each case: True means "the child ran this case,
and it passed: return".

Two interpreter quirks the tests allow for: its bfloat16 `tl.dot` multiplies raw bits (the
kernels upcast their operands under the interpreter), and its float32 -> bfloat16 cast rounds
toward zero, not to nearest, so bfloat16 results may differ from torch's by one unit in the
last place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from functools import cache
from pathlib import Path

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 300


@cache
def _child_outcomes(files: tuple[str, ...]) -> dict[str, str]:
    """Run `files` under TRITON_INTERPRET=1 in a child pytest; test node name -> "" if it
    passed, else the child's message (failure, error or skip reason)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "no:warnings", "-o", "addopts=", f"--junitxml={report}", *files]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the TRITON_INTERPRET=1 child ran over {CHILD_TIMEOUT_S} s")
        if not report.exists():
            pytest.fail(f"the TRITON_INTERPRET=1 child wrote no report:\n{proc.stdout[-3000:]}"
                        f"\n{proc.stderr[-3000:]}")  # fmt: skip
        outcomes: dict[str, str] = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").rsplit(".", 1)[-1]
            message = ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    text = (found.get("message") or "") + "\n" + (found.text or "")
                    message = f"{kind} in the TRITON_INTERPRET=1 child: {text.strip()[-4000:]}"
                    break
            outcomes[f"{module}::{case.get('name')}"] = message
        return outcomes


def checked_in_child(request: pytest.FixtureRequest) -> bool:
    """False under the interpreter (run the case here); otherwise assert the case's outcome in
    the child and return True."""
    if INTERPRETING:
        return False
    pytest.importorskip("triton")
    files = sorted(
        {
            str(Path(item.path).relative_to(ROOT))
            for item in request.session.items
            if Path(item.path).name.startswith("test_triton_")
        }
    )
    outcomes = _child_outcomes(tuple(files))
    key = f"{Path(request.node.path).stem}::{request.node.name}"
    assert key in outcomes, f"{key} was not run by the TRITON_INTERPRET=1 child"
    assert outcomes[key] == "", outcomes[key]
    return True
