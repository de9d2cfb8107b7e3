"""Vision states on slow storage: the adaptive cadence's skip rule against the fixed vision cadence.

In the end-to-end campaign's configuration (bench/run_all.py: the small model, two 512 px images
and the campaign's prompt, 8 new tokens, C = 64, G = 2, D = 4, a vision state every k of the 8
vision blocks, the testbench's target-emulated storage with a 4 MiB burst, 600 ms per unit at
0.6 wall s per trace s, a 15 trace s emulated boot) the vision states take longer to write than
the vision phase lasts. This compares, for OrbitWeaver:

    fixed k=2       the paper's cadence with the campaign's k
    fixed k=4       the paper's cadence, a state every 4 blocks
    adaptive k=2    OrbitWeaver's default cadence, which skips a scheduled vision state whose write
                    would outlast both the phase and the work it saves unless a cut is likely
                    (Cadence.skip_vision_state, docs/engine.md "Cadence")
    adaptive k=2, rule off   (--ablation) the adaptive cadence with that rule switched off

in the lifecycle simulator (hil/sim: the engine's policies and the payload's real Cadence over
each trace's windows, warnings and telemetry):

  * uninterrupted: one request on a fresh payload in one open window, and the paper workload's
    two requests queued at once, against `--policy none`;
  * every trace x seed x workload of the campaign (the paper's two requests and four back to
    back, all queued at the start, served one after the other by one payload): requests completed
    within the trace and their mean end-to-end time (trace s, from the start), as a band over
    the seeds;

and, with --real, real processes: one uninterrupted testbench request (`ow hil run`'s
testbench, one window as long as the request) per setting and with `--policy none`, run at once
(each is paced: a few per cent of a core), beside the simulator's prediction for the same run.

    python -m bench.vision_cadence [--traces sat1-like,trace-a,...] [--seeds 0,1] [--real]
                                   [--ablation] [--json runs/bench/vision-cadence.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import engine_overhead
from common import log as owlog
from flight.checkpoint.cadence import Cadence
from flight.checkpoint.policies import Geometry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the campaign's (bench/run_all.py e2e_campaign and main)
PROMPT = (
    "describe every change between these scenes and count the ships near the coast , then list the damaged buildings"
)
NEW_TOKENS = 8
CHUNK, GROUP, DECODE_EVERY = 64, 2, 4
PACE_MS, TIME_SCALE, BOOT_TRACE_S = 600.0, 0.6, 15.0
BURST_BYTES = 4 << 20
TRACES = ("sat1-like", "trace-a", "dellingr-like", "trace-b", "sat2-like")
WORKLOADS = {"paper": 2, "back-to-back": 4}
#: (label, policy, cadence, k)
SETTINGS = (
    ("fixed k=2", "orbitweaver", "fixed", 2),
    ("fixed k=4", "orbitweaver", "fixed", 4),
    ("adaptive k=2", "orbitweaver", "adaptive", 2),
)
ABLATION = ("adaptive k=2, rule off", "orbitweaver", "adaptive", 2)
NONE = ("none", "none", "fixed", 2)


@contextlib.contextmanager
def rule(on: bool):
    """The skip rule as it is, or switched off (the ablation: every scheduled state kept)."""
    if on:
        yield
        return
    original = Cadence.skip_vision_state
    Cadence.skip_vision_state = lambda self, *args, **kwargs: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        Cadence.skip_vision_state = original  # type: ignore[method-assign]


class Campaign:
    """The campaign's request and emulated platform, as the simulator sees them."""

    def __init__(self, model_dir: str, commit_latency_s: float):
        # lazy: the simulator's request shapes pull in transformers' processors
        from hil.sim.validate import request_for, spec_from_dir_cached
        from hil.testbench import target_data_weight, target_storage_mbps

        self.model_dir = model_dir
        self.images = engine_overhead.ensure_images(2, 512)
        self.request = request_for(model_dir, self.images, PROMPT, NEW_TOKENS)
        self.spec = spec_from_dir_cached(model_dir)
        read, write = target_storage_mbps(model_dir, CHUNK, PACE_MS)
        # the testbench's rates are per wall second; the simulator runs in trace seconds
        self.read_mbps, self.write_mbps = read * TIME_SCALE, write * TIME_SCALE
        self.data_weight = target_data_weight(model_dir)
        self.commit_latency_s = commit_latency_s

    def platform(self):
        from hil.sim.platform import testbench_platform

        platform = testbench_platform(
            PACE_MS / TIME_SCALE,
            read_mbps=self.read_mbps,
            write_mbps=self.write_mbps,
            boot_s=BOOT_TRACE_S,
            first_start_s=0.0,
            setup_s=0.0,
            commit_latency_s=self.commit_latency_s / TIME_SCALE,
            burst_bytes=BURST_BYTES,
            data_weight=self.data_weight,
        )
        # the emulated boot: the payload process (its storage throttle, its uptime) starts after it
        platform.process_start_s = BOOT_TRACE_S
        return platform

    def model(self, platform, policy: str, k: int):
        from hil.sim.lifecycle import RequestModel

        return RequestModel(self.spec, self.request, platform, policy, Geometry(CHUNK, GROUP, DECODE_EVERY, k))

    def queue(self, setting, windows, warnings, n: int, horizon: float, telemetry=None, step: float = 1.0) -> list:
        """n requests queued at 0 and served one after the other by one payload: their Outcomes."""
        from hil.sim.lifecycle import Payload

        _label, policy, cadence, k = setting
        platform = self.platform()
        payload = Payload(platform, windows, warnings, cadence, telemetry, step)
        model = self.model(platform, policy, k)
        outcomes, arrival = [], 0.0
        for _ in range(n):
            outcome = model.run(windows, arrival, warnings, horizon=horizon, payload=payload)
            outcomes.append(outcome)
            if not outcome.completed:
                break  # the payload never gets to the ones behind it
            arrival = outcome.finished_at
        return outcomes


def uninterrupted(campaign: Campaign, settings) -> list[dict]:
    rows = []
    for setting, rule_on in settings:
        with rule(rule_on):
            outcomes = campaign.queue(setting, [(0.0, math.inf)], {}, WORKLOADS["paper"], math.inf)
        # from the payload up (the emulated boot ends), as the request's own time
        rows.append(
            {
                "setting": setting[0],
                "first_s": outcomes[0].finished_at - BOOT_TRACE_S,
                "paper_s": outcomes[-1].finished_at - BOOT_TRACE_S,
                "skipped": [o.vision_states_skipped for o in outcomes],
                "mib": sum(o.bytes_written for o in outcomes) / 2**20,
            }
        )
    base = rows[0]
    for row in rows:
        row["overhead_first"] = row["first_s"] / base["first_s"]
        row["overhead_paper"] = row["paper_s"] / base["paper_s"]
    return rows


def on_traces(campaign: Campaign, settings, trace_names, seeds, say) -> list[dict]:
    # lazy: the traces and the simulator's windows
    import traces as trace_lib
    from common.sim.windows import trace_windows
    from hil.sim.lifecycle import trace_telemetry
    from hil.sim.validate import BUS_TELEMETRY_MAX_HZ

    rows = []
    for name in trace_names:
        for seed in seeds:
            trace = trace_lib.load(name) if seed == 0 else trace_lib.generate(name, seed=seed)
            windows, warnings = trace_windows(trace)
            windows = [(a, min(b, trace.duration_s)) for a, b in windows if a < trace.duration_s]
            period = trace.telemetry_period_s or 1.0
            step = period * max(1, math.ceil(1.0 / BUS_TELEMETRY_MAX_HZ / (period * TIME_SCALE) - 1e-9))
            for workload, n in WORKLOADS.items():
                for setting, rule_on in settings:
                    started = time.perf_counter()
                    with rule(rule_on):
                        outcomes = campaign.queue(
                            setting, windows, warnings, n, trace.duration_s, trace_telemetry(trace), step
                        )
                    done = [o for o in outcomes if o.completed]
                    rows.append(
                        {
                            "trace": name,
                            "seed": seed,
                            "workload": workload,
                            "setting": setting[0],
                            "completed": len(done),
                            "requests": n,
                            # from the start of the trace, when every request was queued
                            "e2e_s": [o.finished_at for o in done],
                            "cuts": sum(o.cuts for o in outcomes),
                            "skipped": sum(o.vision_states_skipped for o in outcomes),
                            "early": sum(o.early_records for o in outcomes),
                        }
                    )
                    say(
                        f"  {name} s{seed} {workload} {setting[0]}: {len(done)}/{n} "
                        f"({time.perf_counter() - started:.1f} s)"
                    )
    return rows


def one_window_trace(path: Path, duration_s: float) -> str:
    """A trace powered from 0 to its end: one uninterrupted window."""
    header = {
        "format": "orbitweaver-trace",
        "version": 1,
        "name": "one-window",
        "description": "one window, powered from 0 to the end: an uninterrupted request",
        "duration_s": duration_s,
        "telemetry_period_s": None,
        "reference_request_s": duration_s,
        "time_scale": TIME_SCALE,
        "source": {"kind": "manual", "by": "bench/vision_cadence.py"},
        "assumptions": ["the payload stays powered for the whole request"],
    }
    path.write_text(json.dumps(header) + "\n" + json.dumps({"type": "power_on", "t": 0}) + "\n")
    return str(path)


def real_uninterrupted(campaign: Campaign, settings, out_dir: str, say) -> list[dict]:
    """One uninterrupted testbench request per setting, all at once (paced runs)."""
    # lazy: the testbench brings the bus and the ground segment
    from hil.testbench import BenchConfig, RequestSpec, Testbench

    os.makedirs(out_dir, exist_ok=True)
    trace = one_window_trace(Path(out_dir) / "one-window.jsonl", 600.0)
    results: dict[str, dict] = {}

    def one(setting) -> None:
        label, policy, cadence, k = setting
        slug = label.replace(" ", "-").replace("=", "")
        cfg = BenchConfig(
            trace=trace,
            model=campaign.model_dir,
            out_dir=os.path.join(out_dir, slug),
            policy=policy,
            requests=1,
            workload=[RequestSpec(tuple(campaign.images), PROMPT, NEW_TOKENS)],
            time_scale=TIME_SCALE,
            pace_ms=PACE_MS,
            chunk=CHUNK,
            group=GROUP,
            decode_every=DECODE_EVERY,
            vision_every=k,
            cadence=None if policy == "none" else cadence,
            emulate_target_storage=True,
        )
        try:
            report = Testbench(cfg, say=lambda line: None).run()
            request = report.requests[0]
            results[label] = {
                "run": slug,
                "e2e_s": request.e2e_trace_s,
                "correct": request.correct,
                "mib": report.bytes_written / 2**20,
                "failure": request.failure,
            }
        except Exception as exc:  # one failed run must not lose the others' figures
            results[label] = {"e2e_s": None, "error": repr(exc)}
        say(f"  real {label}: {results[label]}")

    threads = [threading.Thread(target=one, args=(setting,)) for setting, _ in settings]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = [{"setting": setting[0], **results[setting[0]]} for setting, _ in settings]
    base = rows[0]["e2e_s"]
    for row in rows:  # uplink to COMPLETED: the payload is up before the uplink ends
        row["overhead"] = row["e2e_s"] / base if row["e2e_s"] and base else None
    return beside_simulator(campaign, rows, out_dir)


def beside_simulator(campaign: Campaign, rows: list[dict], out_dir: str) -> list[dict]:
    """The simulator with each run's own facts (its acceptance, setup, unit times: the
    validation of docs/sim.md), and what each payload logged of the skip rule beside what the
    simulator predicts; `rows` name their run directories under `out_dir` ("run")."""
    from hil.sim.validate import validate

    ran = {r["setting"]: os.path.join(out_dir, r.pop("run")) for r in rows if r.get("run")}
    checked = validate(
        list(ran.values()),
        campaign.model_dir,
        campaign.images,
        PROMPT,
        NEW_TOKENS,
        Geometry(CHUNK, GROUP, DECODE_EVERY, 2),
        out_dir,
        campaign.commit_latency_s,
    )
    by_dir = {os.path.abspath(r["run_dir"]): r for r in checked["rows"]}
    for row in rows:
        v = by_dir.get(os.path.abspath(ran.get(row["setting"], "")))
        if v is not None:
            row["predicted_e2e_s"] = v["predicted_e2e_trace_s"]
            row["error"] = v["error"]
            row["skipped"] = v["vision_states_skipped"]
            row["predicted_skipped"] = v["predicted_vision_states_skipped"]
    return rows


def _band(values: list[float], fmt: str = "{:.0f}") -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def table(data: dict) -> str:
    lines = [
        "Uninterrupted (simulator; trace s from the payload up to COMPLETED: one request on a fresh payload, "
        "and the paper's two queued at once):",
        "",
    ]
    lines += [
        "| setting | 1 request | vs none | 2 queued | vs none | states skipped (each request) |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["uninterrupted"]:
        lines.append(
            f"| {r['setting']} | {r['first_s']:.1f} | {r['overhead_first']:.3f}x | "
            f"{r['paper_s']:.1f} | {r['overhead_paper']:.3f}x | {r['skipped']} |"
        )
    if data.get("real"):
        lines += [
            "",
            "Uninterrupted, real processes (testbench, one window; e2e from the uplink to COMPLETED, trace s) "
            "beside the simulator given each run's own facts (docs/sim.md validation):",
            "",
        ]
        lines += [
            "| setting | measured e2e | vs none | simulator | error | states skipped (run / simulator) | bitwise |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["real"]:
            e2e, predicted = r.get("e2e_s"), r.get("predicted_e2e_s")
            if not e2e:
                lines.append(f"| {r['setting']} | - | - | - | - | - | {r.get('error') or r.get('failure')} |")
                continue
            sim = f"{predicted:.1f} | {100 * r['error']:+.1f} %" if predicted else "- | -"
            lines.append(
                f"| {r['setting']} | {e2e:.1f} | {r['overhead']:.3f}x | {sim} | "
                f"{r.get('skipped')} / {r.get('predicted_skipped')} | {r.get('correct')} |"
            )
    if data.get("traces"):
        lines += ["", "On the traces (simulator): requests completed over the seeds, e2e band (trace s, mean per run):"]
        settings = list(dict.fromkeys(r["setting"] for r in data["traces"]))
        lines += ["", "| trace | workload | " + " | ".join(settings) + " |", "|---|---|" + "---|" * len(settings)]
        keys = list(dict.fromkeys((r["trace"], r["workload"]) for r in data["traces"]))
        for trace, workload in keys:
            cells = []
            for s in settings:
                rows = [r for r in data["traces"] if (r["trace"], r["workload"], r["setting"]) == (trace, workload, s)]
                done, asked = sum(r["completed"] for r in rows), sum(r["requests"] for r in rows)
                means = [statistics.mean(r["e2e_s"]) for r in rows if r["completed"] == r["requests"]]
                cells.append(f"{done}/{asked}, {_band(means)}")
            lines.append(f"| {trace} | {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.vision_cadence", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--traces", default=",".join(TRACES), help=f"comma-separated (default {','.join(TRACES)}; '' for none)"
    )
    p.add_argument("--seeds", default="0,1", help="trace seeds, comma-separated (default 0,1: the campaign's)")
    p.add_argument("--real", action="store_true", help="also run one real uninterrupted testbench request per setting")
    p.add_argument("--ablation", action="store_true", help="also the adaptive cadence with the skip rule switched off")
    p.add_argument("--json", default=os.path.join(ROOT, "runs", "bench", "vision-cadence.json"), help="where to write")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    trace_names = [t for t in args.traces.split(",") if t]
    unknown = [t for t in trace_names if t not in TRACES]
    if unknown:
        p.error(f"unknown trace(s) {', '.join(unknown)}; choose from {', '.join(TRACES)}")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    owlog.setup("error")  # the testbench's bus, ground and payload logs go to their run directories

    # lazy: the simulator (and its measurement of this disk's commit)
    from hil.sim.validate import commit_latency

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    model_dir = engine_overhead.ensure_model("small")
    campaign = Campaign(model_dir, commit_latency(os.path.dirname(os.path.abspath(args.json))))
    settings = [(s, True) for s in SETTINGS] + ([(ABLATION, False)] if args.ablation else [])
    data: dict = {
        "config": {
            "chunk": CHUNK,
            "group": GROUP,
            "decode_every": DECODE_EVERY,
            "pace_ms": PACE_MS,
            "time_scale": TIME_SCALE,
            "boot_trace_s": BOOT_TRACE_S,
            "write_bytes_per_trace_s": campaign.write_mbps * 1e6,
            "burst_bytes": BURST_BYTES,
            "commit_latency_s": campaign.commit_latency_s,
        }
    }
    say("uninterrupted (simulator)")
    data["uninterrupted"] = uninterrupted(campaign, [(NONE, True)] + settings)
    if trace_names:
        say("traces (simulator)")
        data["traces"] = on_traces(campaign, settings, trace_names, seeds, say)
    if args.real:
        out = tempfile.mkdtemp(prefix="vision-cadence-real-", dir=os.path.dirname(os.path.abspath(args.json)))
        say(f"uninterrupted, real processes (about 2 min; their runs in {out})")
        data["real"] = real_uninterrupted(campaign, [(NONE, True)] + [s for s in settings if s[1]], out, say)
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
