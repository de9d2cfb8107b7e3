"""The ground console at scale: bus-to-page update latency and page load time, with a 72-hour
deployment's history loaded.

    python -m bench.console_bench [--events 100000] [--hours 72] [--seconds 20]

The console's history is filled with `--events` events and `--hours` of telemetry (one sample
per series every 2 s, a cut every 90 minutes), then a real bus runs the demo trace with the real
payload (tiny model) and the console listens to it as it would on a ground station. Headless
Chromium (Debian's chromium and chromium-driver) loads the page; it then measures:

  page load     navigation start to the page's views drawn (history, timeline, tasks), median
                of 3 loads
  bus-to-page   for every packet pushed during `--seconds`: the page's receipt time minus the
                bus's send time in the packet header (same machine, same clock)
  timeline pan  a 6-hour view of the history panned half a view at a time (fetch and redraw,
                as the buttons do), and the frames of a shift+drag (the drawn view moved, no fetch)
  memory        the process's peak resident set before and after the history was loaded
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def fill(history, events: int, hours: float) -> None:
    """A deployment's worth of history, ending now (so the live packets follow it)."""
    end = time.time()
    start = end - hours * 3600
    step = 2.0
    n = int(hours * 3600 / step)
    for i in range(n):
        t = start + i * step
        day = (i % 2700) / 2700
        history.add(
            {
                "t": t,
                "type": "POWER",
                "body": {
                    "battery_soc": 0.5 + 0.4 * abs(day - 0.5),
                    "payload_power_w": 14.0 if i % 2700 < 2000 else 0.0,
                    "bus_voltage_v": 28.0,
                },
            }
        )
        history.add({"t": t, "type": "THERMAL", "body": {"payload_temp_c": 20 + 30 * day, "bus_temp_c": 25.0}})
        if i % 2700 == 0:
            history.add({"t": t, "type": "POWER_STATE", "body": {"payload_on": True, "cause": "trace"}})
        if i % 2700 == 2000:
            history.add({"t": t, "type": "SHUTDOWN_WARNING", "body": {"cause": "power", "lead_time_s": 3.0}})
            history.add({"t": t + 3, "type": "POWER_STATE", "body": {"payload_on": False, "cause": "power"}})
    per = max(1, events // 1)
    for i in range(per):
        t = start + (end - start) * i / per
        history.add(
            {
                "t": t,
                "type": "EVENT",
                "severity": "ACTIVITY_LO",
                "text": f"TASK_PHASE event {i}",
                "body": {"event_id": "TASK_PHASE", "task_id": f"t-{i % 50}"},
            }
        )


#: In the page: zoom the timeline to 6 hours at the start of the history, then pan it later half
#: a view at a time (each a fetch from the server and a redraw, as the buttons do), then time the
#: frames of a shift+drag (the drawn view moved, no fetch).
PAN_SCRIPT = """
const done = arguments[arguments.length - 1];
(async () => {
  const [s0] = consoleState.timeline.span;
  timelineZoom = [s0, s0 + 6 * 3600];
  await loadTimeline();
  const fetches = [];
  for (let i = 0; i < 10; i++) {
    const t = performance.now();
    await panTimeline(0.5);
    fetches.push(performance.now() - t);
  }
  const frames = [], min = timelinePlot.scales.x.min, max = timelinePlot.scales.x.max;
  for (let i = 1; i <= 30; i++) {
    const t = performance.now();
    timelinePlot.setScale("x", { min: min + i * 120, max: max + i * 120 });
    await null;  // uPlot redraws in a microtask queued by setScale: this one runs after it
    frames.push(performance.now() - t);
  }
  done({ fetches, frames });
})();
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--hours", type=float, default=72.0)
    p.add_argument("--seconds", type=float, default=20.0, help="how long to measure live updates")
    args = p.parse_args(argv)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    import traces
    from common.wire.link import Endpoints, KeyLayout, init_keys
    from ground.client import GroundClient, GroundOptions
    from ground.console import ConsoleConfig, History
    from ground.console.server import ConsoleThread
    from ground.state import GroundState
    from hil.bus import BusConfig, BusProcess
    from hil.testbench import BenchConfig, Testbench
    from hil.testbench_cli import ensure_model

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    history = History(max_events=args.events)
    t0 = time.monotonic()
    fill(history, args.events, args.hours)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"history: {history.number} events, {sum(len(s.t) for s in history.series.values())} samples, "
        f"{len(history.cuts)} cuts, filled in {time.monotonic() - t0:.1f} s; peak RSS {rss0 / 1024:.0f} -> "
        f"{rss1 / 1024:.0f} MiB",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="ow-console-bench-"))
    keys = str(work / "keys")
    init_keys(keys)
    model = ensure_model(None)
    bench = Testbench(BenchConfig(trace="demo", model=model, out_dir=str(work / "bench")))
    bench.pace_ms = 20.0
    loopback = "tcp://127.0.0.1:*"
    bus = BusProcess(
        BusConfig(
            trace=str(traces.resolve("demo")),
            data_dir=str(work / "bus"),
            keys_dir=keys,
            time_scale=0.1,
            endpoints=Endpoints(commands=loopback, payload=loopback, telemetry=loopback),
            model=model,
            flight_args=bench._flight_args(),
            heartbeat_timeout_s=20.0,
            boot_timeout_s=60.0,
        )
    ).start()

    def client(**overrides):
        options = GroundOptions(endpoints=bus.endpoints, timeout_s=30.0, progress=False, notify=lambda s: None)
        return GroundClient(keys, replace(options, **overrides))

    console = ConsoleThread(
        ConsoleConfig(client_factory=client, history=history, state=GroundState(KeyLayout(Path(keys)).state_dir))
    )
    console.start()
    console.ready.wait(30)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    base = f"http://127.0.0.1:{console.port}/"
    try:
        loads = []
        for _ in range(3):
            driver.get(base)
            WebDriverWait(driver, 120, 0.05).until(
                lambda d: d.execute_script("return document.body.dataset.loaded") == "1", "the page to load"
            )
            loads.append(driver.execute_script("return consoleState.loadMs"))  # ms from navigation start
        driver.execute_script("consoleState.latencies = []")
        time.sleep(args.seconds)  # measuring a period of live traffic, not waiting for a condition
        latencies = driver.execute_script("return consoleState.latencies")
        driver.set_script_timeout(120)
        pans = driver.execute_async_script(PAN_SCRIPT)
        rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finally:
        driver.quit()
        console.stop()
        bus.stop()
    if not latencies:
        print("no live packets reached the page", file=sys.stderr)
        return 1
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(
        f"page load with the history: {statistics.median(loads):.0f} ms (median of {len(loads)}: "
        f"{', '.join(f'{x:.0f}' for x in loads)})"
    )
    print(
        f"bus-to-page update latency over {len(ms)} packets: median {statistics.median(ms):.1f} ms, "
        f"p99 {p99:.1f} ms, max {ms[-1]:.1f} ms"
    )
    fetches, frames = sorted(pans["fetches"]), sorted(pans["frames"])
    print(
        f"timeline pan over the history, a 6-hour view: {len(fetches)} pans (fetch and redraw) median "
        f"{statistics.median(fetches):.0f} ms, max {fetches[-1]:.0f} ms; shift+drag frames (no fetch) median "
        f"{statistics.median(frames):.1f} ms, max {frames[-1]:.1f} ms"
    )
    print(
        f"bench process (console and its ground client) peak RSS after {args.seconds:g} s live: {rss2 / 1024:.0f} MiB "
        f"(history bounded: {args.events} events, 200,000 samples per series)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
