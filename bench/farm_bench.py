"""The bench farm on this machine: scheduling overhead per run against the local pool, and a
campaign's wall time on 1, 4, 8 and 16 benches (docs/hil.md "Bench farm").

    python -m bench.farm_bench [--rounds 2] [--out runs/bench/farm] [--from CAMPAIGN_DIR ...]
    python -m bench.farm_bench --from CAMPAIGN_DIR ... --overhead-s 5.2   (part 2 only, no cluster)

1. Overhead. Starts a Ray cluster of one node on this machine (one `bench`) and runs the same
   small matrix -- the tiny model, a 60 s trace with one early cut, orbitweaver and none, the
   paper's two requests: 2 runs -- on the local pool (`--jobs 1`) and on the farm (1 bench),
   alternately, `--rounds` times each. Both run one run after the other, so what a campaign takes
   beyond its runs' own testbench time (each report's wall_s) is what the executor adds: keys and
   references, handing out, on the farm the task, the shipped files and the run directory sent
   back. Per run, local and farm, and their ratio.
2. Wall time on 1, 4, 8 and 16 benches, COMPUTED from measured run lengths, not run: each run
   (its measured wall_s, plus the farm's measured overhead per run) handed in the campaign's
   order to the bench that frees first, as the farm's driver hands them out. From the runs
   measured in part 1, or from every run of the campaigns given with --from (their
   campaign.json: make bench's `e2e` and `e2e_plus`, say). With --overhead-s, part 1 is not run:
   the schedule adds that overhead per run (one measured earlier) to the --from campaigns' runs.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
    free = [0.0] * benches
    end = 0.0
    for wall in run_walls:
        start = heapq.heappop(free)
        finish = start + wall + overhead_s
        end = max(end, finish)
        heapq.heappush(free, finish)
    return end


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
        help="skip part 1 (no cluster, no runs): compute the schedule of the --from campaigns with this "
        "overhead per run, in seconds (one part 1 measured earlier)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.overhead_s is not None:
        if args.overhead_s < 0:
            p.error("--overhead-s must not be negative")
        if not args.campaigns:
            p.error("--overhead-s computes the schedule of the --from campaigns: name at least one")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary: dict = {"overhead_per_run_s": {"farm": args.overhead_s, "given": True}, "schedule": {}}
        print_schedules(from_campaigns(args.campaigns), args.overhead_s, summary)
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
    (out / "farm-bench.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{out / 'farm-bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
