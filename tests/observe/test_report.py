"""The HTML report: self-contained, and renders in headless Chromium without script errors."""
import re
import shutil
import subprocess
import time

import pytest

from aotgrad.observe.report import report_html, write_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def test_report_is_self_contained(compiled):
    page = report_html(compiled)
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)     # nothing fetched from the network
    for part in ("Stages", "Saved activations", "Joint graph", "saved for backward", "joint graph",
                 "backward graph", "tangent of output 0", "grad of param &#x27;fc1.weight&#x27;", "Guards"):
        assert part in page, part


def test_report_renders_in_headless_chromium(tmp_path, recompiled_jit):
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        pytest.skip("no chromium; install it with `apt-get install -y chromium` to run this test")
    path = tmp_path / "report.html"
    write_report(recompiled_jit, path)
    start = time.perf_counter()
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    assert time.perf_counter() - start < 60
    assert 'data-rendered="2"' in dom, dom[:500]          # the page's script ran to its end
    assert "data-script-errors=" not in dom              # the page records uncaught errors there
    assert "recompiled because input 0: size(0) was 3 when captured, now 5" in dom
