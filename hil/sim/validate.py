"""Check the simulator against real testbench runs: same trace, same policy, same parameters.

For each run directory of `ow hil run` / a campaign (report.json, bus/bus-log.jsonl), the
simulator is given what the testbench was given -- the trace and where it started, the time
scale, the pace per unit, the storage throttle, the model (its config and the request's real
token counts) and the geometry -- plus the payload's boot as the bus measured it in that run
(power-up to the task's STARTED report; acceptance to STARTED in the window the task arrived
in; each power-up's own boot where the bus saw the task restart after it, the median elsewhere)
and this disk's commit latency (measured here, `commit_latency`). It predicts the request's
end-to-end time (accepted -> COMPLETED, in trace seconds), which is compared with the run's.
Nothing else is taken from the run.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import traces
from common.durable import DurableFS
from flight.checkpoint.policies import Geometry
from flight.model.inputs import build_inputs, load_image
from hil import buslog as bl

from .lifecycle import RequestModel, trace_windows
from .models import Request, spec_from_dir
from .platform import testbench_platform


def commit_latency(directory: str, records: int = 20, nbytes: int = 64 << 10) -> float:
    """Median seconds of one durable commit (write, fsync, rename, fsync dir) on this disk."""

    fs = DurableFS()
    times = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        payload = os.urandom(nbytes)
        for i in range(records):
            t0 = time.perf_counter()
            fs.write_atomic(os.path.join(tmp, f"r{i}"), [payload])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _flight_arg(args: list[str], name: str, default=None):
    return (
        type(default)(args[args.index(name) + 1])
        if name in args and default is not None
        else (args[args.index(name) + 1] if name in args else default)
    )


def run_facts(run_dir: str) -> dict:
    """What a testbench run was given and what it measured, from its report and bus log."""

    run = Path(run_dir)
    report = json.loads((run / "report.json").read_text())
    entries = bl.read_log(run / "bus" / bl.LOG_FILE)
    start = next(e for e in entries if e.kind == bl.RUN_START)
    flight_args = list(start.get("flight_args") or [])
    reports = [e for e in entries if e.kind == bl.PAYLOAD_REPORT and e.get("task_id")]
    task = reports[0].get("task_id") if reports else None
    mine = [
        e for e in reports if e.get("task_id") == task and (e.get("request") or {}).get("type") in ("UPLINK_TASK", None)
    ]  # not the result downlinks
    accepted = next((e.stamped_trace_s for e in mine if e.get("type") == "ACCEPTED"), None)
    started = [e.stamped_trace_s for e in mine if e.get("type") == "STARTED"]
    completed = next((e.stamped_trace_s for e in reversed(mine) if e.get("type") == "COMPLETED"), None)
    ons = [e.stamped_trace_s for e in entries if e.kind == bl.POWER_ON]
    boots, boot_by_power_up = [], {}
    for s in started[1:]:
        on = max((t for t in ons if t <= s), default=None)
        if on is not None:
            boots.append(s - on)
            boot_by_power_up[on] = s - on
    # The task's setup before its first unit (images, inputs, store scan): the first session that
    # reports a vision unit, from its STARTED to that report, less one unit (below).
    first_unit = None
    for i, s in enumerate(started):
        end = started[i + 1] if i + 1 < len(started) else float("inf")
        first = next((e for e in mine if e.get("type") == "PROGRESS" and s < e.stamped_trace_s < end), None)
        if first is not None and first.get("phase") == "vision":
            first_unit = first.stamped_trace_s - s
            break
    # A vision block of the small model on two 512 px images computes for longer than the pace on
    # a loaded machine: its time is measured as the payload ran it, from consecutive vision
    # PROGRESS reports of one session. The gap after a block also holds that block's vision-state
    # write when the policy commits synchronously, so the lower quartile of the gaps stands for
    # the compute (prefill and decode units compute well inside the pace: they take the pace).
    gaps, last = [], None
    for e in mine:
        if e.get("type") == "STARTED":
            last = None
        elif e.get("type") == "PROGRESS":
            here = (e.get("phase"), int(e.get("done")), e.stamped_trace_s)
            if last and here[0] == "vision" and last[0] == "vision" and here[1] == last[1] + 1:
                gaps.append(here[2] - last[2])
            last = here
    unit_s = {"vision": statistics.quantiles(gaps, n=4)[0] if len(gaps) >= 2 else gaps[0]} if gaps else {}
    return {
        "run_dir": str(run),
        "trace": report["trace"],
        "policy": report["policy"],
        "time_scale": report["time_scale"],
        "pace_ms": report["pace_ms"],
        "start_at_s": start.get("start_at_s", 0.0),
        "trace_path": start.get("trace_path"),
        "flight_args": flight_args,
        "accepted_s": accepted,
        "completed_s": completed,
        "started_s": started,
        "boot_trace_s": statistics.median(boots) if boots else None,
        "first_start_trace_s": (started[0] - accepted) if started and accepted is not None else 0.0,
        "first_unit_trace_s": first_unit,
        "boot_by_power_up": boot_by_power_up,
        "unit_trace_s": unit_s,
        "e2e_trace_s": (completed - accepted) if completed is not None and accepted is not None else None,
        "report_e2e_trace_s": report["requests"][0]["e2e_trace_s"] if report["requests"] else None,
        "completed": bool(report["requests"] and report["requests"][0]["completed"]),
        "cuts": report["requests"][0]["cuts"] if report["requests"] else None,
    }


def request_for(model_dir: str, images, prompt: str, max_new_tokens: int) -> Request:
    # lazy: torch/transformers (seconds), only when the engine runs; the bus and `ow --help` never do
    from flight.model.loader import load_model

    model = load_model(model_dir, device="cpu")
    inputs = build_inputs(
        model.tokenizer, model.image_processor, [load_image(p) for p in images], prompt, model.adapter.image_token_id
    )
    visual = int((inputs.input_ids == model.adapter.image_token_id).sum())
    return Request(visual, inputs.num_tokens - visual, max_new_tokens, len(images))


def simulate_run(
    facts: dict,
    model_dir: str,
    request: Request,
    geometry: Geometry,
    commit_latency_s: float,
    boot_trace_s: float | None = None,
) -> dict:
    """Predict one testbench run's end-to-end time (trace seconds)."""

    scale = facts["time_scale"]
    args = facts["flight_args"]
    read = _flight_arg(args, "--emulate-read-mbps", 0.0) or None
    write = _flight_arg(args, "--emulate-write-mbps", 0.0) or None
    boot = boot_trace_s if boot_trace_s is not None else (facts["boot_trace_s"] or facts["first_start_trace_s"])
    pace_trace_ms = facts["pace_ms"] / scale
    # the first unit starts after the task's setup (inputs, store scan): what the first
    # progress report shows beyond one unit
    unit = facts.get("unit_trace_s") or {}
    setup = max(0.0, (facts["first_unit_trace_s"] or 0.0) - max(pace_trace_ms / 1000.0, unit.get("vision", 0.0)))
    platform = testbench_platform(
        pace_trace_ms,
        read_mbps=read * scale if read else None,
        write_mbps=write * scale if write else None,
        boot_s=boot,
        first_start_s=facts["first_start_trace_s"],
        setup_s=setup,
        commit_latency_s=commit_latency_s / scale,
        unit_s=unit,
        burst_bytes=4 << 20,
    )
    platform.boot_by_power_up = {float(k): v for k, v in (facts.get("boot_by_power_up") or {}).items()}
    spec = spec_from_dir(model_dir)
    model = RequestModel(spec, request, platform, facts["policy"], geometry, planner="optimal")
    trace = traces.load(facts["trace_path"] or facts["trace"])
    windows, warns = trace_windows(trace)
    windows = [(max(a, facts["start_at_s"]), b) for a, b in windows if b > facts["start_at_s"]]
    outcome = model.run(windows, facts["accepted_s"], warns)
    return {
        "predicted_e2e_trace_s": outcome.e2e_s,
        "predicted_completed": outcome.completed,
        "predicted_cuts": outcome.cuts,
        "boot_trace_s": boot,
        "setup_trace_s": setup,
        "unit_trace_s": unit,
    }


def validate(
    run_dirs: list[str], model_dir: str, images, prompt: str, max_new_tokens: int, geometry: Geometry, scratch_dir: str
) -> dict:
    latency = commit_latency(scratch_dir)
    request = request_for(model_dir, images, prompt, max_new_tokens)
    rows = []
    for run_dir in run_dirs:
        facts = run_facts(run_dir)
        if facts["e2e_trace_s"] is None:
            rows.append({**facts, "predicted_e2e_trace_s": None, "error": None})
            continue
        pred = simulate_run(facts, model_dir, request, geometry, latency)
        err = (pred["predicted_e2e_trace_s"] / facts["e2e_trace_s"] - 1) if pred["predicted_e2e_trace_s"] else None
        rows.append({**facts, **pred, "error": err})
    errors = [abs(r["error"]) for r in rows if r.get("error") is not None]
    return {
        "commit_latency_s": latency,
        "request": request.__dict__,
        "rows": rows,
        "max_abs_error": max(errors) if errors else None,
        "within_10_percent": bool(errors) and max(errors) <= 0.10,
    }
