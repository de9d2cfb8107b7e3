"""How long each campaign run will take, before it runs: the bench farm's plan (docs/hil.md "Bench
farm", "Which run goes first").

A testbench run's wall time is, to first order, the trace seconds it plays while the payload is
powered (skip-idle jumps the clock over the off time, and a run ends once every request has
completed, or the trace has) at the run's time scale, plus what does not scale with the trace:

    expected wall s = time_scale x powered trace s  +  a  +  b x power-ups

`powered trace s` and `power-ups` (windows from the run's start to its end) come from the
lifecycle simulator (hil/sim/lifecycle.py, the model `make bench`'s validation checks against
the real processes): every request of the run's workload, served in order by one payload on the
trace's windows, with the testbench's pace, time scale, emulated boot and storage throttle
resolved from the run's configuration as the testbench resolves them. `a` is a run's own start
and end (keys, references, the bus and its zygote, the last results) and `b` what each power-up
costs beyond the trace seconds the bus plays (the payload process forked and started, the bus
noticing the payload off and skipping to the next window). Both are fitted by least squares on
real runs (`fit`, `python -m bench.farm_bench --fit CAMPAIGN_DIR ...`) and kept in `FIT`.

The plan only orders runs: a wrong length costs wall time, never a result (every run still runs
once, and its report is what it measured).
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import traces
from common.sim.windows import trace_windows
from flight.checkpoint.policies import Geometry
from flight.options import resolve_cadence

from .lifecycle import Payload, RequestModel, trace_telemetry
from .models import Request
from .platform import testbench_platform

#: a durable commit on this kind of disk in wall seconds (write, fsync, rename, fsync of the
#: directory); the validation measures it per machine (hil/sim/validate.py commit_latency), the
#: plan needs no more than its order of magnitude
COMMIT_LATENCY_WALL_S = 2e-3
#: the bus's telemetry rate limit (hil/sim/validate.py BUS_TELEMETRY_MAX_HZ)
BUS_TELEMETRY_MAX_HZ = 10.0


@dataclass(frozen=True)
class RunLengthFit:
    """expected wall s = time_scale x powered trace s + a_s + b_s x power-ups, and where a_s and
    b_s came from (`fit`): how many real runs, their errors IN SAMPLE (the same runs the fit
    used) and left one out (each run predicted by a fit on the others)."""

    a_s: float
    b_s: float
    runs: int = 0
    median_error: float | None = None  # |expected - measured| / measured, in sample
    max_error: float | None = None
    loo_median_error: float | None = None  # the same, each run left out of its own fit
    loo_max_error: float | None = None

    def wall_s(self, prediction: RunPrediction) -> float:
        return prediction.time_scale * prediction.powered_trace_s + self.a_s + self.b_s * prediction.power_ups


@dataclass(frozen=True)
class RunPrediction:
    """What the simulator says of one run: the powered trace seconds it plays and its power-ups
    (the trace's end where a request does not complete), at `time_scale` wall s per trace s."""

    powered_trace_s: float
    power_ups: int
    completed: int
    requests: int
    time_scale: float
    end_trace_s: float

    def to_json(self) -> dict:
        return {
            "powered_trace_s": self.powered_trace_s,
            "power_ups": self.power_ups,
            "completed": self.completed,
            "requests": self.requests,
            "time_scale": self.time_scale,
            "end_trace_s": self.end_trace_s,
        }


class RunPredictor:
    """Predicts testbench runs (`predict(cfg)`, a hil.testbench.BenchConfig). Request shapes
    need the model's processors (loaded once, when first needed); predictions are cached by
    configuration, so a campaign's runs of one trace and workload cost one simulation each."""

    def __init__(self) -> None:
        from .validate import RequestShapes  # lazy: the validation module pulls in the bus log readers

        self._shapes: dict[str, RequestShapes] = {}
        self._cache: dict[str, RunPrediction] = {}

    def request(self, model: str, images: Sequence[str], prompt: str, new_tokens: int) -> Request:
        from .validate import RequestShapes, _files

        shapes = self._shapes.setdefault(model, RequestShapes(model))
        return shapes(_files(images), prompt, new_tokens)

    def predict(self, cfg) -> RunPrediction:
        from hil.campaign import _config_key

        key = json.dumps(_config_key(cfg), sort_keys=True)
        if key not in self._cache:
            self._cache[key] = self._predict(cfg)
        return self._cache[key]

    def _predict(self, cfg) -> RunPrediction:
        from hil.testbench import (
            TARGET_BOOT_TRACE_S,
            default_workload,
            target_data_weight,
            target_storage_mbps,
        )

        from .validate import spec_from_dir_cached

        trace = traces.load(traces.resolve(cfg.trace))
        start_at = cfg.start_at_s
        if start_at == 0 and not trace.is_on_at(0):  # as the testbench starts: at the first window
            start_at = next((w.start_s for w in trace.windows()), 0.0)
        spec = spec_from_dir_cached(cfg.model)
        workload = cfg.workload or default_workload(cfg.requests)
        requests = [self.request(cfg.model, list(w.images), w.prompt, w.max_new_tokens) for w in workload]
        geometry = Geometry(cfg.chunk, cfg.group, cfg.decode_every, cfg.vision_every)
        boot_trace_s = cfg.boot_trace_s if cfg.boot_trace_s is not None else TARGET_BOOT_TRACE_S
        # pace and time scale as the testbench resolves them (Testbench._prepare)
        if cfg.pace_ms is not None:
            pace_ms = float(cfg.pace_ms)
        else:
            units = statistics.mean(_paced_units(spec, r, geometry) for r in requests)
            pace_ms = max(1.0, cfg.request_seconds * 1000.0 / units)
        if cfg.time_scale == "auto":
            units = statistics.mean(_paced_units(spec, r, geometry) for r in requests)
            scale = units * pace_ms / 1000.0 / trace.reference_request_s
        else:
            scale = float(cfg.time_scale)
        read = write = None
        weight = 1.0
        if cfg.emulate_target_storage:
            read_wall, write_wall = target_storage_mbps(cfg.model, cfg.chunk, pace_ms)
            read, write = read_wall * scale, write_wall * scale  # MB per trace second
            weight = target_data_weight(cfg.model)
        platform = testbench_platform(
            pace_ms / scale,  # the pace in trace milliseconds
            read_mbps=read,
            write_mbps=write,
            boot_s=boot_trace_s,
            first_start_s=0.0,
            setup_s=0.0,
            commit_latency_s=COMMIT_LATENCY_WALL_S / scale,
            data_weight=weight,
        )
        platform.process_start_s = boot_trace_s if cfg.boot_trace_s is not None else 0.0
        windows, warns = trace_windows(trace)
        windows = [
            (max(a, start_at), min(b, trace.duration_s)) for a, b in windows if b > start_at and a < trace.duration_s
        ]
        period = trace.telemetry_period_s or 1.0
        step = period * max(1, math.ceil(1.0 / BUS_TELEMETRY_MAX_HZ / (period * scale) - 1e-9))
        cadence = resolve_cadence(cfg.policy, cfg.cadence)
        payload = Payload(platform, windows, warns, cadence, trace_telemetry(trace), step)
        # the payload serves its queue in order: request k reaches it when request k-1 completes
        arrival, completed, end = start_at, 0, trace.duration_s
        for request in requests:
            model = RequestModel(spec, request, platform, cfg.policy, geometry, planner=cfg.planner)
            outcome = model.run(payload.windows, arrival, payload.warnings, payload=payload)
            if not outcome.completed or outcome.finished_at is None or outcome.finished_at > trace.duration_s:
                break
            completed += 1
            arrival = end = outcome.finished_at
        if completed < len(requests):
            end = trace.duration_s  # a request left unfinished: the run plays the trace to its end
        powered = sum(max(0.0, min(b, end) - a) for a, b in windows if a < end)
        power_ups = sum(1 for a, _ in windows if a < end)
        return RunPrediction(powered, power_ups, completed, len(requests), scale, end)


def _paced_units(spec, request: Request, geometry: Geometry) -> float:
    """Paced units of one uninterrupted request (the testbench's reference run counts them: a
    vision block, a decoder layer on a prefill chunk, a decode step): the simulator's own
    uninterrupted session at one trace second per unit with free storage, less the rest."""
    platform = testbench_platform(
        1000.0, read_mbps=None, write_mbps=None, boot_s=0.0, first_start_s=0.0, setup_s=0.0, commit_latency_s=0.0
    )
    platform = replace(platform, storage=replace(platform.storage, write_bytes_per_s=1e18, read_bytes_per_s=1e18))
    session = RequestModel(spec, request, platform, "none", geometry).uninterrupted()
    return max(1.0, round(session.finished_at))


# ---- fitting a and b on real runs ------------------------------------------------------------------


@dataclass
class FitRow:
    run_dir: str
    measured_wall_s: float
    prediction: RunPrediction


def rows_of(campaign_dirs: Iterable[str], predictor: RunPredictor | None = None) -> list[FitRow]:
    """Every finished run of the campaigns: its measured wall time (campaign-run.json's report)
    beside the simulator's prediction for its configuration."""
    from hil.campaign import RUN_RECORD, config_of_run

    predictor = predictor or RunPredictor()
    rows = []
    for campaign in campaign_dirs:
        for record in sorted(Path(campaign).glob(f"runs/*/{RUN_RECORD}")):
            run_dir = record.parent
            wall = float(json.loads(record.read_text())["report"]["wall_s"])
            rows.append(FitRow(str(run_dir), wall, predictor.predict(config_of_run(run_dir))))
    return rows


def _least_squares(rows: Sequence[FitRow]) -> RunLengthFit:
    ups = np.array([r.prediction.power_ups for r in rows], dtype=float)
    rest = np.array([r.measured_wall_s - r.prediction.time_scale * r.prediction.powered_trace_s for r in rows])
    design = np.stack([np.ones_like(ups), ups], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, rest, rcond=None)
    return RunLengthFit(float(a), float(b), len(rows))


def _error(fitted: RunLengthFit, row: FitRow) -> float:
    return abs(fitted.wall_s(row.prediction) - row.measured_wall_s) / row.measured_wall_s


def fit(rows: Sequence[FitRow]) -> RunLengthFit:
    """a and b by least squares on what the trace seconds leave: measured - time_scale x powered
    trace s = a + b x power-ups. Errors in sample (the same rows), and each row left out of the
    fit that predicts it (with at least 3 rows)."""
    if len(rows) < 2:
        raise ValueError(f"fitting a and b needs at least 2 runs, not {len(rows)}")
    fitted = _least_squares(rows)
    errors = [_error(fitted, r) for r in rows]
    fitted = replace(fitted, median_error=statistics.median(errors), max_error=max(errors))
    if len(rows) >= 3:
        left_out = [_error(_least_squares([*rows[:i], *rows[i + 1 :]]), r) for i, r in enumerate(rows)]
        fitted = replace(fitted, loo_median_error=statistics.median(left_out), loo_max_error=max(left_out))
    return fitted


#: The real runs a and b are fitted on, each with its measured wall time and the simulator's
#: prediction (`python -m bench.farm_bench --fit CAMPAIGN_DIR ... --fit-out` writes it): 16 runs
#: of the completion forecast's calibration matrix (docs/ground.md), measured 2026-12-05 (the
#: tiny model, OrbitWeaver fixed and adaptive; seed 101 of trace-a, sat1-like, dellingr-like and
#: sat2-like back to back; seeds 101 and 102 of trace-b with both workloads). A change to the
#: simulator changes the predictions it holds: fit again from the runs then.
FIT_RUNS = Path(__file__).with_name("run_lengths.json")


def rows_to_json(rows: Sequence[FitRow]) -> dict:
    return {
        "format": "orbitweaver.run-lengths/1",
        "rows": [
            {"run": Path(r.run_dir).name, "measured_wall_s": r.measured_wall_s, **r.prediction.to_json()} for r in rows
        ],
    }


def rows_from_json(doc: dict) -> list[FitRow]:
    if doc.get("format") != "orbitweaver.run-lengths/1":
        raise ValueError("not an orbitweaver.run-lengths/1 document (its `format`)")
    fields = ("powered_trace_s", "power_ups", "completed", "requests", "time_scale", "end_trace_s")
    return [
        FitRow(row["run"], float(row["measured_wall_s"]), RunPrediction(**{k: row[k] for k in fields}))
        for row in doc["rows"]
    ]


def load_fit(path: Path = FIT_RUNS) -> RunLengthFit:
    """a and b fitted on the runs kept in `path` (FIT_RUNS): the fit is always its data's."""
    return fit(rows_from_json(json.loads(Path(path).read_text())))


FIT = load_fit()


# ---- schedules ---------------------------------------------------------------------------------------


def longest_first(lengths: dict, tie=None) -> list:
    """The keys of `lengths` (key -> expected seconds), longest first (LPT: each bench that frees
    takes the longest run left), ties broken by `tie(key)` (default: the key)."""
    return sorted(lengths, key=lambda k: (-lengths[k], tie(k) if tie else k))


def list_schedule(lengths: Sequence[float], benches: int, overhead_s: float = 0.0) -> float:
    """Wall time of handing runs of these lengths, in this order, each to the bench that frees
    first (what the farm's driver does), each paying `overhead_s` besides."""
    if benches < 1:
        raise ValueError(f"a schedule needs at least one bench, not {benches}")
    free = [0.0] * benches
    end = 0.0
    for length in lengths:
        finish = heapq.heappop(free) + length + overhead_s
        end = max(end, finish)
        heapq.heappush(free, finish)
    return end


def lower_bound(lengths: Sequence[float], benches: int, overhead_s: float = 0.0) -> float:
    """No schedule ends sooner: the work spread evenly over the benches, or the longest run."""
    per_run = [x + overhead_s for x in lengths]
    return max(sum(per_run) / benches, max(per_run, default=0.0))
