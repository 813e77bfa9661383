"""The widgets in a real browser: JupyterLab driven by Playwright in Debian's chromium.

Writes a small demo notebook showing the three widgets into a tmp dir, starts `jupyter lab` on
it, runs all cells, then clicks like a learner: the stepper's step button, a tile of the mask
editor, the SRAM widget's GPU dropdown. It asserts on the text the page shows and saves a
screenshot of each widget to artifacts/ (gitignored; CI keeps them).

Needs /usr/bin/chromium (CI: `apt-get install -y chromium`); never downloads a browser.
Run: pytest -m browser tests/test_browser.py
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`"),
]

DEMO_CELLS = [
    "from flashedu.viz import TileLoopStepper, SRAMOccupancy, BlockMaskEditor",
    "stepper = TileLoopStepper()\nstepper",
    "sram = SRAMOccupancy()\nsram",
    "editor = BlockMaskEditor(tiles=6)\neditor",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_demo(root: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in DEMO_CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "demo.ipynb")


def _quiet_lab_settings(settings: Path) -> None:
    """No news toast over the widgets; every cell rendered, also those scrolled out of view."""
    for plugin, values in (("apputils-extension/notification",
                            {"fetchNews": "false", "checkForUpdates": False}),
                           ("notebook-extension/tracker", {"windowingMode": "none"})):
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture
def lab(tmp_path):
    """A running JupyterLab on a tmp copy of the demo notebook: yields (url, token)."""
    root = tmp_path / "nb"
    root.mkdir()
    _write_demo(root)
    _quiet_lab_settings(tmp_path / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    with open(tmp_path / "lab.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
             "--ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
             "--LabApp.expose_app_in_browser=True", "--allow-root"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_until_up(proc, url, token, tmp_path / "lab.log")
            yield url, token
        finally:
            _stop(proc)


def _wait_until_up(proc, url, token, log_path, timeout=60):
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("jupyter lab did not start:\n"
                                   + log_path.read_text()[-3000:]) from None
            time.sleep(0.5)


def _stop(proc):
    """End the server and the kernels it started (its own process group)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_widgets_render_and_respond_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright

    url, token = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            page.set_default_timeout(60_000)
            page.goto(f"{url}/lab/tree/demo.ipynb?token={token}")
            page.wait_for_function(
                "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.session &&"
                " w.sessionContext.session.kernel &&"
                " w.sessionContext.session.kernel.status === 'idle'; }")
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")

            _check_stepper(page, expect)
            _check_mask_editor(page, expect)
            _check_sram(page, expect)
            expect(page.get_by_text("Error displaying widget")).to_have_count(0)
            page.screenshot(path=ARTIFACTS / "browser_notebook.png")
        finally:
            browser.close()


def _check_stepper(page, expect):
    stepper = page.locator(".flashedu-stepper")
    expect(stepper).to_be_visible(timeout=90_000)  # the kernel imports torch first
    status, read = stepper.locator(".fe-status"), stepper.locator(".fe-read")
    expect(status).to_contain_text("step 1 of 16")
    expect(stepper.locator("svg.fe-tiles rect.sram").first).to_be_visible()
    read_before = read.inner_text()
    stepper.get_by_role("button", name="step ▶").click()
    expect(status).to_contain_text("step 2 of 16")
    expect(read).not_to_have_text(read_before)
    stepper.get_by_role("button", name="step ▶").click()
    expect(status).to_contain_text("step 3 of 16")
    stepper.scroll_into_view_if_needed()
    stepper.screenshot(path=ARTIFACTS / "stepper.png")


def _check_mask_editor(page, expect):
    editor = page.locator(".flashedu-mask-editor")
    expect(editor).to_be_visible()
    density = editor.locator(".fe-density")
    expect(density).to_have_text("0.583")  # causal preset on 6 x 6 tiles: 21 of 36
    editor.locator(".fe-tile").nth(5).click()  # tile (0, 5): above the diagonal, off
    expect(density).to_have_text("0.611")  # 22 of 36
    editor.get_by_role("button", name="check on CPU").click()  # numpy + Triton interpreter
    expect(editor.locator(".fe-run")).to_contain_text("numpy: matches", timeout=90_000)
    editor.scroll_into_view_if_needed()
    editor.screenshot(path=ARTIFACTS / "mask_editor.png")


def _check_sram(page, expect):
    sram = page.locator(".flashedu-sram")
    expect(sram).to_be_visible()
    fit = sram.locator(".fe-fit")
    expect(fit).to_have_text("fits")
    bar, effect = sram.locator("img").first, sram.locator("img").nth(1)
    expect(bar).to_be_visible()
    drawn_for_a100 = bar.get_attribute("src"), effect.get_attribute("src")
    sram.locator("select").first.select_option("T4")  # 64 KiB per SM: the 113 KiB tile overflows
    expect(fit).to_have_text("does not fit")
    expect(bar).not_to_have_attribute("src", drawn_for_a100[0])  # both charts were redrawn
    expect(effect).not_to_have_attribute("src", drawn_for_a100[1])
    sram.scroll_into_view_if_needed()
    sram.screenshot(path=ARTIFACTS / "sram_occupancy.png")
