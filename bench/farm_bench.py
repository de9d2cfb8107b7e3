"""The bench farm on this machine: scheduling overhead per run against the local pool, and a
campaign's wall time on 1, 4, 8 and 16 benches (docs/hil.md "Bench farm", docs/benchmarks.md).

    python -m bench.farm_bench [--rounds 2] [--out runs/bench/farm] [--from CAMPAIGN_DIR ...]
    python -m bench.farm_bench --overhead-s 5.2 [--from CAMPAIGN_DIR ...]   (no cluster, no runs)
    python -m bench.farm_bench --fit CAMPAIGN_DIR ... [--fit-out hil/sim/run_lengths.json]

1. Overhead. Starts a Ray cluster of one node on this machine (one `bench`) and runs the same
   small matrix -- the tiny model, a 60 s trace with one early cut, orbitweaver and none, the
   paper's two requests: 2 runs -- on the local pool (`--jobs 1`) and on the farm (1 bench),
   alternately, `--rounds` times each. Both run one run after the other, so what a campaign takes
   beyond its runs' own testbench time (each report's wall_s) is what the executor adds: keys and
   references, handing out, on the farm the task, the shipped files and the run directory sent
   back. Per run, local and farm, and their ratio. With --overhead-s, not run: that overhead
   per run (one measured earlier) is used below.
2. Wall time on 1, 4, 8 and 16 benches, COMPUTED from measured run lengths, not run: each run
   (its measured wall_s, plus the farm's overhead per run) handed in the campaign's order to the
   bench that frees first. From the runs measured in part 1, and from every run of the campaigns
   given with --from (their campaign.json).
3. make bench's 160-run end-to-end campaign (e2e and e2e_plus) on 1, 4, 8 and 16 benches,
   COMPUTED from PREDICTED run lengths, not run: the matrix planned as make bench plans it, each
   run's length from the lifecycle simulator and the fitted model (hil/sim/plan.py: time scale x
   powered trace s + a + b x power-ups), handed out in three orders -- the farm's one shared
   queue, longest expected first (hil.farm.SharedQueue); e2e then e2e_plus, each in its rank
   order; both in rank order (the traces' order, as the local pool hands them out) -- beside
   the lower bound (the work spread evenly, or the longest run).

--fit: a and b of hil/sim/plan.py fitted on the finished runs of the campaigns given (their
measured wall_s beside the simulator's prediction for their configuration): the fit, its errors
in sample and each run left out; --fit-out keeps the runs where plan.FIT is read from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_IP = "127.0.0.6"  # its own loopback address, apart from the test clusters'
BENCHES = (1, 4, 8, 16)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_node(tmp: Path) -> tuple[subprocess.Popen, str]:
    """A one-node Ray cluster with one bench (`ray start --head --block`, its own session)."""
    gcs, nm, om, grpc, http, metrics, rt_env, client = _free_ports(8)
    short = tempfile.mkdtemp(prefix="owfb-", dir="/tmp")  # Ray's socket paths must stay short
    log = tmp / "ray-head.log"
    proc = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={NODE_IP}",
            f"--port={gcs}",
            "--num-cpus=1",
            '--resources={"bench": 1}',
            f"--temp-dir={short}",
            "--include-dashboard=false",
            f"--node-manager-port={nm}",
            f"--object-manager-port={om}",
            f"--dashboard-agent-grpc-port={grpc}",
            f"--dashboard-agent-listen-port={http}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={rt_env}",
            f"--ray-client-server-port={client}",
        ],
        cwd=ROOT,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"the Ray node did not start (waited up to 300 s):\n{log.read_text()[-2000:]}")
        time.sleep(0.3)
    return proc, f"{NODE_IP}:{gcs}"


def stop_node(proc: subprocess.Popen) -> None:
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)


def short_trace(path: Path) -> str:
    """One early FDIR cut, then a long window. The cut lands before a request can end (the emulated
    boot, 1 s, plus over 40 paced units of 80 ms take longer than 3 s), so every run has exactly
    one cut however slow the machine. Flown here and by the campaign and bench farm tests."""
    import traces
    from traces.model import CutCause, PowerWindow

    traces.dump(
        traces.Trace.from_windows(
            "short",
            60,
            [PowerWindow(0, 3.0, CutCause.FDIR, 0.0), PowerWindow(4.5, 60, None, 0.0)],
            reference_request_s=10,
            description="short trace: one early cut",
            source={"kind": "manual"},
            assumptions=["bench/farm_bench.py and the campaign tests"],
        ),
        path,
    )
    return str(path)


def one_campaign(out: Path, trace: str, model: str, executor) -> dict:
    from hil.campaign import run_campaign
    from hil.testbench import BenchConfig, default_workload

    base = BenchConfig(
        trace=trace,
        model=model,
        out_dir=str(out),
        requests=1,
        workload=default_workload(1, 12),
        time_scale=1.0,
        pace_ms=80,
        boot_trace_s=1.0,
    )
    start = time.perf_counter()
    cells = run_campaign(
        base,
        [trace],
        ["orbitweaver", "none"],
        [0],
        say=lambda line: None,
        workloads=["paper"],
        cadences=["fixed"],
        jobs=1,
        executor=executor,
    )
    wall = time.perf_counter() - start
    runs = [c.report.wall_s for c in cells]
    return {
        "wall_s": wall,
        "run_wall_s": runs,
        "overhead_per_run_s": (wall - sum(runs)) / len(runs),
        "bitwise": all(c.report.all_correct for c in cells),
    }


def schedule(run_walls: list[float], benches: int, overhead_s: float) -> float:
    """Wall time of handing the runs, in this order, each to the bench that frees first."""
    from hil.sim.plan import list_schedule

    return list_schedule(run_walls, benches, overhead_s)


def plan_make_bench(out: Path) -> dict[str, list]:
    """make bench's two end-to-end parts planned as bench.run_all plans them (its defaults: every
    trace, both workloads, seeds 0 and 1, pace 600 ms at 0.6 wall s per trace s), nothing run:
    {part: its PlannedRuns}. The seed traces are generated into OUT/<part>/traces/."""
    from bench import engine_overhead
    from bench import run_all as ra
    from hil.campaign import plan_runs

    model = engine_overhead.ensure_model("small")
    images = engine_overhead.ensure_images(4, 512)[:2]
    plans = {}
    for name, policies, cadences in ra.E2E_PARTS:
        base = ra.e2e_base(
            model,
            images,
            ra.E2E_PROMPT,
            list(ra.E2E_TRACES),
            str(out / name),
            request_seconds=100.0,
            timeout_s=None,
            pace_ms=ra.E2E_PACE_MS,
            time_scale=ra.E2E_PACE_MS / 1000.0,
        )
        plans[name] = plan_runs(
            base, list(ra.E2E_TRACES), list(policies), list(ra.E2E_SEEDS), list(ra.E2E_WORKLOADS), list(cadences)
        )
    return plans


def planned_orders(plans: dict[str, list], expected: dict[str, float]) -> dict[str, list[float]]:
    """The expected lengths in the order each way of handing the runs out takes them."""
    from hil.farm import BenchFarm

    farm = BenchFarm("unused:0", campaigns=len(plans))  # its queue only: nothing goes out
    farm.expected_s.update(expected)
    for runs in plans.values():
        farm.enqueue(runs, lambda run, where: None, lambda run, outcome: None, threading.Event())
    shared = []
    while (item := farm.queue.take()) is not None:
        shared.append(item.expected_s)
    one_then_other = [expected[r.cfg.out_dir] for runs in plans.values() for r in sorted(runs, key=lambda r: r.rank)]
    by_rank = [
        expected[r.cfg.out_dir] for r in sorted((r for runs in plans.values() for r in runs), key=lambda r: r.rank)
    ]
    names = " then ".join(plans)
    return {
        "one shared queue, longest expected first (the farm now)": shared,
        f"{names}, each in its rank order (before)": one_then_other,
        "both in rank order (the traces' order, as the local pool)": by_rank,
    }


def print_planned(out: Path, overhead_s: float, summary: dict) -> None:
    """Part 3: make bench's campaign on BENCHES benches from predicted run lengths."""
    from hil.sim import plan

    plans = plan_make_bench(out / "plan")
    predictor = plan.RunPredictor()
    predictions = {r.cfg.out_dir: predictor.predict(r.cfg) for runs in plans.values() for r in runs}
    expected = {key: plan.FIT.wall_s(p) for key, p in predictions.items()}
    lengths = list(expected.values())
    fit = plan.FIT
    print(
        f"\nmake bench's end-to-end campaign, {len(lengths)} runs "
        f"({', '.join(f'{k} {len(v)}' for k, v in plans.items())}), "
        f"PREDICTED run lengths (hil/sim/plan.py: time scale x powered trace s from the lifecycle simulator + "
        f"a {fit.a_s:.2f} s + b {fit.b_s:.3f} s x power-ups, fitted on {fit.runs} real runs: in sample median "
        f"{100 * (fit.median_error or 0):.1f} %, max {100 * (fit.max_error or 0):.1f} %): {sum(lengths) / 3600:.1f} "
        f"run-hours, the longest {max(lengths):.0f} s; wall time COMPUTED (not run), each run plus the farm's "
        f"overhead ({overhead_s:.2f} s per run) handed to the bench that frees first"
    )
    orders = planned_orders(plans, expected)
    rows: dict[str, dict[int, float]] = {
        label: {n: schedule(o, n, overhead_s) for n in BENCHES} for label, o in orders.items()
    }
    rows["lower bound (work / benches, or the longest run)"] = {
        n: plan.lower_bound(lengths, n, overhead_s) for n in BENCHES
    }
    width = max(len(label) for label in rows)
    print(f"  {'benches':{width}s}" + "".join(f"{n:>16d}" for n in BENCHES))
    for label, row in rows.items():
        print(f"  {label:{width}s}" + "".join(f"{wall:9.0f} s {wall / 3600:4.2f}h" for wall in row.values()))
    summary["planned"] = {
        "fit": {
            "a_s": fit.a_s,
            "b_s": fit.b_s,
            "runs": fit.runs,
            "median_error": fit.median_error,
            "max_error": fit.max_error,
            "loo_median_error": fit.loo_median_error,
            "loo_max_error": fit.loo_max_error,
        },
        "runs": {
            Path(k).name + f" ({Path(k).parent.parent.name})": {"expected_s": expected[k], **p.to_json()}
            for k, p in predictions.items()
        },
        "run_hours": sum(lengths) / 3600,
        "schedule": rows,
    }


def print_fit(campaigns: list[str], fit_out: str | None) -> None:
    """--fit: a and b on the real runs of `campaigns`, each run's measured and expected wall time."""
    from hil.sim import plan

    rows = plan.rows_of(campaigns)
    fitted = plan.fit(rows)
    print(f"{'run':58s} {'measured':>9s} {'expected':>9s} {'power-ups':>9s}  error")
    for r in rows:
        expected = fitted.wall_s(r.prediction)
        print(
            f"{Path(r.run_dir).name:58s} {r.measured_wall_s:8.1f}s {expected:8.1f}s {r.prediction.power_ups:9d}  "
            f"{100 * (expected - r.measured_wall_s) / r.measured_wall_s:+.1f} %"
        )
    print(
        f"\nexpected wall s = time scale x powered trace s + a + b x power-ups: a {fitted.a_s:.2f} s, "
        f"b {fitted.b_s:.3f} s, on {fitted.runs} runs; |error| IN SAMPLE median "
        f"{100 * (fitted.median_error or 0):.1f} %, "
        f"max {100 * (fitted.max_error or 0):.1f} %; each run left out of its fit: median "
        f"{100 * (fitted.loo_median_error or 0):.1f} %, max {100 * (fitted.loo_max_error or 0):.1f} %"
    )
    # the order the plan gives, judged on what the runs really took
    measured = [r.measured_wall_s for r in rows]
    by_prediction = [r.measured_wall_s for r in sorted(rows, key=lambda r: -fitted.wall_s(r.prediction))]
    orders = {
        "longest expected first (the plan's order)": by_prediction,
        "longest measured first (known only afterwards)": sorted(measured, reverse=True),
        "the campaigns' own order": measured,
    }
    print(
        "\nthese runs' MEASURED lengths on N benches, COMPUTED (not run), no overhead; "
        f"{' / '.join(map(str, BENCHES))}:"
    )
    for label, lengths in orders.items():
        print(f"  {label:48s} " + " / ".join(f"{schedule(lengths, n, 0.0):.0f}" for n in BENCHES) + " s")
    print(f"  {'lower bound':48s} " + " / ".join(f"{plan.lower_bound(measured, n):.0f}" for n in BENCHES) + " s")
    if fit_out:
        Path(fit_out).write_text(json.dumps(plan.rows_to_json(rows), indent=1) + "\n")
        print(f"runs kept in {fit_out}")


def print_schedules(sources: dict[str, list[float]], overhead_s: float, summary: dict) -> None:
    """The wall time on each of BENCHES for each source's runs (printed, and kept in `summary`)."""
    for label, walls in sources.items():
        print(
            f"\nwall time on N benches, COMPUTED (not run): {label} ({len(walls)} runs, "
            f"{sum(walls) / 3600:.2f} run-hours, longest {max(walls):.0f} s), each handed in the campaign's order "
            f"to the bench that frees first, plus the farm's overhead ({overhead_s:.2f} s per run)"
        )
        rows = {n: schedule(walls, n, overhead_s) for n in BENCHES}
        summary["schedule"][label] = rows
        for n, wall in rows.items():
            print(f"  {n:2d} bench(es): {wall:9.1f} s ({wall / 3600:.2f} h)")


def from_campaigns(campaigns: list[str]) -> dict[str, list[float]]:
    """Each campaign's runs, and, for several, all of them as one campaign in the order given (as
    make bench runs its two end-to-end parts on one farm)."""
    sources = {f"the runs of {c}": runs_of(c) for c in campaigns}
    if len(campaigns) > 1:
        sources[f"the runs of all {len(campaigns)} campaigns as one"] = [w for c in campaigns for w in runs_of(c)]
    return sources


def runs_of(campaign_dir: str) -> list[float]:
    rows = json.loads((Path(campaign_dir) / "campaign.json").read_text())["rows"]
    return [float(r["wall_s"]) for r in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="campaigns of each kind, alternating (default 2)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench" / "farm"))
    p.add_argument(
        "--from",
        dest="campaigns",
        nargs="*",
        default=[],
        help="campaign directories whose runs' wall times the schedule also uses (their campaign.json)",
    )
    p.add_argument(
        "--overhead-s",
        type=float,
        default=None,
        help="skip part 1 (no cluster, no runs): compute the schedules with this overhead per run, in "
        "seconds (one part 1 measured earlier)",
    )
    p.add_argument(
        "--no-plan",
        action="store_true",
        help="skip part 3 (make bench's campaign from predicted run lengths)",
    )
    p.add_argument(
        "--fit",
        nargs="+",
        default=None,
        metavar="CAMPAIGN_DIR",
        help="only fit a and b of hil/sim/plan.py on these campaigns' finished runs, and print the fit",
    )
    p.add_argument("--fit-out", default=None, help="with --fit: keep the runs in this file (hil/sim/run_lengths.json)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.fit_out is not None and args.fit is None:
        p.error("--fit-out goes with --fit")
    if args.fit is not None:
        print_fit(args.fit, args.fit_out)
        return 0
    if args.overhead_s is not None:
        if args.overhead_s < 0:
            p.error("--overhead-s must not be negative")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary: dict = {"overhead_per_run_s": {"farm": args.overhead_s, "given": True}, "schedule": {}}
        print_schedules(from_campaigns(args.campaigns), args.overhead_s, summary)
        if not args.no_plan:
            print_planned(out, args.overhead_s, summary)
        (out / "farm-bench.json").write_text(json.dumps(summary, indent=2))
        print(f"\n{out / 'farm-bench.json'}")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from common import log as owlog
    from hil.farm import BenchFarm
    from hil.testbench_cli import ensure_model

    owlog.setup("error")  # the runs' link and ground lines are not what this prints
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = os.path.abspath(ensure_model(None))
    trace = short_trace(out / "short.jsonl")
    node, address = start_node(out)
    results: dict[str, list[dict]] = {"local": [], "farm": []}
    try:
        farm = BenchFarm(address, node_ip_address=NODE_IP)
        for k in range(args.rounds):
            # alternating, the first kind swapped each round: drift in the machine's load falls on both
            for kind in ("local", "farm") if k % 2 == 0 else ("farm", "local"):
                result = one_campaign(out / f"round{k}-{kind}", trace, model, farm if kind == "farm" else None)
                results[kind].append(result)
                print(
                    f"round {k} {kind:5s}: campaign {result['wall_s']:.1f} s, runs "
                    + ", ".join(f"{w:.1f}" for w in result["run_wall_s"])
                    + f" s, overhead {result['overhead_per_run_s']:.2f} s per run, bitwise {result['bitwise']}",
                    flush=True,
                )
    finally:
        import ray

        # the driver leaves the cluster before it goes: a driver whose cluster is gone ends its
        # own process a minute later (the Ray core worker), in the middle of part 3
        ray.shutdown()
        stop_node(node)
    local = statistics.median(r["overhead_per_run_s"] for r in results["local"])
    remote = statistics.median(r["overhead_per_run_s"] for r in results["farm"])
    measured = [w for kind in results.values() for r in kind for w in r["run_wall_s"]]
    summary = {
        "overhead_per_run_s": {"local": local, "farm": remote, "ratio": remote / local if local > 0 else None},
        "rounds": results,
        "schedule": {},
    }
    print(
        f"\nscheduling overhead per run (median of {args.rounds} campaigns each, 2 runs one after the other): "
        f"local pool {local:.2f} s, bench farm {remote:.2f} s, ratio {remote / local:.2f}"
        if local > 0
        else f"\nscheduling overhead per run: local pool {local:.2f} s, bench farm {remote:.2f} s"
    )
    sources = {f"the {len(measured)} runs measured here": measured}
    sources.update(from_campaigns(args.campaigns))
    print_schedules(sources, remote, summary)
    if not args.no_plan:
        print_planned(out, remote, summary)
    (out / "farm-bench.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{out / 'farm-bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
