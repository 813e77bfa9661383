"""The widgets in a real browser: JupyterLab driven by Playwright in Debian's chromium.

Writes a small demo notebook showing the widgets into a tmp dir, starts `jupyter lab` on it,
runs all cells, then uses them like a learner and checks what the page shows: stepping, an
invalid setting (stepping off, no old run on screen), the mask editor's causal tiles, a stale
check result and the stepper that follows the editor, the chart cursor, the SRAM widget's
redraw; then the dark theme (labels readable), 1024 px with the file browser open (nothing
outside the output area), and save + reopen without the kernel's widgets (a picture, not only
"Error displaying widget"). Screenshots of the light theme, the dark theme and 1024 px go to a
tmp dir (printed) and to artifacts/ (gitignored; CI keeps them).

Needs /usr/bin/chromium (CI: `apt-get install -y chromium`); never downloads a browser.
Run: pytest -m browser tests/test_browser.py
"""

from __future__ import annotations

import json
import os
import re
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
    "linked = TileLoopStepper(state=editor.state)\nlinked",
    # a learner's Triton kernel whose load has no mask: its last program reads past the end of x
    "import torch\nimport triton\nimport triton.language as tl\n"
    "from flashedu.viz import trace_kernel\n\n\n"
    "@triton.jit\ndef copy(x, out, N, BLOCK: tl.constexpr):\n"
    "    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
    "    tl.store(out + i, tl.load(x + i), mask=i < N)\n\n\n"
    "trace = trace_kernel(copy, 3, torch.arange(10.0), torch.zeros(10), 10, BLOCK=4)\ntrace",
    # and a numba kernel with shared memory
    "import numpy as np\nfrom numba import cuda, float64\n\n\n"
    "@cuda.jit\ndef reverse_in_block(a, out):\n"
    "    tile = cuda.shared.array(4, float64)\n"
    "    t, i = cuda.threadIdx.x, cuda.grid(1)\n"
    "    tile[t] = a[i]\n    cuda.syncthreads()\n    out[i] = tile[3 - t]\n\n\n"
    "numba_trace = trace_kernel(reverse_in_block, (2, 4), np.arange(8.0), np.zeros(8))\n"
    "numba_trace",
    # the stepper on a learner's own loop, which forgets to rescale l_i
    "import math\n\n\n"
    "def my_forward(Q, K, V, Br, Bc):\n"
    "    O, L = np.zeros_like(Q), np.zeros_like(Q, shape=len(Q))\n"
    "    for i in range(math.ceil(len(Q) / Br)):\n"
    "        Q_i = Q[i * Br:(i + 1) * Br]\n"
    "        O_i, l_i, m_i = np.zeros_like(Q_i), np.zeros(len(Q_i)), np.full(len(Q_i), -np.inf)\n"
    "        for j in range(math.ceil(len(K) / Bc)):\n"
    "            K_j, V_j = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]\n"
    "            S_ij = Q_i @ K_j.T / math.sqrt(Q.shape[1])\n"
    "            m_new = np.maximum(m_i, S_ij.max(axis=1))\n"
    "            P_ij = np.exp(S_ij - m_new[:, None])\n"
    "            l_i = l_i + P_ij.sum(axis=1)\n"
    "            O_i = np.exp(m_i - m_new)[:, None] * O_i + P_ij @ V_j\n"
    "            m_i = m_new\n"
    "        O[i * Br:(i + 1) * Br] = O_i / l_i[:, None]\n"
    "        L[i * Br:(i + 1) * Br] = m_i + np.log(l_i)\n"
    "    return O, L\n\n\n"
    "TileLoopStepper(Nq=50, Nk=40, fn=my_forward)",
]
TRACE_CELLS = (5, 6)  # the cells above that show a kernel trace
LEARNER_CELL = 7  # the stepper on a learner's loop


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


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running JupyterLab on a tmp copy of the demo notebook: yields (url, token, tmp)."""
    tmp_path = tmp_path_factory.mktemp("lab")
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
            yield url, token, tmp_path
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


KERNEL_IDLE = (
    "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
    " return w && w.sessionContext && w.sessionContext.session &&"
    " w.sessionContext.session.kernel &&"
    " w.sessionContext.session.kernel.status === 'idle'; }")


@pytest.fixture(scope="module")
def page(lab):
    """The demo notebook open in chromium with every cell run; yields (page, shots dir)."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)  # a busy 2-core machine answers a click in seconds
    url, token, tmp = lab
    shots = tmp / "screenshots"
    shots.mkdir()
    print(f"\nscreenshots: {shots}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.set_default_timeout(60_000)
            page.goto(f"{url}/lab/tree/demo.ipynb?token={token}")
            page.wait_for_function(KERNEL_IDLE)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.locator(".flashedu-stepper").first.wait_for(timeout=90_000)  # imports torch
            page.locator(".flashedu-stepper").nth(1).wait_for(timeout=60_000)
            page.wait_for_function(KERNEL_IDLE)
            yield page, shots, url, token
        finally:
            browser.close()


def _shot(page, shots: Path, name: str, locator=None) -> None:
    target = locator if locator is not None else page
    target.screenshot(path=shots / name)
    ARTIFACTS.mkdir(exist_ok=True)
    target.screenshot(path=ARTIFACTS / name)


def _cell_output(page, n: int):
    """The output area of code cell n (0-based)."""
    return page.locator(".jp-Notebook .jp-CodeCell").nth(n).locator(".jp-OutputArea")


def test_stepper_steps_and_has_a_cursor(page):
    from playwright.sync_api import expect

    page, shots, *_ = page
    stepper = page.locator(".flashedu-stepper").first
    status, read = stepper.locator(".fe-status"), stepper.locator(".fe-read")
    expect(status).to_contain_text("step 0 of 16")  # the start: nothing loaded yet
    cursor = stepper.locator("line.fe-cursor").first
    x_before, read_before = cursor.get_attribute("x1"), read.inner_text()
    start = time.perf_counter()
    stepper.get_by_role("button", name="step ▶").click()
    expect(status).to_contain_text("step 1 of 16")
    expect(stepper.locator("svg.fe-tiles rect.sram").first).to_be_visible()
    print(f"\nclick -> redrawn stepper: {time.perf_counter() - start:.2f} s")
    expect(read).not_to_have_text(read_before)
    expect(cursor).not_to_have_attribute("x1", x_before)  # the charts' cursor moved with it
    expect(stepper.locator("line.fe-cursor")).to_have_count(3)
    # while the widget is live, its static picture (for a saved notebook) is hidden
    expect(_cell_output(page, 1).locator(".jp-RenderedImage")).to_be_hidden()
    _shot(page, shots, "light_stepper.png", stepper)


def test_stepper_invalid_setting_shows_no_old_run(page):
    from playwright.sync_api import expect

    page, shots, *_ = page
    stepper = page.locator(".flashedu-stepper").first
    selects, numbers = stepper.locator("select"), stepper.locator("input[type=number]")
    selects.nth(1).select_option("4")  # Br
    selects.nth(2).select_option("4")  # Bc
    for k in (0, 1):  # Nq, Nk = 100: 25 x 25 tile pairs
        numbers.nth(k).fill("100")
        numbers.nth(k).press("Enter")
    expect(stepper.locator(".fe-error")).to_contain_text("too many")
    expect(stepper.locator(".fe-error")).to_contain_text("Stepping is off")
    expect(stepper.locator("svg.fe-tiles")).to_have_count(0)  # the old run is gone
    expect(stepper.locator(".fe-read")).to_have_count(0)
    step = stepper.get_by_role("button", name="step ▶")
    expect(step).to_be_disabled()
    step.click(force=True)  # a click on the disabled button changes nothing
    expect(stepper.locator(".fe-error")).to_contain_text("too many")
    expect(stepper.locator(".fe-status")).to_have_count(0)
    selects.nth(1).select_option("16")
    selects.nth(2).select_option("16")
    expect(stepper.locator(".fe-status")).to_contain_text("step 0 of 49")
    expect(stepper.locator(".fe-run-info")).to_contain_text("Nq = 100, Nk = 100")
    expect(step).to_be_enabled()


def test_mask_editor_causal_tiles_stale_check_and_linked_stepper(page):
    from playwright.sync_api import expect

    page, shots, *_ = page
    editor = page.locator(".flashedu-mask-editor")
    linked = page.locator(".flashedu-stepper").nth(1)
    density = editor.locator(".fe-density")
    expect(density).to_have_text("0.583")  # causal preset on 6 x 6 tiles: 21 of 36
    expect(linked.locator(".fe-run-info")).to_contain_text("21 of 36 tiles kept")
    tiles = editor.locator(".fe-tile")
    tiles.nth(5).click()  # tile (0, 5): above the diagonal: kept, but skipped by causal
    expect(tiles.nth(5)).to_have_class(re.compile("fe-causal-skip"))
    expect(density).to_have_text("0.583")  # density, traffic and speedup agree with the colour
    traffic = editor.locator(".fe-traffic").inner_text()
    editor.get_by_role("button", name="check on CPU").click()  # numpy + Triton interpreter
    expect(editor.locator(".fe-run")).to_contain_text("numpy: matches", timeout=90_000)
    tiles.nth(30).click()  # tile (5, 0): below the diagonal, kept -> off
    expect(density).to_have_text("0.556")  # 20 of 36
    expect(editor.locator(".fe-traffic")).not_to_have_text(traffic)
    expect(editor.locator(".fe-stale-note")).to_contain_text("stale")  # the check is old now
    expect(linked.locator(".fe-run-info")).to_contain_text("20 of 36 tiles kept")  # followed
    editor.locator("input[type=checkbox]").uncheck()  # causal off: (0, 5) computed now
    expect(tiles.nth(5)).to_have_class(re.compile("fe-on"))
    expect(density).to_have_text("0.583")
    expect(linked.locator(".fe-run-info")).to_contain_text("not causal")
    _shot(page, shots, "light_mask_editor.png", editor)


def test_mask_editor_keeps_the_learners_choices_and_counts_clicks_honestly(page):
    """After the test above: causal unticked by the learner stays unticked when a slider
    moves; a tile clicked back to the preset's value no longer counts as clicked; the stale
    note's densities are the mask's now."""
    from playwright.sync_api import expect

    page, shots, *_ = page
    editor = page.locator(".flashedu-mask-editor")
    causal = editor.locator("input[type=checkbox]")
    expect(causal).not_to_be_checked()
    editor.locator(".noUi-handle").first.press("ArrowRight")  # the window slider
    expect(causal).not_to_be_checked()
    clicks = editor.locator(".fe-clicks")
    expect(clicks).to_contain_text("2 tile(s) clicked")  # (0, 5) and (5, 0) differ
    editor.locator(".fe-tile").nth(30).click()  # (5, 0) back to the preset's value
    expect(clicks).to_contain_text("1 tile(s) clicked")
    # the note and the density are separate outputs, updated one after the other: wait until
    # the note names the density the editor shows
    page.wait_for_function("""() => {
        const editor = document.querySelector('.flashedu-mask-editor');
        const density = editor.querySelector('.fe-density').textContent.trim();
        return editor.querySelector('.fe-stale-note').textContent.includes('now ' + density);
    }""")


def test_sram_widget_redraws_and_agrees_with_its_table(page):
    from playwright.sync_api import expect

    page, shots, *_ = page
    sram = page.locator(".flashedu-sram")
    fit = sram.locator(".fe-fit")
    expect(fit).to_have_text("fits")
    expect(sram).to_contain_text("99.0 MiB")  # FA1 with Bc = 64 at N = 4096, fp16
    bar, effect = sram.locator("svg.fe-sram-bar"), sram.locator("svg.fe-block-size-effect")
    expect(bar.locator("text.fe-legend").first).to_have_text("SM capacity")
    drawn_for_a100 = effect.inner_html()
    title = effect.locator("text").first  # "block-size effect: N = ..., fp16 on A100 ..."
    title_for_a100 = title.text_content()
    sram.locator("select").first.select_option("T4")  # 64 KiB per SM: the 113 KiB tile overflows
    expect(fit).to_have_text("does not fit")
    expect(bar.locator("text.fe-legend").first).to_have_text("SM capacity (exceeded)")
    # the two charts are separate outputs: the second may be drawn a moment after the first
    expect(title).not_to_have_text(title_for_a100)
    assert effect.inner_html() != drawn_for_a100  # both charts were redrawn
    _shot(page, shots, "light_theme.png")


def test_kernel_tracer_on_a_learners_triton_and_numba_kernels(page):
    from playwright.sync_api import expect

    page, shots, *_ = page
    page.locator(".flashedu-kernel-trace").nth(1).wait_for(timeout=90_000)
    page.wait_for_function(KERNEL_IDLE)
    tracer = page.locator(".flashedu-kernel-trace").first
    # it opens at program 2, whose unmasked load runs past x: two lanes, red, beyond the tensor
    expect(tracer.locator(".fe-kernel-headline")).to_contain_text("out of bounds")
    status = tracer.locator(".fe-kernel-status")
    expect(status).to_contain_text("access 1 of 2: program 2 loaded 2 elements of x")
    expect(tracer.locator("rect.cell.oob.beyond")).to_have_count(2)
    expect(tracer.locator("rect.cell.current")).to_have_count(2)  # x[8], x[9]
    tracer.get_by_role("button", name="step ▶").click()
    expect(status).to_contain_text("access 2 of 2: program 2 stored 2 elements of out")
    expect(tracer.locator("rect.cell.oob")).to_have_count(0)  # the store's mask held
    tracer.locator("select").select_option(label="program 0 (2 accesses)")
    expect(status).to_contain_text("access 1 of 2: program 0 loaded 4 elements of x")
    _shot(page, shots, "light_kernel_trace.png", tracer)
    blocks = page.locator(".flashedu-kernel-trace").nth(1)
    expect(blocks.locator(".fe-kernel-headline")).to_contain_text("none out of bounds")
    expect(blocks.locator("svg.fe-kernel-grid")).to_have_count(3)  # a, out and the shared tile
    expect(blocks.locator(".fe-kernel-status")).to_contain_text("block 0 read 4 elements of a")
    blocks.get_by_role("button", name="step ▶").click()
    expect(blocks.locator(".fe-kernel-status")).to_contain_text("block 0 wrote 4 elements of")
    expect(blocks.locator("svg.fe-kernel-grid").nth(2)).to_contain_text("shared")
    _shot(page, shots, "light_numba_trace.png", blocks)


def test_stepper_on_a_learners_own_loop_opens_where_it_differs(page):
    from playwright.sync_api import expect

    page, shots, *_ = page
    page.locator(".flashedu-stepper").nth(2).wait_for(timeout=90_000)
    stepper = _cell_output(page, LEARNER_CELL).locator(".flashedu-stepper")
    expect(stepper).to_contain_text("Your my_forward's tile loop")
    expect(stepper.locator(".fe-verdict")).to_contain_text("first divergence: step 2: l_i")
    expect(stepper.locator(".fe-status")).to_contain_text("step 2 of 12")
    bars = stepper.locator("svg.fe-tiles rect.row-differs")
    assert bars.count() > 0  # the rows that differ, red inside the tile
    expect(stepper.locator("svg.fe-m-chart")).to_contain_text("yours")
    _shot(page, shots, "light_learner_stepper.png", stepper)
    stepper.get_by_role("button", name="step ▶").click()
    expect(stepper.locator(".fe-status")).to_contain_text("step 3 of 12")
    expect(bars).to_have_count(0)
    stepper.locator(".noUi-handle").first.press("End")  # the last step: bytes per tensor
    expect(stepper.locator(".fe-status")).to_contain_text("step 12 of 12")
    expect(stepper.locator(".fe-tensor-ok").first).to_contain_text("Q read")


def _luminance(rgb: str) -> float:
    r, g, b = (int(x) for x in re.findall(r"\d+", rgb)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_dark_theme_labels_are_readable(page):
    page, shots, *_ = page
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme',"
                  " {theme: 'JupyterLab Dark'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
    page.wait_for_timeout(500)
    stepper = page.locator(".flashedu-stepper").first
    background = page.evaluate("getComputedStyle(document.querySelector('.jp-Notebook'))"
                               ".backgroundColor")
    tracer = page.locator(".flashedu-kernel-trace").first
    sram = page.locator(".flashedu-sram")
    for root, selector in ((stepper, "svg.fe-tiles text"), (stepper, "svg.fe-chart text"),
                           (tracer, "svg.fe-kernel-grid text"), (sram, "text.fe-legend")):
        label = root.locator(selector).first
        fill = label.evaluate("e => getComputedStyle(e).fill")
        assert _luminance(fill) - _luminance(background) > 0.4, (selector, fill, background)
    status = tracer.locator(".fe-kernel-status")
    assert _luminance(status.evaluate("e => getComputedStyle(e).color")) > 0.5
    status = stepper.locator(".fe-status")
    color = status.evaluate("e => getComputedStyle(e).color")
    assert _luminance(color) > 0.5, color
    _shot(page, shots, "dark_theme.png")
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme',"
                  " {theme: 'JupyterLab Light'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'true'")


def test_narrow_window_with_the_file_browser_open(page):
    page, shots, *_ = page
    page.set_viewport_size({"width": 1024, "height": 2400})
    page.evaluate("window.jupyterapp.shell.activateById('filebrowser')")
    page.wait_for_function("() => !window.jupyterapp.shell.leftCollapsed")
    page.wait_for_timeout(800)
    for widget in (".flashedu-stepper", ".flashedu-mask-editor", ".flashedu-sram",
                   ".flashedu-kernel-trace"):
        root = page.locator(widget).first
        outside = root.evaluate("""root => {
            const area = root.closest('.jp-OutputArea-output').getBoundingClientRect();
            const bad = [];
            for (const e of root.querySelectorAll('.widget-inline-hbox, .widget-button, select,'
                                                  + ' input, svg, img, .widget-toggle-buttons')) {
                const r = e.getBoundingClientRect();
                if (r.width > 0 && (r.right > area.right + 1 || r.left < area.left - 1))
                    bad.push((e.className.baseVal ?? e.className) + ` ${r.left}-${r.right} `
                             + `in ${area.left}-${area.right}, root `
                             + `${root.getBoundingClientRect().width}`);
            }
            return bad; }""")
        assert outside == [], (widget, outside)
    slider = page.locator(".flashedu-stepper").first.locator(".widget-slider").first
    assert slider.bounding_box()["width"] > 200  # the position slider does not collapse
    _shot(page, shots, "narrow_1024.png")
    page.set_viewport_size({"width": 1400, "height": 2400})


def test_controls_and_the_picture_they_move_fit_a_laptop_screen(page):
    """At 1024 x 768 with the file browser open, the stepper's step button, its status and the
    whole tile grid are on one screen, and so are the SRAM widget's controls and its bar chart;
    the charts' legends are drawn at 10.5 px or more."""
    page, shots, *_ = page
    page.set_viewport_size({"width": 1024, "height": 768})
    page.wait_for_timeout(500)
    panel = page.locator(".jp-NotebookPanel-notebook").first.bounding_box()
    for root, top, bottom in ((".flashedu-stepper", ".widget-button", "svg.fe-tiles"),
                              (".flashedu-sram", "select", "svg.fe-sram-bar")):
        widget = page.locator(root).first
        first, last = widget.locator(top).first, widget.locator(bottom).first
        first.evaluate("e => e.scrollIntoView({block: 'start'})")  # as a learner scrolls
        page.wait_for_timeout(200)
        a, b = first.bounding_box(), last.bounding_box()
        assert a["y"] >= panel["y"] - 1, (root, a, panel)
        assert b["y"] + b["height"] <= panel["y"] + panel["height"], (root, a, b, panel)
        _shot(page, shots, f"laptop_{root.strip('.')}.png")
    # the charts are not scaled down past legibility beside the file browser
    for chart in page.locator(".flashedu-sram svg").all():
        px = chart.evaluate("svg => svg.getBoundingClientRect().width / svg.width.baseVal.value"
                            " * parseFloat(getComputedStyle(svg.querySelector('text.fe-legend'))"
                            ".fontSize)")
        assert px >= 10.5, px
    page.set_viewport_size({"width": 1400, "height": 2400})


def test_a_kernel_restart_leaves_the_picture_and_says_run_the_cell_again(page):
    """After a restart the views stay without their models: their controls would do nothing.
    Each widget hides them, says to run the cell again, and shows its last picture."""
    from playwright.sync_api import expect

    page, shots, *_ = page
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                  ".restart()")
    page.wait_for_function(KERNEL_IDLE)
    for cell in (1, 2, 3, 4, *TRACE_CELLS, LEARNER_CELL):
        out = _cell_output(page, cell)
        root = out.locator(".flashedu-live")
        expect(root).to_have_class(re.compile("jupyter-widgets-disconnected"))
        expect(out.locator(".jp-RenderedImage img")).to_be_visible()
        for control in root.locator("button, select, input, svg").all():
            expect(control).to_be_hidden()
        note = root.evaluate("e => getComputedStyle(e, '::before').content")
        assert "run the cell again" in note, note
    _shot(page, shots, "after_restart.png")


def test_saved_notebook_shows_pictures_after_reopening(page):
    import urllib.request as rq

    from playwright.sync_api import expect

    page, shots, url, token = page
    page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty")
    for session in json.loads(rq.urlopen(f"{url}/api/sessions?token={token}").read()):
        rq.urlopen(rq.Request(f"{url}/api/sessions/{session['id']}?token={token}",
                              method="DELETE"))  # the kernel and its widget models are gone
    page.goto(f"{url}/lab/tree/demo.ipynb?token={token}")
    page.wait_for_function(KERNEL_IDLE)
    for cell in (1, 2, 3, 4, *TRACE_CELLS, LEARNER_CELL):
        out = _cell_output(page, cell)
        expect(out.locator(".jp-RenderedImage img")).to_be_visible()
        expect(out.locator(".flashedu-live")).to_have_count(0)
    _shot(page, shots, "reopened.png")
