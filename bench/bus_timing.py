"""How late the bus acts on the trace: power-ups, warnings and cuts against their scaled times.

The bus tests check that every action is due at the trace's time, never early and in order; how
late it runs depends on the machine and its load, so it is measured here and never asserted.

The bus (`hil.bus.BusThread`, real ZeroMQ on loopback, the local power switch) replays a generated
trace of short windows against a payload process that only sleeps (what it does does not matter:
the bus cuts it with SIGKILL all the same), then the run log is read back. Lateness of an action =
its bus-clock stamp minus its due time (trace second × time scale). Printed: median, 99th
percentile and maximum per kind, in milliseconds of wall time, and the machine's load.

    python -m bench.bus_timing                 # 40 windows at time scale 0.05 (about 40 s)
    python -m bench.bus_timing --windows 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import traces
from common import log
from common.wire.link import Endpoints, init_keys
from hil.bus import BusConfig, BusThread
from hil.bus import buslog as bl
from traces import CutCause, PowerWindow

LOOPBACK = Endpoints(commands="tcp://127.0.0.1:*", payload="tcp://127.0.0.1:*", telemetry="tcp://127.0.0.1:*")
#: A payload that never connects and never ends by itself: the bus's actions are what is timed.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(1e6)"]


def build_trace(path: Path, windows: int) -> tuple[Path, list[PowerWindow]]:
    """Windows of 8 trace s on, 4 s off; every other cut announced 2 s ahead."""
    made = []
    for index in range(windows):
        start = index * 12.0
        announced = index % 2 == 0
        made.append(PowerWindow(start, start + 8.0, CutCause.THERMAL if announced else CutCause.FDIR, 2.0 * announced))
    trace = traces.Trace.from_windows("bus-timing", windows * 12.0, made, description="bus timing bench")
    return traces.dump(trace, path), made


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def measure(windows: int, scale: float, work: Path) -> dict:
    keys = init_keys(work / "keys", clients=("ground", "payload"))
    trace_path, made = build_trace(work / "trace.jsonl", windows)
    config = BusConfig(
        trace=str(trace_path),
        data_dir=work / "bus",
        keys_dir=keys.root,
        time_scale=scale,
        stop_at_end=True,
        endpoints=LOOPBACK,
        payload_command=SLEEPER,
        heartbeat_timeout_s=1e6,
        boot_timeout_s=1e6,  # a silent payload is not FDIR's business here
        boot_loop_limit=0,
    )
    bus = BusThread(config).start()
    try:
        deadline = time.monotonic() + windows * 12.0 * scale * 10 + 60
        while bus.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)  # the bus stops by itself at the trace's end
    finally:
        bus.stop()
    log = bl.read_log(bus.log_path)
    due = {
        bl.POWER_ON: [w.start_s * scale for w in made[1:]],  # the first is on at the start
        bl.POWER_OFF: [w.end_s * scale for w in made],
        bl.WARNING: [(w.end_s - w.warning_lead_s) * scale for w in made if w.warning_lead_s],
    }
    late_ms: dict[str, list[float]] = {}
    for kind, due_times in due.items():
        entries = [e for e in log if e.kind == kind and not e.get("redelivered")]
        if kind == bl.POWER_ON:
            entries = entries[1:]
        stamps = [e.clock_s for e in entries][: len(due_times)]
        late_ms[kind] = [1000 * (stamp - at) for stamp, at in zip(stamps, due_times, strict=False) if stamp is not None]
    return {
        "windows": windows,
        "time_scale": scale,
        "load_average": os.getloadavg(),
        "late_ms": {
            kind: {
                "n": len(values),
                "median": statistics.median(values),
                "p99": percentile(values, 0.99),
                "max": max(values),
                "min": min(values),
            }
            for kind, values in late_ms.items()
            if values
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40, help="power windows in the trace (default 40)")
    parser.add_argument("--scale", type=float, default=0.05, help="wall seconds per trace second (default 0.05)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    log.setup("warning")  # the bus logs every action at info; the table is what this prints
    if args.windows < 2 or args.scale <= 0:
        parser.error("--windows must be at least 2 and --scale above 0")
    with tempfile.TemporaryDirectory(prefix="bus-timing-") as work:
        result = measure(args.windows, args.scale, Path(work))
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    print(f"bus lateness over {args.windows} windows at time scale {args.scale} (load average {load})")
    print(f"{'action':<12}{'n':>5}{'median ms':>12}{'p99 ms':>10}{'max ms':>10}{'min ms':>10}")
    for kind, row in result["late_ms"].items():
        print(f"{kind:<12}{row['n']:>5}{row['median']:>12.1f}{row['p99']:>10.1f}{row['max']:>10.1f}{row['min']:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
