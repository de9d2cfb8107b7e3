"""`make bench`: the paper's evaluation (Figures 10-14) on this machine, in one report.

    Fig. 12  uninterrupted overhead against no checkpoints          bench/engine_overhead.py
    Fig. 13  bytes written per policy (two prompt lengths)          below
    Fig. 14  energy of uninterrupted inference (power model)        below
    Fig. 11  recovery latency at 25/50/75 % prefill, three plans    bench/recovery_latency.py
    Sec. 5.3 planner time and plan quality against the lower bound  bench/recovery_planner.py
    Fig. 10  end-to-end time per trace x policy, real processes     hil/campaign.py (testbench)
    Sec. 6   decode-KV compression: recovery time and output        below

Writes runs/bench/report/report.md with PNG plots and a summary table that puts our ratios beside
the paper's. Every timing here is a CPU timing on this machine, not a Jetson timing: the report
reads ratios, says which hardware ran, and says where and why ours differ.

    python -m bench.run_all [--quick] [--out runs/bench/report]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench import engine_overhead, forecast_bench, real_size, recovery_latency, recovery_planner, sim_figures
from bench import report as rep
from common import log as owlog
from common import machine
from flight.checkpoint.policies import Geometry
from flight.events import EngineEvent
from hil.campaign import RunExecutor, RunSlots, run_campaign
from hil.testbench import NOT_FINISHED, STOPPED_BY_LIMIT, BenchConfig, PowerModel, RequestSpec
from traces import load as load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PAPER = {
    "e2e_speedup": {"sonic-layer": 2.95, "sonic-chunk": 1.98, "hcache": 1.65},
    "overhead": "< 5 %",
    "bytes_vs_sonic_layer": "2.33-3.56x fewer",
    "energy_overhead": "3.75-4.74 %",
    "planner_ms": "< 100 ms (36 layers, G >= 2)",
    "recovery_speedup": "1.22-6.97x",
}
POLICIES = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache")
STRENGTHENED = ("sonic-layer+", "sonic-chunk+", "hcache+")  # the same records with OrbitWeaver's writer and planner
#: the end-to-end traces, in the order their runs start
E2E_TRACES = ("sat1-like", "trace-a", "dellingr-like", "trace-b", "sat2-like")
#: the prompt of the benchmarks' requests (the end-to-end campaign's two images each)
E2E_PROMPT = (
    "describe every change between these scenes and count the ships near the coast , then list the damaged buildings"
)
#: make bench's end-to-end pace (ms per unit of work) and its time scale (pace / 1000 wall s per trace s)
E2E_PACE_MS = 600.0
#: make bench's end-to-end seeds and workloads (its defaults, not --quick's)
E2E_SEEDS = (0, 1)
E2E_WORKLOADS = ("paper", "back-to-back")
# The report's parts, in the order they are measured (each is OUT/<part>.json).
PARTS = (
    "overhead",
    "bytes_energy",
    "planner",
    "recovery",
    "compression",
    "e2e",
    "e2e_plus",
    "validation",
    "repeats",
    "sim",
    "real_size",
    "forecast",
    "forecast_real",
)


def machine_header() -> dict:
    return {
        "cpu": machine.cpu_model(),
        "cores": machine.cpu_count(),
        "memory_gib": machine.memory_gib(),
        "torch": machine.library_versions(("torch",))["torch"],
        "gpu": machine.gpu_name(),
    }


def bytes_and_energy(model_dir: str, images_by_size: dict, prompt: str, rounds: int = 3) -> dict:
    """Uninterrupted run of every policy; bytes written and the power-model energy."""
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from flight.engine import Engine, EngineOptions
    from flight.model.inputs import inputs_from_files
    from flight.model.loader import load_model

    power = PowerModel()
    out = {}
    model = load_model(model_dir, device="cpu")
    for label, images in images_by_size.items():
        inputs = inputs_from_files(model, images, prompt)
        rows: dict[str, dict[str, float]] = {}
        walls: dict[str, list[float]] = {}
        for _round in range(rounds):  # interleaved rounds, the fastest of each: less noise than one run
            for policy in ("none",) + POLICIES + STRENGTHENED:
                with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as d:
                    start = time.perf_counter()
                    r = Engine(model, EngineOptions(geometry=Geometry(256, 4, 8, 2), policy=policy)).run(inputs, d, 16)
                    walls.setdefault(policy, []).append(time.perf_counter() - start)
                rows[policy] = {"bytes": r.bytes_written, "tokens": inputs.num_tokens}
        for policy, row in rows.items():
            row["wall_s"] = min(walls[policy])
            row["energy_j"] = (
                row["wall_s"] * power.compute_w + row["bytes"] / power.ssd_write_bytes_per_s * power.ssd_write_w
            )
        out[label] = rows
    return out


def decode_compression(model_dir: str, images: list, prompt: str) -> dict:
    """Cut late in decode; resume with full and with int8 decode records: recovery time, bytes,
    and how far the answer moves."""
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from flight.engine import Engine, EngineOptions, SimulatedCut
    from flight.model.inputs import inputs_from_files
    from flight.model.loader import load_model

    geometry = Geometry(256, 4, 16, 2)
    n = 64
    model = load_model(model_dir, device="cpu")
    inputs = inputs_from_files(model, images, prompt)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as d:
        ref = Engine(model, EngineOptions(geometry=geometry)).run(inputs, d, n)
    out = {}
    for mode in ("none", "int8"):
        with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as d:
            seen = {"n": 0}

            def cut(event: EngineEvent, seen: dict = seen, **_: Any) -> None:
                if event == EngineEvent.DECODE_STEP_DONE:
                    seen["n"] += 1
                    if seen["n"] == n - 3:
                        raise SimulatedCut("late in decode")

            try:
                Engine(
                    model, EngineOptions(geometry=geometry, decode_kv_compression=mode, async_writes=False), events=cut
                ).run(inputs, d, n)
            except SimulatedCut:
                pass
            log_bytes = os.path.getsize(os.path.join(d, "decode.log"))
            fresh = load_model(model_dir, device="cpu")
            r = Engine(fresh, EngineOptions(geometry=geometry, decode_kv_compression=mode)).run(inputs, d, n)
            # A shorter answer (it should never be) counts its missing tokens as not equal.
            same = sum(a == b for a, b in zip(r.token_ids, ref.token_ids, strict=False))
            out[mode] = {
                "decode_log_bytes": log_bytes,
                "restore_s": r.phase_seconds["restore"] + r.phase_seconds["prefill"],
                "tokens_equal": same,
                "tokens": len(ref.token_ids),
                "bitwise": r.token_ids == ref.token_ids and bool((r.logits == ref.logits).all()),
                "max_logit_diff": float((r.logits - ref.logits).abs().max()),
            }
    return out


#: the two end-to-end parts run at once (one thread each) and print multi-line run summaries
_PRINTING = threading.Lock()


def _say(text: str) -> None:
    """Print one campaign message whole, never interleaved with the other part's."""
    with _PRINTING:
        print(text, flush=True)


#: make bench's two end-to-end parts: (name, policies, orbitweaver's cadences)
E2E_PARTS = (("e2e", POLICIES, ("fixed", "adaptive")), ("e2e_plus", STRENGTHENED, ("fixed",)))


def e2e_base(
    model_dir: str,
    images: list,
    prompt: str,
    traces: list,
    out_dir: str,
    request_seconds: float,
    timeout_s: float | None,
    pace_ms: float | None = None,
    time_scale: float | str = "auto",
) -> BenchConfig:
    """The end-to-end campaign's base configuration (`e2e_campaign`; bench/farm_bench.py plans
    the same matrix from it)."""
    return BenchConfig(
        trace=traces[0],
        model=model_dir,
        out_dir=out_dir,
        requests=1,
        workload=[RequestSpec(tuple(images), prompt, 8)],
        time_scale=time_scale,
        request_seconds=request_seconds,
        pace_ms=pace_ms,
        chunk=64,
        group=2,
        decode_every=4,
        vision_every=2,
        timeout_s=timeout_s,
        emulate_target_storage=True,
    )


def e2e_campaign(
    model_dir: str,
    images: list,
    prompt: str,
    traces: list,
    out_dir: str,
    request_seconds: float,
    timeout_s: float | None,
    pace_ms: float | None = None,
    time_scale: float | str = "auto",
    policies=None,
    workloads=None,
    seeds=(0,),
    cadences=("fixed",),
    jobs: int = 1,
    resume: bool = False,
    slots: RunSlots | None = None,
    executor: RunExecutor | None = None,
) -> list:
    """The `small` model (12 layers: a cut inside a whole-chunk checkpoint loses up to 12
    layer-chunks, inside an OrbitWeaver block 2), a prefill-heavy request (two 512 px images, a
    short answer) as in the paper's multi-frame missions, paced and storage-emulated, the boot
    emulated; every trace x workload x seed, OrbitWeaver with fixed and adaptive cadence beside
    the baselines (hil/campaign.py)."""

    base = e2e_base(model_dir, images, prompt, traces, out_dir, request_seconds, timeout_s, pace_ms, time_scale)
    cells = run_campaign(
        base,
        traces,
        list(policies or POLICIES + STRENGTHENED),
        list(seeds),
        say=_say,
        workloads=workloads,
        cadences=list(cadences),
        jobs=jobs,
        resume=resume,
        slots=slots,
        executor=executor,
    )
    # lazy: the validation module pulls in the simulator and transformers' processors
    from hil.sim.validate import stopped_trace_s

    def stopped_early(cell, stopped: float | None) -> int:
        """Requests a wall-clock limit left unfinished before the trace ended (runs from before
        STOPPED_BY_LIMIT said NOT_FINISHED; their bus log shows the early stop)."""
        return sum(
            1
            for q in cell.report.requests
            if q.failure == STOPPED_BY_LIMIT or (q.failure == NOT_FINISHED and stopped is not None)
        )

    # OrbitWeaver with the paper's (fixed) cadence is "orbitweaver" in every comparison; the
    # adaptive cadence keeps its label.
    return [
        {
            "trace": c.trace,
            "workload": c.workload,
            "seed": c.seed,
            "cadence": c.cadence,
            "policy": "orbitweaver" if c.policy == "orbitweaver (fixed)" else c.policy,
            "completed": c.report.completion_rate,
            "requests": len(c.report.requests),
            "run_dir": os.path.relpath(c.report_dir, os.path.dirname(out_dir)) if c.report_dir else None,
            "correct": c.report.all_correct,
            # a run a wall-clock limit stopped before its trace ended: what it left unfinished
            # might still have finished within the trace
            "stopped_trace_s": (stopped := stopped_trace_s(c.report_dir) if c.report_dir else None),
            "stopped_early": stopped_early(c, stopped),
            "e2e_trace_s": statistics.mean(
                [q.e2e_trace_s for q in c.report.requests if q.e2e_trace_s is not None] or [float("nan")]
            ),
            "cuts": c.report.cuts_total,
            "mib": c.report.bytes_written / 2**20,
            "energy_j": c.report.energy_j,
            "wall_s": c.report.wall_s,
            # where a bench farm ran it ("bench B on node N"), and why earlier tries were lost
            "bench": c.bench or None,
            "run_again_because": list(c.lost),
            "pace_ms": pace_ms,
            "time_scale": time_scale,
        }
        for c in cells
    ]


def plot_bars(path, title, groups, series, ylabel):
    # lazy: matplotlib (~0.5 s), only to draw the plots
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (~0.5 s), only to draw the plots
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.5 + 1.4 * len(groups), 3.2))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and a shorter end-to-end campaign")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "report"))
    p.add_argument(
        "--traces",
        default=None,
        help="end-to-end traces, comma-separated; their runs start in this order (default "
        f"{','.join(E2E_TRACES)}: the short-window traces first, whose baselines never finish and run "
        "the whole trace; --quick: trace-a)",
    )
    # A paced small-model run keeps about 3 % of a core busy (its payload sleeps out the pace, its
    # bus out the trace), but the boots on the short-window traces add up: 22 at once (two
    # processes of 14 and 8 runs, docs/benchmarks.md) is where the simulator's validation was
    # measured, and ran the full campaign (38.5 run-hours) in under two hours.
    p.add_argument(
        "--jobs",
        type=int,
        default=22,
        help="end-to-end runs at once, over both end-to-end parts (default 22; more at once load the "
        "machine and perturb what each run measures)",
    )
    p.add_argument("--seeds", default=None, help="end-to-end seeds, comma-separated (default 0,1; --quick: 0)")
    p.add_argument(
        "--workloads",
        default=None,
        help="end-to-end workloads, comma-separated: paper, back-to-back (default both; --quick: paper)",
    )
    p.add_argument(
        "--pace-ms",
        type=float,
        default=None,
        help="end-to-end pace per unit of work (default 600; --quick: 300); the time scale follows it "
        "(pace / 1000 wall s per trace s) so that compute, I/O and boot stay scaled alike",
    )
    p.add_argument(
        "--parts",
        default=None,
        help="measure only these parts, comma-separated (overhead, bytes_energy, planner, recovery, "
        "compression, e2e, e2e_plus, validation, repeats, sim, real_size, forecast, forecast_real); "
        "the report leaves out what is missing",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="reuse the parts already measured in OUT (their JSON files) and run only the missing ones; "
        "an end-to-end campaign that was stopped keeps its finished runs (hil.campaign resume)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run the end-to-end campaigns on a bench farm: every bench of the Ray cluster at ADDRESS, one run "
        'per bench (docs/hil.md "Bench farm"; --jobs is then the repeats\' only); the rest runs here',
    )
    p.add_argument(
        "--node-ip-address",
        default=None,
        help="with --cluster: this machine's address in the cluster, where it is a node of it itself",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: write the report from the parts in OUT (missing parts are left out)",
    )
    args = p.parse_args(argv)
    if args.node_ip_address is not None and args.cluster is None:
        p.error("--node-ip-address goes with --cluster")
    parts = None if args.parts is None else {x for x in args.parts.split(",") if x}
    if parts is not None and (unknown := parts - set(PARTS)):
        p.error(f"unknown part(s): {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    workloads = (args.workloads or ("paper" if args.quick else ",".join(E2E_WORKLOADS))).split(",")
    if unknown_workloads := set(workloads) - {"paper", "back-to-back"}:
        p.error(f"unknown workload(s): {', '.join(sorted(unknown_workloads))} (known: paper, back-to-back)")
    try:
        seeds = [int(x) for x in (args.seeds or ("0" if args.quick else ",".join(map(str, E2E_SEEDS)))).split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    pace_ms = args.pace_ms or (300.0 if args.quick else E2E_PACE_MS)
    if pace_ms <= 0:
        p.error("--pace-ms must be positive")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, not {args.jobs}")
    e2e_traces = [t for t in (args.traces or ("trace-a" if args.quick else ",".join(E2E_TRACES))).split(",") if t]
    for name in e2e_traces:
        try:
            load_trace(name)
        except (OSError, ValueError) as exc:  # TraceError is a ValueError
            p.error(f"--traces: {name}: {exc}")

    owlog.setup("error")

    out = args.out
    os.makedirs(out, exist_ok=True)
    data: dict = {"machine": machine_header(), "paper": PAPER, "quick": args.quick}
    t0 = time.time()
    model = engine_overhead.ensure_model("small") if not args.report_only else ""
    small_imgs = engine_overhead.ensure_images(4, 512)
    large_imgs = engine_overhead.ensure_images(8, 512)
    prompt = E2E_PROMPT

    def part(name: str, title: str, measure):
        """Measure one part (or reuse its JSON with --reuse) and keep it in `data`."""
        path = os.path.join(out, f"{name}.json")
        if args.report_only or (parts is not None and name not in parts):
            if os.path.exists(path):
                with open(path) as f:
                    data[name] = json.load(f)
            return
        if not (args.reuse and os.path.exists(path)):
            print(f"== {title} ==", flush=True)
            result = measure(path)
            if result is not None:
                with open(path, "w") as f:
                    json.dump(result, f, indent=2, default=str)
        with open(path) as f:
            data[name] = json.load(f)

    def measures(name: str) -> bool:
        """Whether `part` measures this part in this run (not reused, not left out)."""
        path = os.path.join(out, f"{name}.json")
        return not args.report_only and (parts is None or name in parts) and not (args.reuse and os.path.exists(path))

    def writes_its_own(main_fn, argv):
        """A benchmark script that writes its JSON itself: run it, keep nothing."""
        return lambda path: main_fn(argv + [path]) and None or None

    part(
        "overhead",
        "Fig. 12: uninterrupted overhead",
        writes_its_own(engine_overhead.main, ["--rounds", "2" if args.quick else "3", "--out"]),
    )
    part(
        "bytes_energy",
        "Fig. 13/14: bytes written and energy per policy",
        lambda path: bytes_and_energy(
            model, {"4 images": small_imgs, "8 images": large_imgs}, prompt, rounds=1 if args.quick else 3
        ),
    )
    part(
        "planner",
        "Sec. 5.3: planner time and plan quality (simulated)",
        writes_its_own(recovery_planner.main, ["--seeds", "2" if args.quick else "5", "--no-gap", "--json"]),
    )
    part(
        "recovery",
        "Fig. 11: recovery latency, real engine",
        writes_its_own(recovery_latency.main, ["--repeats", "1" if args.quick else "2", "--out"]),
    )
    part("compression", "Sec. 6: decode-KV compression", lambda path: decode_compression(model, small_imgs, prompt))
    part(
        "forecast",
        "Completion forecast: calibration and error on held-out traces",
        lambda path: forecast_bench.run(draws=100 if args.quick else 200),
    )
    # The real processes, paced: 600 ms per unit of work (a prefill block of G layers is G units)
    # and 0.6 wall s per trace s (--pace-ms moves both), fixed rather than derived from a measured
    # start, so that a slow machine does not change the pace (docs/benchmarks.md). The payload's boot is emulated (15
    # trace s, docs/hil.md), so the short-window traces run too. The paper's workload (two
    # requests) and a back-to-back queue of four; OrbitWeaver with the fixed and the adaptive cadence.
    # The two parts run at once in one pool of --jobs runs, in the order of --traces
    # (hil.campaign.RunSlots): one after the other, each part's tail (the runs that never finish
    # last their trace's whole powered time) left most of the slots idle.
    slots = RunSlots(args.jobs)
    farm = None
    if args.cluster is not None:
        from hil.farm import BenchFarm, FarmError  # lazy: Ray, only for a bench farm

        # One farm for both parts: their runs wait in one queue, longest expected first, and
        # together never go out more at once than there are benches. It waits for the parts that
        # run here to hand in their runs before it hands any out.
        measured_here = [name for name, _, _ in E2E_PARTS if measures(name)]
        farm = BenchFarm(args.cluster, node_ip_address=args.node_ip_address, campaigns=max(1, len(measured_here)))
        # Joined here, in the main thread, not by the first part's thread: Ray sets its signal
        # handlers only from the main thread (and said so, with a warning, from a part's).
        try:
            farm.connect()
        except FarmError as exc:
            print(f"bench farm: {exc}", file=sys.stderr)
            return 4
    campaign_parts = [
        (
            name,
            f"Fig. 10: end-to-end through the testbench ({', '.join(pols)})",
            lambda path, pols=pols, cadences=cadences, name=name: e2e_campaign(
                model,
                small_imgs[:2],
                prompt,
                e2e_traces,
                os.path.join(out, name),
                request_seconds=100.0,
                # until the trace ends: a wall-clock limit stopped the 11,400 s traces near 5,000
                # trace s and counted what was still running as never finished
                timeout_s=None,
                pace_ms=pace_ms,
                time_scale=pace_ms / 1000.0,
                policies=list(pols),
                workloads=workloads,
                seeds=seeds,
                cadences=cadences,
                jobs=args.jobs,
                resume=args.reuse,
                slots=slots,
                executor=farm,
            ),
        )
        for name, pols, cadences in E2E_PARTS
    ]
    with ThreadPoolExecutor(max_workers=len(campaign_parts)) as pool:
        for future in [pool.submit(part, *campaign_part) for campaign_part in campaign_parts]:
            future.result()
    part(
        "validation",
        "Simulator validation against the testbench runs",
        lambda path: (
            sim_figures.validation(
                [
                    os.path.join(out, r["run_dir"])
                    for r in data.get("e2e", []) + data.get("e2e_plus", [])
                    if r.get("run_dir")
                ],
                model,
                small_imgs[:2],
                prompt,
                path,
            )
            and None
        ),
    )
    part(
        "repeats",
        "The runs the simulator missed, run again",
        lambda path: sim_figures.repeats(
            data.get("validation", {}),
            os.path.join(out, "repeats"),
            times=2 if args.quick else 3,
            jobs=args.jobs,
            resume=args.reuse,
        ),
    )
    part(
        "forecast_real",
        "Completion forecast against the end-to-end campaign's real runs",
        lambda path: forecast_bench.real([os.path.join(out, "e2e")], draws=100 if args.quick else 200),
    )
    part(
        "sim",
        "Figures 10-14 at the real model sizes (simulated)",
        writes_its_own(sim_figures.main, (["--quick"] if args.quick else []) + ["--out"]),
    )
    part(
        "real_size",
        "Real size on this CPU: Qwen3-VL-2B dimensions, killed twice in every phase, and the simulator",
        writes_its_own(real_size.main, ["--out", os.path.join(out, "real-size"), "--json"]),
    )
    data["elapsed_s"] = time.time() - t0
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    write_report(out, data)
    print(f"\nreport: {os.path.join(out, 'report.md')}")
    return 0


def write_report(out: str, d: dict) -> None:
    m = d["machine"]
    lines = [
        "# OrbitWeaver benchmark report",
        "",
        f"Hardware: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}; "
        f"torch {m['torch']}. **These are CPU timings on this machine, not Jetson timings**: read the ratios. "
        f"Where I/O matters, a *target-emulated* column throttles storage to the read-to-compute ratio of a "
        f"Jetson AGX Orin with NVMe (docs/recovery.md §7).",
        "",
    ]

    e2e = d.get("e2e", []) + d.get("e2e_plus", [])
    lines += rep.summary_lines(d)
    lines += rep.validation_lines(d)
    lines += rep.repeat_lines(d)
    lines += rep.sim_lines(d)
    missing = [
        k
        for k in ("overhead", "bytes_energy", "recovery", "compression", "planner", "e2e", "sim", "validation")
        if k not in d
    ]
    if missing:
        lines += [f"Not measured in this run (their sections are left out): {', '.join(missing)}.", ""]
    lines += _engine_sections(out, d)
    lines += _e2e_section(out, e2e)
    lines += [
        "## Where ours differs from the paper, and why",
        "",
        "- Compute here is a CPU running a ~100 M-parameter model (benchmarks) or a paced small model (testbench); "
        "the Jetson runs 2-8 B models on a GPU. The real-size columns are simulated (docs/sim.md), checked "
        "against the real processes in the validation table.",
        "- The payload's boot in the end-to-end campaign is emulated like the compute (15 trace s: a Jetson "
        "Orin's boot, docs/hil.md): the payload is forked from a process that has imported its libraries "
        "and waits the boot out at the campaign's time scale; what the flight process does after that runs "
        "on this CPU and counts in trace time at the same scale.",
        "- Bytes written compare policies on the same engine and record format; the paper's ratios are for "
        "2K-32K-token prompts on 2-8 B models: the simulated columns, from the record encoder's sizes.",
        "",
        f"Total benchmark time {d.get('elapsed_s', 0) / 60:.1f} min.",
    ]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _engine_sections(out: str, d: dict) -> list:
    lines = []
    ov, be = d.get("overhead"), d.get("bytes_energy")
    rec = d["recovery"]["rows"] if "recovery" in d else []
    if ov:
        lines += [
            "## Fig. 12 — uninterrupted overhead (real engine, this CPU)",
            "",
            f"{ov['model']}, {ov['prompt_tokens']} prompt tokens, C={ov['geometry']['chunk']} "
            f"G={ov['geometry']['group']} "
            f"D={ov['geometry']['decode_every']}: none {ov['wall_s_median']['none']:.2f} s, orbitweaver "
            f"{ov['wall_s_median']['orbitweaver']:.2f} s (median), ratio {ov['overhead_ratio_median']:.3f}; per round "
            f"{', '.join(f'{x:.3f}' for x in ov['overhead_ratios'])}. Checkpoints: "
            f"{ov['bytes_written'] / 2**20:.1f} MiB, "
            f"written at {ov['checkpoint_write_bytes_per_s'] / 2**20:.0f} MiB/s in the background (dd with fsync: "
            f"{ov['dd_write_bytes_per_s'] / 2**20:.0f} MiB/s). Peak RSS delta "
            f"{ov['peak_rss_delta_bytes'] / 2**20:+.1f} MiB = "
            f"{ov['peak_rss_delta_blocks']:+.2f} prefill blocks (median of the runs; allocator noise is a few MiB). "
            f"State held by checkpointing at its peak (exact, from the writer): "
            + ", ".join(f"{ph} {n:.2f}" for ph, n in ov.get("held_state_peak_blocks", {}).items())
            + " prefill blocks (goal <= 2 records: one being written, one queued).",
            "",
        ]
    if be:
        labels = list(be)
        plot_bars(
            os.path.join(out, "bytes.png"),
            "Fig. 13: bytes written, uninterrupted",
            labels,
            {
                pol: [be[label][pol]["bytes"] / 2**20 for label in labels]
                for pol in POLICIES + STRENGTHENED
                if pol in be[labels[0]]
            },
            "MiB",
        )
        plot_bars(
            os.path.join(out, "energy.png"),
            "Fig. 14: energy (power model), uninterrupted",
            labels,
            {
                pol: [be[label][pol]["energy_j"] for label in labels]
                for pol in ("none",) + POLICIES + STRENGTHENED
                if pol in be[labels[0]]
            },
            "J",
        )
        lines += [
            "## Fig. 13 / 14 — bytes written and energy, uninterrupted (real engine, this CPU, native storage)",
            "",
            "| prompt | policy | tokens | MiB written | vs orbitweaver | wall (s) | energy (J) |",
            "|---|---|---|---|---|---|---|",
        ]
        for label in labels:
            for pol in [p for p in ("none",) + POLICIES + STRENGTHENED if p in be[label]]:
                r = be[label][pol]
                rel = r["bytes"] / be[label]["orbitweaver"]["bytes"] if be[label]["orbitweaver"]["bytes"] else 0
                lines.append(
                    f"| {label} | {pol} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | {rel:.2f}x | {r['wall_s']:.2f} | "
                    f"{r['energy_j']:.0f} |"
                )
        lines += [
            "",
            "![bytes](bytes.png) ![energy](energy.png)",
            "",
            "Energy = 30 W x wall + 3.5 W x bytes / 1.5 GB/s (docs/hil.md power model).",
            "",
        ]
    if rec:
        names = list(dict.fromkeys(r["planner"] for r in rec))
        lines += [
            "## Fig. 11 — recovery latency (real engine, cold page cache)",
            "",
            f"{d['recovery']['model']}, {d['recovery']['prompt_tokens']} prompt tokens. Each cell: time to finish "
            f"prefill (resumed run start to prefill complete) / restart latency (that minus the uninterrupted "
            f"run's time for the same rest of prefill: what the cut itself cost). OrbitWeaver with each planner; "
            f"the paper-defined baselines with their own restore. Target-emulated reads: "
            f"{d['recovery']['emulated_read_bytes_per_s'] / 2**20:.1f} MiB/s.",
            "",
            "| progress | column | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        for prog in (0.25, 0.5, 0.75):
            for mode in ("native", "target-emulated"):
                cells = {r["planner"]: r for r in rec if r["progress"] == prog and r["mode"] == mode}
                if cells:
                    lines.append(
                        f"| {int(prog * 100)} % | {mode} | "
                        + " | ".join(
                            f"{cells[p]['latency_s']:.2f} / {cells[p].get('restart_latency_s', float('nan')):.2f} s"
                            if p in cells
                            else "-"
                            for p in names
                        )
                        + " |"
                    )
        lines += [
            "",
            "Reading the measured table: in the native column reads cost almost nothing, so every plan does "
            "the same work and the spread between planners is run-to-run noise (a few per cent, best of the "
            "repeats). In the target-emulated column the fixed chunk-first order stalls on reads (well above "
            "the bound) while layer-first and optimal stay within about 10 % of it; where optimal "
            "finds no better order than layer-first it runs layer-first's plan itself (a tie goes to the known "
            "order), so the summary says 'same plan' instead of comparing two noisy runs of one plan. Under the "
            "planner's own cost model (the simulated table below, "
            "at the real model dimensions) optimal is never slower than either fixed order.",
        ]
    if "planner" in d:
        plan_rows = [r for r in d["planner"]["makespan"] if r["column"] == "target-emulated"]
        lines += [
            "",
            "Simulated plans at the real dimensions (docs/recovery.md), makespan over the lower bound, "
            "target-emulated:",
            "",
            "| model | frontier | done | chunk-first | layer-first | optimal |",
            "|---|---|---|---|---|---|",
        ]
        for r in plan_rows:
            lines.append(
                f"| {r.get('model', '')} | {r['frontier']} | {r['progress']:.0%} | {r['chunk-first']:.3f} | "
                f"{r['layer-first']:.3f} | {r['optimal']:.3f} |"
            )
    if "real_size" in d:
        lines += [
            "",
            "## Real size on this CPU (bench/real_size.py)",
            "",
            "```",
            *real_size.summary(d["real_size"]),
            "```",
        ]
    if "forecast" in d:
        lines += [
            "",
            "## Completion forecast (bench/forecast_bench.py; window model only, docs/ground.md)",
            "",
            "```",
            forecast_bench.format_table(d["forecast"]),
            "```",
        ]
    if d.get("forecast_real", {}).get("summary"):
        lines += [
            "",
            "## Completion forecast against the real runs (bench/forecast_bench.py --runs, the e2e campaign)",
            "",
            "```",
            forecast_bench.format_real(d["forecast_real"]),
            "```",
        ]
    if "compression" in d:
        c = d["compression"]
        lines += [
            "",
            "## Sec. 6 — decode-KV compression (int8, off by default)",
            "",
            "| decode records | log bytes | restore (s) | tokens equal | bitwise | max logit diff |",
            "|---|---|---|---|---|---|",
        ]
        for mode, r in c.items():
            lines.append(
                f"| {mode} | {r['decode_log_bytes'] / 2**20:.2f} MiB | {r['restore_s']:.3f} | "
                f"{r['tokens_equal']}/{r['tokens']} | "
                f"{'yes' if r['bitwise'] else 'no'} | {r['max_logit_diff']:.3g} |"
            )
    return lines


def _completion_table(e2e: list) -> list[str]:
    """Requests completed per workload x trace x policy over the seeds (issue 10's table): the
    fixed and the adaptive cadence side by side with the baselines; a policy that completes
    nothing says so."""
    policies = sorted({r["policy"] for r in e2e}, key=lambda p: (not p.startswith("orbitweaver"), p))
    keys = list(dict.fromkeys((r.get("workload", "paper"), r["trace"]) for r in e2e))
    lines = [
        "### Requests completed within the trace, over the seeds (all outputs bitwise where completed)",
        "",
        "| workload | trace | "
        + " | ".join("orbitweaver (fixed)" if p == "orbitweaver" else p for p in policies)
        + " |",
        "|---|---|" + "---|" * len(policies),
    ]
    for workload, trace in keys:
        cells = []
        for policy in policies:
            mine = [
                r for r in e2e if (r.get("workload", "paper"), r["trace"], r["policy"]) == (workload, trace, policy)
            ]
            requests = sum(r.get("requests", 1) for r in mine)
            done = round(sum(r["completed"] * r.get("requests", 1) for r in mine))
            wrong = sum(1 for r in mine if r["completed"] and not r["correct"])
            cut_short = sum(r.get("stopped_early", 0) for r in mine)
            cells.append(
                "-"
                if not mine
                else ("**none**" if not done else f"{done}/{requests}")
                + (f" ({wrong} runs not bitwise)" if wrong else "")
                + (f" ({cut_short} stopped early)" if cut_short else "")
            )
        lines.append(f"| {workload} | {trace} | " + " | ".join(cells) + " |")
    total = {
        p: (
            round(sum(r["completed"] * r.get("requests", 1) for r in e2e if r["policy"] == p)),
            sum(r.get("requests", 1) for r in e2e if r["policy"] == p),
        )
        for p in policies
    }
    stops = [r["stopped_trace_s"] for r in e2e if r.get("stopped_early")]
    lines += [
        "| all | all | " + " | ".join(f"{d}/{n} ({d / max(1, n):.0%})" for d, n in total.values()) + " |",
        "",
        *(
            [
                f'"Stopped early": requests unfinished when a wall-clock limit stopped their run before the trace '
                f"ended ({len(stops)} runs, at {min(stops):.0f}-{max(stops):.0f} trace s): they might still have "
                "finished within the trace, and count as not completed here.",
                "",
            ]
            if stops
            else []
        ),
        "Each campaign's own report (`e2e/report.md`, `e2e_plus/report.md`) has the per-trace makespan "
        "ratios and the paper's Trace A claim checked.",
        "",
    ]
    return lines


def _farm_lines(e2e: list) -> list:
    """Where the runs ran, when a bench farm ran them (`--cluster`): none of it on this machine."""
    farmed = [r for r in e2e if r.get("bench")]
    if not farmed:
        return []
    nodes = sorted({r["bench"].rsplit(" ", 1)[-1] for r in farmed})
    again = [r for r in farmed if r.get("run_again_because")]
    return [
        f'{len(farmed)} of these {len(e2e)} runs ran on a bench farm (`--cluster`, docs/hil.md "Bench farm"): '
        f"{len({r['bench'] for r in farmed})} bench(es) on node(s) {', '.join(nodes)}; {len(again)} ran again after "
        "losing a bench under them (each campaign's report.md says where each run ran, and why any ran again).",
        "",
    ]


def _e2e_section(out: str, e2e: list) -> list:
    lines: list[str] = []
    if not e2e:
        return lines
    # rows from before the pace was recorded ran at the default pace
    paces = sorted({(r.get("pace_ms", 600.0), r.get("time_scale", 0.6)) for r in e2e})
    pace = " and ".join(
        f"{p:.0f} ms (a prefill block of G layers is G units) at {t:g} wall s per trace s" for p, t in paces
    )
    lines += [
        "## Fig. 10 — end to end, real processes through the testbench",
        "",
        f"The small model (12 layers), every unit of work paced to {pace}; "
        "checkpoint storage throttled to the Orin's read/write-to-compute "
        "ratio; prefill-heavy requests (two 512 px images, C=64, G=2): the paper's two per trace and four back "
        "to back. The payload's boot is emulated (15 trace s, docs/hil.md). Paper-defined baselines, the "
        "strengthened ones (`+`), and OrbitWeaver with the adaptive cadence. e2e is the mean over the "
        "requests that completed; `completed` says how many did.",
        "",
        *_farm_lines(e2e),
        "| trace | workload | seed | policy | completed | outputs | e2e (trace s) | cuts | MiB | energy (J) "
        "| wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in e2e:
        e2e_s = "-" if r["e2e_trace_s"] != r["e2e_trace_s"] else f"{r['e2e_trace_s']:.0f}"
        done = "**none**" if not r["completed"] else f"{r['completed']:.0%}"
        lines.append(
            f"| {r['trace']} | {r.get('workload', 'paper')} | {r.get('seed', 0)} | {r['policy']} | {done} | "
            f"{'bitwise' if r['correct'] else '-'} | {e2e_s} | {r['cuts']} | {r['mib']:.1f} | "
            f"{r['energy_j']:.0f} | {r['wall_s']:.0f} |"
        )
    traces = sorted({r["trace"] for r in e2e})
    policies = sorted({r["policy"] for r in e2e})
    lines += ["", *_completion_table(e2e)]
    plot_bars(
        os.path.join(out, "e2e.png"),
        "Fig. 10: end-to-end time per trace (trace s, paper workload, seed 0)",
        traces,
        {
            pol: [
                next(
                    (
                        r["e2e_trace_s"]
                        for r in e2e
                        if r["trace"] == t
                        and r["policy"] == pol
                        and r.get("workload", "paper") == "paper"
                        and r.get("seed", 0) == 0
                    ),
                    0,
                )
                for t in traces
            ]
            for pol in policies
        },
        "trace seconds",
    )
    lines += ["", "![e2e](e2e.png)", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
