"""The console in a real browser (headless Chromium) against a real bus and payload (tiny model)
on the demo trace: the page loads; the bus's first power cut shows in the timeline; an uplink
through the form completes (its upload to the console, cut off once, goes on from the console's
offset; a page reloaded midway offers the uplink again and goes on from there too), says each
image was verified on board, and the task's result shows;
the telemetry CSV export holds what the plot shows, the payload's memory and storage written
among it; a bad image is refused with the CLI's message.
Every wait is on the page, with a deadline and what it waits for. Screenshots go to the test's
temporary directory, or to docs/img/ (the ones docs/ground.md shows) with
OW_CONSOLE_SCREENSHOTS=docs/img."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from dataclasses import replace
from pathlib import Path

import pytest
from chromium_testkit import install_chromium

import traces

ROOT = Path(__file__).resolve().parents[2]
# Screenshots: the committed ones in docs/img/ are refreshed only on request
# (OW_CONSOLE_SCREENSHOTS=docs/img make test); otherwise they go to pytest's temporary directory,
# so a test run leaves the checkout as it found it.
SHOTS_DIR = os.environ.get("OW_CONSOLE_SCREENSHOTS")
DEADLINE_S = 90.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def browser():
    reason = install_chromium()
    if reason is not None:
        pytest.skip(reason)
    from chromium_testkit import driver

    d = driver()
    yield d
    d.quit()


def test_console_in_chromium_against_bus_and_payload(browser, model_dirs, tmp_path):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from common.wire.link import Endpoints, KeyLayout, init_keys
    from ground.client import GroundClient, GroundOptions
    from ground.console import ConsoleConfig, ConsoleSecurity
    from ground.console.server import ConsoleThread
    from ground.state import GroundState
    from hil.bus import BusConfig, BusProcess
    from hil.testbench import BenchConfig, Testbench

    keys = str(tmp_path / "keys")
    init_keys(keys)
    bench = Testbench(BenchConfig(trace="demo", model=model_dirs["qwen3-vl"], out_dir=str(tmp_path / "bench")))
    bench.pace_ms = 20.0  # what the run's preparation would set from its references
    loopback = "tcp://127.0.0.1:*"
    bus = BusProcess(
        BusConfig(
            trace=str(traces.resolve("demo")),
            data_dir=str(tmp_path / "bus"),
            keys_dir=keys,
            time_scale=0.1,  # 300 trace s in 30 s: four cuts in the first 6.2 s, then on
            endpoints=Endpoints(commands=loopback, payload=loopback, telemetry=loopback),
            model=model_dirs["qwen3-vl"],
            flight_args=bench._flight_args(),
            heartbeat_timeout_s=20.0,
            boot_timeout_s=60.0,
        )
    ).start()

    def client(**overrides):
        options = GroundOptions(
            endpoints=bus.endpoints, timeout_s=30.0, retries=50, progress=False, notify=lambda s: None
        )
        return GroundClient(keys, replace(options, **overrides))

    console = ConsoleThread(
        ConsoleConfig(
            client_factory=lambda **overrides: client(origin="ow ground console", **overrides),
            security=ConsoleSecurity(),
            state=GroundState(KeyLayout(Path(keys)).state_dir),
        )
    )
    console.start()
    assert console.ready.wait(30), "the console did not start"
    base = f"http://127.0.0.1:{console.port}/"
    shots = (ROOT / SHOTS_DIR) if SHOTS_DIR else (tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    # views re-render their rows as pushed updates arrive: an element found a moment ago may be gone
    redrawn = (NoSuchElementException, StaleElementReferenceException)
    wait = WebDriverWait(browser, DEADLINE_S, poll_frequency=0.2, ignored_exceptions=redrawn)
    try:
        browser.get(base)
        wait.until(
            lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1", "the page to load"
        )

        # a power cut, reported by the bus, shows in the timeline
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#cuts tbody tr.cut"), "a cut in the timeline")
        first_cut = browser.execute_script("return document.querySelector('#cuts tbody tr.cut:last-child').innerText")
        assert "thermal" in first_cut.lower(), first_cut

        # a bad image is refused with the CLI's message
        bad = tmp_path / "bad.png"
        bad.write_bytes(b"not a picture")
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=uplink]").click()
        browser.find_element(By.ID, "prompt").send_keys("describe the coast")
        browser.find_element(By.ID, "images").send_keys(str(bad))
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: "error" in d.find_element(By.ID, "uplink-status").get_attribute("class"), "the refusal")
        message = browser.find_element(By.ID, "uplink-status").text
        assert message == "image 'bad.png': not a decodable picture (UnidentifiedImageError)", message

        # an uplink through the form completes and shows the verification; its upload to the
        # console loses its connection on the second chunk and goes on from the console's offset
        browser.execute_script("chosen = []; document.getElementById('images').value = '';")
        browser.execute_script(
            "consoleState.uploadChunkBytes = 2048; consoleState.puts = 0; const realFetch = window.fetch;"
            " consoleState.realFetch = realFetch;"
            " window.fetch = (url, init) => (init && init.method === 'PUT' && ++consoleState.puts === 2)"
            " ? Promise.reject(new TypeError('connection dropped (test)')) : realFetch(url, init);"
        )
        browser.find_element(By.ID, "max-new-tokens").clear()
        browser.find_element(By.ID, "max-new-tokens").send_keys("4")
        browser.find_element(By.ID, "images").send_keys(str(ROOT / "hil" / "samples" / "coast.png"))
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "uplink-status").get_attribute("class") in ("ok", "error"), "uplink")
        status = browser.find_element(By.ID, "uplink-status").text
        assert "verified on board" in status and "accepted by the payload" in status, status
        task = browser.find_element(By.ID, "uplink-status").get_attribute("data-task")
        coast = (ROOT / "hil" / "samples" / "coast.png").read_bytes()
        assert browser.execute_script("return [consoleState.uploadRetries, consoleState.puts]") == [
            1,
            -(-len(coast) // 2048) + 1,  # every chunk once, and the one dropped
        ]
        assert browser.execute_script("return document.getElementById('upload-progress').value") == 100
        received = Path(keys) / "state" / "console-uploads" / hashlib.sha256(coast).hexdigest() / "named" / "coast.png"
        assert received.read_bytes() == coast  # byte-identical on the console
        # the upload to the payload showed its progress, to every byte on board
        uploads = browser.execute_script("return consoleState.uploads")
        assert uploads and all(u["done"] == u["size"] > 0 for u in uploads.values()), uploads
        assert browser.execute_script("return document.getElementById('payload-progress').value") == 100
        browser.save_screenshot(str(shots / "console-uplink.png"))

        # a page reloaded midway through its upload to the console: the uplink is offered again,
        # with its file, and goes on from the offset the console kept
        browser.execute_script("chosen = []; document.getElementById('images').value = '';")
        browser.execute_script(
            "consoleState.uploadChunkBytes = 2048; consoleState.puts = 0; const realFetch = consoleState.realFetch;"
            " window.fetch = (url, init) => (init && init.method === 'PUT' && ++consoleState.puts >= 3)"
            " ? new Promise(() => {}) : realFetch(url, init);"  # the third chunk never leaves: the page goes first
        )
        browser.find_element(By.ID, "images").send_keys(str(ROOT / "hil" / "samples" / "fields.png"))
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.execute_script("return consoleState.puts") >= 3, "two chunks held by the console")
        browser.refresh()
        wait.until(lambda d: d.execute_script("return document.body.dataset.loaded") == "1", "the page to load again")
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=uplink]").click()
        wait.until(lambda d: "cut short" in d.find_element(By.ID, "uplink-status").text, "the cut-short uplink offered")
        assert "fields.png" in browser.find_element(By.ID, "chosen").text
        browser.execute_script(
            "consoleState.offsets = []; const realFetch = window.fetch; window.fetch = (url, init) => {"
            " if (init && init.method === 'PUT') consoleState.offsets.push(init.headers['Upload-Offset']);"
            " return realFetch(url, init); };"
        )
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "uplink-status").get_attribute("class") in ("ok", "error"), "uplink")
        status = browser.find_element(By.ID, "uplink-status").text
        assert "verified on board" in status and "accepted by the payload" in status, status
        assert browser.execute_script("return consoleState.offsets") == ["4096"]  # only what the console lacked
        assert browser.execute_script("return pending.load()") is None  # answered: not offered again
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=tasks]").click()
        wait.until(
            lambda d: "logits SHA-256" in d.find_element(By.CSS_SELECTOR, f"#tasks tr[data-task='{task}']").text,
            "the task's result in the task view",
        )
        row = browser.find_element(By.CSS_SELECTOR, f"#tasks tr[data-task='{task}']").text
        assert " survived" in row, row  # the payload's own count of the cuts the task lived through
        # each restart's time to resume (or none) and the checkpoint bytes over every boot
        assert "recoveries: " in row and "checkpoints written " in row, row
        browser.save_screenshot(str(shots / "console-tasks.png"))

        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=timeline]").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#cuts tbody tr.cut")) >= 4, "all four cuts")
        browser.save_screenshot(str(shots / "console-timeline.png"))

        # pan: the same width, later then back, kept inside the history; shift+drag pans too
        def view() -> list[float]:
            return browser.execute_script("const t = consoleState.timeline; return [t.t0, t.t1, ...t.span]")

        browser.execute_async_script(
            "const done = arguments[arguments.length - 1]; const [s0, s1] = consoleState.timeline.span;"
            " timelineZoom = [s0, s0 + (s1 - s0) / 4]; loadTimeline().then(done);"
        )
        t0, t1, s0, _ = view()
        width = t1 - t0
        browser.find_element(By.ID, "pan-later").click()
        wait.until(lambda d: view()[0] > t0, "the timeline to pan later")
        later0, later1, _, _ = view()
        assert later0 == pytest.approx(t0 + width / 2) and later1 - later0 == pytest.approx(width)
        for _ in range(2):  # the second would pass the start of the history: held there
            before = view()[0]
            browser.find_element(By.ID, "pan-earlier").click()
            wait.until(lambda d, before=before: view()[0] < before or view()[0] == s0, "the timeline to pan earlier")
        assert view()[:2] == pytest.approx([s0, s0 + width])
        over = browser.find_element(By.CSS_SELECTOR, "#timeline-plot .u-over")
        chain = ActionChains(browser).key_down(Keys.SHIFT).move_to_element(over).click_and_hold()
        chain.move_by_offset(-200, 0).release().key_up(Keys.SHIFT).perform()
        wait.until(lambda d: view()[0] > s0, "shift+drag to pan the timeline later")
        dragged0, dragged1, _, _ = view()
        assert dragged1 - dragged0 == pytest.approx(width), "a pan, not a zoom"
        # the command history: every command of the station, the console's and another client's
        with client(origin="ow ground ping") as other:
            other.ping()
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=events]").click()
        wait.until(lambda d: "ow ground ping" in d.find_element(By.ID, "commands").text, "the other client's PING")
        history = browser.find_element(By.ID, "commands").text
        assert "UPLINK_TASK" in history and "ow ground console" in history, history
        browser.save_screenshot(str(shots / "console-events.png"))

        # the CSV export holds what the plot shows
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=telemetry]").click()
        wait.until(lambda d: d.execute_script("return consoleState.plots.length") == 5, "the telemetry plots")
        # the payload's memory and storage written (its HOUSEKEEPING, every 5 s): plotted from
        # the real payload's reports; the view re-reads the server until they are in
        wanted = ("payload_memory_bytes", "storage_written_bytes")
        reload_then = (
            "const done = arguments[arguments.length - 1];"
            " loadTelemetry().then(() => done(consoleState.telemetry.series));"
        )
        wait.until(
            lambda d: all((d.execute_async_script(reload_then) or {}).get(n) for n in wanted),
            "the payload's memory and storage written in the telemetry plots",
        )
        legend = browser.find_element(By.ID, "plots").text
        assert all(n in legend for n in wanted), legend
        # the screenshot shows the plots this trace has samples for (storage, wear and memory)
        browser.execute_script("document.querySelectorAll('#plots > div')[2].scrollIntoView()")
        browser.save_screenshot(str(shots / "console-telemetry.png"))
        plotted = browser.execute_script("return consoleState.telemetry.series")
        memory = [v for _, v in plotted["payload_memory_bytes"]]
        assert all(10 * 2**20 < v < 64 * 2**30 for v in memory), memory  # a live Python process (model loaded or not)
        assert plotted["storage_written_bytes"][-1][1] > 0, plotted["storage_written_bytes"]
        for name, shown in plotted.items():
            if not shown:
                continue  # a series this trace does not carry
            href = browser.find_element(By.ID, "csv").get_attribute("href")
            text = browser.execute_async_script(
                "const done = arguments[arguments.length - 1]; fetch(arguments[0]).then(r => r.text()).then(done);",
                f"{href}&series={name}",
            )
            rows = [[float(r["time_unix_s"]), float(r["value"])] for r in csv.DictReader(io.StringIO(text))]
            assert rows == shown, (name, len(rows), len(shown))
        assert any(plotted.values()), f"nothing plotted: {sorted(plotted)}"
    finally:
        console.stop()
        bus.stop()
