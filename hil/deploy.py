"""The 72-hour deployment, in compressed time, on two satellites (paper §7.7: 50 requests over
72 hours on Sat-1 and Sat-2, all completed across 91 bus-enforced shutdowns, 41 interrupted).

Each satellite gets its own bus and payload process and its own deployment trace: one payload
window per orbit (95 min) at a random point of the sunlit arc, 3 to 10 minutes long, ended by the
power budget (warned 30 s ahead) or, on Sat-1, by the thermal limit; FDIR resets strike at
random (Poisson, one per 24 h, no warning). Requests arrive at random times over the whole
period (half per satellite) and are uplinked when the bus clock reaches them. The bus skips the
spans where nothing can happen (payload off, or on and idle) and never skips past an arrival, so
72 hours take minutes; everything else -- processes, SIGKILLs, links, checkpoints -- is real.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import traces
from common.wire.link import Endpoints, init_keys
from ground.client import GroundClient, GroundOptions
from ground.errors import GroundError
from hil.bus import BusConfig, BusProcess
from hil.bus import buslog as bl
from hil.testbench import BenchConfig, default_workload, measure_boot_seconds, reference_run
from traces.model import CutCause, PowerWindow

ORBIT_S = 95 * 60
SUNLIT_S = 59 * 60


@dataclass
class DeploySatellite:
    name: str
    trace_path: str
    arrivals_s: list[float]
    tasks: dict = field(default_factory=dict)  # task id -> outcome
    cuts: int = 0
    power_ups: int = 0


def deployment_trace(name: str, seed: int, hours: float, thermal: bool):
    """One satellite's deployment windows (documented in docs/hil.md)."""

    rng = random.Random(seed)
    duration = hours * 3600.0
    windows = []
    fdir_times = []
    x = rng.expovariate(1 / 86400.0)
    while x < duration:
        fdir_times.append(x)
        x += rng.expovariate(1 / 86400.0)
    orbit = 0
    while orbit * ORBIT_S < duration:
        start = orbit * ORBIT_S + rng.uniform(0, SUNLIT_S - 600)
        length = rng.uniform(180, 600)
        end = min(start + length, duration)
        cause, lead = (CutCause.THERMAL, 10.0) if thermal and length > 420 else (CutCause.POWER, 30.0)
        for f in fdir_times:  # an FDIR reset inside the window ends it early, unannounced
            if start + 20 < f < end:
                end, cause, lead = f, CutCause.FDIR, 0.0
                break
        if end - start >= 20 and end < duration:
            windows.append(PowerWindow(start, end, cause, min(lead, end - start - 1)))
        orbit += 1
    trace = traces.Trace.from_windows(
        name,
        duration,
        windows,
        reference_request_s=180.0,
        description=f"{hours:g}-hour deployment of {name}: one payload window per 95-minute orbit in sunlight, "
        f"3-10 min, ended by the power budget{' or the thermal limit' if thermal else ''}; random FDIR resets.",
        source={"kind": "generator", "generator": "hil.deploy.deployment_trace", "seed": seed},
        assumptions=[
            "orbit 95 min, sunlit 59 min (docs/trace-format.md orbit model)",
            "payload powered once per orbit for 3-10 min at a random point of the sunlit arc (uniform)",
            "window end: power budget spent, warned 30 s ahead"
            + ("; windows over 7 min end at the thermal limit, warned 10 s ahead" if thermal else ""),
            "FDIR resets: Poisson, one per 24 h, no warning",
            "requests of 180 trace seconds uninterrupted (the paper's three-minute missions)",
        ],
    )
    return trace


@dataclass
class DeployReport:
    hours: float
    requests: int
    completed: int
    correct: int
    cuts: int
    cuts_during_work: int
    interrupted_requests: int
    windows_per_request: dict
    wall_s: float
    satellites: list[dict]
    paper: dict = field(default_factory=lambda: {"requests": 50, "completed": 50, "shutdowns": 91, "interrupted": 41})

    def summary(self) -> str:
        return (
            f"{self.hours:g} h deployment on {len(self.satellites)} satellites in {self.wall_s / 60:.1f} min wall: "
            f"{self.completed}/{self.requests} requests completed ({self.correct} bitwise equal to their "
            f"uninterrupted references), {self.cuts} bus-enforced shutdowns ({self.cuts_during_work} while a "
            f"request was running), {self.interrupted_requests} requests interrupted, windows per request "
            f"mean {self.windows_per_request.get('mean', 0):.2f} max {self.windows_per_request.get('max', 0)}  "
            f"[paper: 50/50 completed, 91 shutdowns, 41 interrupted]"
        )


def run_deploy(
    model: str, out_dir: str, hours: float = 72.0, requests: int = 50, seed: int = 1, scale: float = 0.03, say=None
) -> DeployReport:
    say = say or (lambda line: print(line, flush=True))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = str(out / "keys")
    init_keys(keys)
    rng = random.Random(seed)
    workload = default_workload(requests, max_new_tokens=16)
    base = BenchConfig(trace="demo", model=model, out_dir=str(out))
    refs = [reference_run(model, spec, base, str(out / "reference" / f"r{i}")) for i, spec in enumerate(workload)]
    units = sum(r["units"] for r in refs) / len(refs)
    boot = measure_boot_seconds()
    pace_ms = 180.0 * scale * 1000.0 / units  # a request is 180 trace seconds of compute
    sats = []
    for k, (name, thermal) in enumerate((("sat-1", True), ("sat-2", False))):
        trace = deployment_trace(name, seed * 10 + k, hours, thermal)
        path = out / f"{name}.jsonl"
        traces.dump(trace, path)
        mine = sorted(rng.uniform(0, hours * 3600 * 0.97) for _ in range(requests // 2 + (k < requests % 2)))
        sats.append(DeploySatellite(name, str(path), mine))
    say(
        f"[deploy] {hours:g} h, {requests} requests on 2 satellites; scale {scale:g} wall s per trace s with idle "
        f"spans skipped; pace {pace_ms:.0f} ms/unit (a request = 180 trace s); payload boot {boot:.1f} s"
    )
    started = time.time()
    index = iter(range(requests))
    assignments = [(sat, arrival, next(index)) for sat in sats for arrival in sat.arrivals_s]
    threads = [
        threading.Thread(
            target=_drive,
            args=(sat, [a for a in assignments if a[0] is sat], workload, refs, model, keys, out, scale, pace_ms, say),
            daemon=True,
        )
        for sat in sats
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - started
    outcomes = [o for sat in sats for o in sat.tasks.values()]
    windows = [o["windows"] for o in outcomes if o.get("completed")]
    report = DeployReport(
        hours,
        requests,
        sum(1 for o in outcomes if o.get("completed")),
        sum(1 for o in outcomes if o.get("correct")),
        sum(s.cuts for s in sats),
        sum(o.get("cuts", 0) for o in outcomes),
        sum(1 for o in outcomes if o.get("cuts", 0) > 0),
        {
            "mean": sum(windows) / len(windows) if windows else 0,
            "max": max(windows, default=0),
            "histogram": {str(w): windows.count(w) for w in sorted(set(windows))},
        },
        wall,
        [
            {"name": s.name, "trace": s.trace_path, "cuts": s.cuts, "power_ups": s.power_ups, "tasks": s.tasks}
            for s in sats
        ],
    )
    (out / "deploy-report.json").write_text(json.dumps(asdict(report), indent=2))
    (out / "summary.txt").write_text(report.summary() + "\n")
    return report


def _drive(sat: DeploySatellite, assignments, workload, refs, model, keys, out: Path, scale, pace_ms, say) -> None:
    flight_args = [
        "--chunk",
        "16",
        "--group",
        "2",
        "--decode-every",
        "4",
        "--vision-every",
        "1",
        "--threads",
        "1",
        "--pace-ms",
        f"{pace_ms:.3f}",
        "--device",
        "cpu",
    ]
    cfg = BusConfig(
        trace=sat.trace_path,
        data_dir=str(out / sat.name),
        keys_dir=keys,
        time_scale=scale,
        endpoints=Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        model=model,
        flight_args=flight_args,
        skip_idle=True,
        hold_at_s=tuple(a for _, a, _ in assignments),
        heartbeat_timeout_s=30.0,
        boot_timeout_s=90.0,
    )
    bus = BusProcess(cfg).start()
    bus_proc = bus.proc
    assert bus_proc is not None  # start() has launched it
    try:
        with GroundClient(
            keys,
            GroundOptions(
                endpoints=bus.endpoints,
                station="ground",
                timeout_s=60.0,
                retries=200,
                state_dir=str(out / sat.name / "ground-state"),
                progress=False,
                notify=lambda s: None,
            ),
        ) as g:
            clock = {"trace_s": 0.0}
            for _, arrival, i in assignments:
                while clock["trace_s"] < arrival:  # the bus clock, from its telemetry
                    if bus_proc.poll() is not None:
                        raise RuntimeError(f"{sat.name}: the bus exited ({bus_proc.returncode}); see {bus.log_path}")
                    for t in g.telemetry(0.5):
                        msg = t.message
                        if hasattr(msg, "trace_time_s"):
                            clock["trace_s"] = max(clock["trace_s"], msg.trace_time_s / scale)
                spec = workload[i]
                task_id = f"{sat.name}-r{i:02d}"
                try:
                    g.uplink(list(spec.images), spec.prompt, max_new_tokens=spec.max_new_tokens, task_id=task_id)
                    sat.tasks[task_id] = {"arrival_trace_s": arrival, "index": i}
                    say(f"[{sat.name}] t={arrival / 3600:5.1f} h uplinked {task_id}")
                except GroundError as exc:
                    sat.tasks[task_id] = {"arrival_trace_s": arrival, "index": i, "error": str(exc)}
            for task_id, outcome in sat.tasks.items():
                if "error" in outcome:
                    continue
                try:
                    res = g.result(task_id, wait=True, max_wait_s=900, poll_s=20)
                except GroundError as exc:
                    outcome["error"] = str(exc)
                    continue
                ref = refs[outcome["index"]]
                outcome.update(
                    completed=True,
                    cuts=int(res.interruptions),
                    windows=int(res.interruptions) + 1,
                    correct=list(res.token_ids) == ref["token_ids"]
                    and bytes(res.logits_sha256).hex() == ref["logits_sha256"],
                )
                say(f"[{sat.name}] {task_id} done after {res.interruptions} cut(s)")
    finally:
        bus.stop()
    entries = bl.read_log(out / sat.name / bl.LOG_FILE)
    sat.cuts = sum(1 for e in entries if e.kind == bl.POWER_OFF and e.data.get("origin") in ("trace", "fdir"))
    sat.power_ups = sum(1 for e in entries if e.kind == bl.POWER_ON)
