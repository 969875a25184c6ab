"""The report's HTML page in a real headless Chromium (Debian's `chromium` package; `.ci/run`
installs it): the page loads, every plot decodes (an injected script records each image's
naturalWidth after load, read back through --dump-dom), and a screenshot is not blank.

Without Chromium the test skips on a developer's machine and fails under CI (CI=true), where
`.ci/run` must have installed it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from replay import report as report_mod
from tests.replay.synthetic_run import arm_replies, bcontrast_requests, drop_words, write_run

PROBE = """<script>
window.addEventListener('load', () => {
  const images = Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth]);
  document.body.setAttribute('data-probe', JSON.stringify(images));
});
</script>"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed (.ci/run installs Debian's chromium package)")
    pytest.skip("chromium is not installed (apt-get install chromium)")


def _run(browser: str, tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_report_page_renders_in_chromium(tmp_path):
    browser = _chromium()
    requests = bcontrast_requests(60)
    replies = arm_replies(
        requests, "A", lambda r: r["reference"], lambda r: 200 + len(r["text"])
    ) + arm_replies(
        requests,
        "B",
        lambda r: drop_words(r["reference"], 0.4, len(r["text"])),
        lambda r: 150 + len(r["text"]),
    )
    run_dir = write_run(tmp_path / "run", requests, replies, ["A", "B"])
    report_mod.write_report(run_dir, draws=200)
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")

    dom = _run(browser, tmp_path, "--dump-dom", probed.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Replay report synthetic" in dom.stdout
    match = re.search(r"data-probe=\"([^\"]*)\"", dom.stdout)
    assert match, "the probe script did not run"
    images = json.loads(match.group(1).replace("&quot;", '"'))
    assert len(images) == 2  # the latency CDF and the B vs A deltas
    for alt, complete, width in images:
        assert complete and width > 100, (alt, complete, width)

    shot = tmp_path / "shot.png"
    result = _run(
        browser,
        tmp_path,
        f"--screenshot={shot}",
        "--window-size=1400,1800",
        (run_dir / "report.html").as_uri(),
    )
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 20, "the screenshot is blank"
    if os.environ.get("TOLK_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["TOLK_KEEP_SCREENSHOT"])
