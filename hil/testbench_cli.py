"""`ow hil run | campaign | replay | deploy`: the testbench from the command line.

Exit status: 0 every request completed with its reference answer (replay: identical); 1 not
(replay: a divergence); 2 a bad argument or trace; 3 an unusable model directory; 6 out of
memory (common.errors). Every value is checked before anything is written (docs/hil.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import traces
from common import log as owlog
from common.errors import CliError, check_number
from common.wire.ids import MAX_NEW_TOKENS
from flight.checkpoint.policies import POLICIES
from flight.cli_options import check_directory_option
from flight.model.config import ModelError, check_weight_files, read_model_type

DEFAULT_MODEL = os.path.join("runs", "models", "qwen3-vl-tiny")
EXIT_USAGE, EXIT_MODEL = 2, 3


def register_testbench(hsub) -> None:
    run = hsub.add_parser(
        "run",
        help="run the real bus and payload against a trace with a workload; measure and check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start `ow bus run` on TRACE (it spawns and SIGKILLs `ow flight run`), uplink N requests through\n"
        "the ground link, wait for every result and measure per request: end-to-end time, cuts suffered,\n"
        "recovery latency, work lost, bytes written, energy. Every answer is checked bit for bit against\n"
        "an uninterrupted reference. Writes OUT/report.json and OUT/summary.txt.",
    )
    _common(run)
    run.add_argument("--trace", required=True, help="trace file or shipped name (ow hil trace-info lists them)")
    run.add_argument("--policy", default="orbitweaver", help="checkpoint policy (default orbitweaver)")
    run.add_argument(
        "--cadence",
        choices=["fixed", "adaptive"],
        default=None,
        help="orbitweaver's checkpoint cadence (docs/engine.md); default: the policy's, adaptive for "
        "orbitweaver, fixed for the baselines (they keep their own)",
    )
    run.set_defaults(func=cmd_run)

    camp = hsub.add_parser(
        "campaign",
        help="a matrix of traces x workloads x seeds x policies; writes a markdown report with plots",
        description="Run the testbench for every trace x workload x seed x policy (orbitweaver once per cadence) and "
        "write OUT/report.md (completion per policy and trace beside end-to-end times, speed-ups only "
        "where both sides completed everything, every run, PNG plots) and OUT/campaign.json. Seed 0 uses "
        "a shipped trace as is; other seeds generate another realisation of a generated trace kind. "
        "The defaults run everything: 5 traces x 2 workloads x 2 seeds x 5 policy variants = 100 runs "
        "(hours; --jobs runs several at once). --quick runs 2 (minutes). Ctrl-C stops a campaign; the same "
        "command with --resume keeps the runs it finished and runs the rest.",
    )
    _common(camp)
    camp.add_argument(
        "--quick",
        action="store_true",
        help="a campaign of minutes: " + _quick_text() + "; options given as well win",
    )
    camp.add_argument(
        "--traces",
        default=None,
        help="comma-separated traces (default: the five shipped generated ones, " + CAMPAIGN_FULL["traces"] + ")",
    )
    camp.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies (default orbitweaver and the three baselines)",
    )
    camp.add_argument(
        "--cadences",
        default=None,
        help="orbitweaver's checkpoint cadences, side by side (default fixed,adaptive)",
    )
    camp.add_argument(
        "--workloads",
        default=None,
        help="paper: the two specified requests per trace; back-to-back: four requests in one queue (default both)",
    )
    camp.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds; seed 0 plays the shipped trace, others regenerate it (default 0,1)",
    )
    camp.add_argument("--jobs", type=int, default=1, help="runs at once (each a bus, a payload and a ground link)")
    camp.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs an earlier campaign into OUT finished with the same configuration, run only the "
        "others (each finished run leaves OUT/runs/<run>/campaign-run.json); rerun without it after changing code",
    )
    camp.set_defaults(func=cmd_campaign)

    rep = hsub.add_parser(
        "replay",
        help="re-drive a recorded bus run against this build; fail on any divergence",
        description="Read a bus run log (a bus data dir's bus-log.jsonl), start a fresh bus and payload on the same "
        "trace and time scale, re-send every recorded telecommand at its recorded instant, and compare "
        "the power timeline, every command's outcome and every task's reports and answer. Exit 0 if "
        "identical, 1 on a divergence (listed).",
    )
    rep.add_argument("log", help="bus-log.jsonl of the run to replay")
    rep.add_argument("--model", default=None, help="model directory (default: the recording's)")
    rep.add_argument("--out", default=None, help="where the replay runs (default: a new directory under runs/)")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=cmd_replay)

    dep = hsub.add_parser(
        "deploy",
        help="the 72-hour two-satellite deployment in compressed time",
        description="Two buses and payloads, one per satellite, on deployment traces (one payload window per orbit), "
        "REQUESTS arriving at random over HOURS; idle spans are skipped so 72 hours take minutes. Reports "
        "requests completed, shutdowns, interrupted requests and windows per request beside the paper's.",
    )
    dep.add_argument("--hours", type=float, default=72.0)
    dep.add_argument("--requests", type=int, default=50)
    dep.add_argument("--seed", type=int, default=1)
    dep.add_argument("--scale", type=float, default=0.03, help="wall seconds per trace second while work runs")
    dep.add_argument(
        "--model", default=None, help=f"model directory (default: build the tiny model in {DEFAULT_MODEL})"
    )
    dep.add_argument("--out", default=os.path.join("runs", "deploy"))
    dep.add_argument("--json", action="store_true")
    dep.set_defaults(func=cmd_deploy)


#: `ow hil campaign`'s axes without --quick: the paper's evaluation (100 runs, hours).
CAMPAIGN_FULL = {
    "traces": "trace-a,trace-b,sat1-like,sat2-like,dellingr-like",
    "policies": "orbitweaver,sonic-layer,sonic-chunk,hcache",
    "cadences": "fixed,adaptive",
    "workloads": "paper,back-to-back",
    "seeds": "0,1",
}
#: --quick: two runs on the demo trace (its four cuts, then power to the end, so every policy
#: finishes), orbitweaver beside one baseline, with the demo trace's 3 s payload boot (a Jetson's
#: 15 s would not fit its 12-14 s windows): a few minutes on a 2-core machine.
CAMPAIGN_QUICK = {
    "traces": "demo",
    "policies": "orbitweaver,sonic-layer",
    "cadences": "adaptive",
    "workloads": "paper",
    "seeds": "0",
    "boot_trace_s": "3",
}


def _quick_text() -> str:
    q = CAMPAIGN_QUICK
    return (
        f"--traces {q['traces']} --workloads {q['workloads']} --seeds {q['seeds']} --policies {q['policies']} "
        f"--cadences {q['cadences']} --boot-trace-s {q['boot_trace_s']} (2 runs)"
    )


def _common(p) -> None:
    p.add_argument("--requests", type=int, default=3, help="requests in the workload (sample images, rotating prompts)")
    p.add_argument("--model", default=None, help=f"model directory (default: build the tiny model in {DEFAULT_MODEL})")
    p.add_argument(
        "--time-scale",
        default="auto",
        help="wall seconds per trace second, or auto: one uninterrupted request (boot included) lasts "
        "the trace's reference request (180 trace s: the paper's three-minute missions)",
    )
    p.add_argument(
        "--request-seconds",
        type=float,
        default=20.0,
        help="with --pace-ms unset: pace the payload so one uninterrupted request takes this long (wall)",
    )
    p.add_argument("--pace-ms", type=float, default=None, help="per-unit pace of the payload (ms)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--decode-every", type=int, default=4)
    p.add_argument(
        "--planner",
        default="optimal",
        help="OrbitWeaver's recovery planner (default optimal; baselines restore with their own scheduler)",
    )
    p.add_argument(
        "--storage",
        choices=["native", "target"],
        default="native",
        help="native (default): this machine's disk; target: throttle the payload's checkpoint storage "
        "to a Jetson Orin NVMe's read/write-to-compute ratio against the pace -- meant for models "
        "with real proportions, not the tiny one (docs/hil.md, Storage)",
    )
    p.add_argument(
        "--boot-trace-s",
        default=None,
        metavar="S|real",
        help="the payload's boot in trace seconds, emulated: each payload is forked from a process that "
        "has imported its libraries and waits S trace seconds (scaled like the compute) after "
        "power-on; `real`: exec it and pay this machine's start-up inside the window (default "
        "15 trace s: a Jetson Orin's boot, hil.testbench.TARGET_BOOT_TRACE_S; docs/hil.md)",
    )
    p.add_argument("--start-at", type=float, default=0.0, help="trace second to start at")
    p.add_argument("--timeout", type=float, default=None, help="wall seconds to wait for all results")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def ensure_model(path: str | None) -> str:
    if path:
        try:
            read_model_type(path)
            check_weight_files(path)  # a truncated weight file: one line here, before any run starts
        except ModelError as exc:
            raise CliError(str(exc), EXIT_MODEL) from None
        return path
    if not os.path.exists(os.path.join(DEFAULT_MODEL, "model.safetensors")):
        # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
        from flight.model.tiny import build_tiny

        build_tiny("qwen3-vl", "tiny", 0, DEFAULT_MODEL)
    return DEFAULT_MODEL


def check_run_numbers(args) -> float | str:
    """The numeric options `ow hil run` and `ow hil campaign` share, each a one-line EXIT_USAGE
    error when not finite or out of its range (a negative time scale or pace would reach the bus
    or the payload, which refuse it at every start). Returns the time scale (a number or "auto")."""
    scale: float | str = "auto"
    if args.time_scale != "auto":
        try:
            scale = float(args.time_scale)
        except ValueError:
            raise CliError(f"--time-scale must be a number or auto, not {args.time_scale!r}", EXIT_USAGE) from None
        check_number(scale, "--time-scale", above=0)
    if args.requests < 1:
        raise CliError("--requests must be at least 1", EXIT_USAGE)
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise CliError(f"--max-new-tokens must be 1..{MAX_NEW_TOKENS}, not {args.max_new_tokens}", EXIT_USAGE)
    for flag, value in (("--chunk", args.chunk), ("--group", args.group), ("--decode-every", args.decode_every)):
        if value < 1:
            raise CliError(f"{flag} must be at least 1, not {value}", EXIT_USAGE)
    check_number(args.request_seconds, "--request-seconds", above=0)
    check_number(args.pace_ms, "--pace-ms", at_least=0)
    check_number(args.start_at, "--start-at", at_least=0)
    check_number(args.timeout, "--timeout", above=0)
    from flight.options import PLANNER_NAMES  # the names the payload checks, without importing a planner

    if args.planner not in PLANNER_NAMES:  # the payload would refuse it at every boot
        raise CliError(f"unknown --planner {args.planner!r}; choose from {', '.join(PLANNER_NAMES)}", EXIT_USAGE)
    return scale


def _config(args, trace: str, policy: str):
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.testbench import BenchConfig, default_workload

    scale = check_run_numbers(args)
    check_directory_option(args.out, "--out")
    boot = parse_boot(args.boot_trace_s)
    return BenchConfig(
        trace=trace,
        model=ensure_model(args.model),
        out_dir=args.out,
        policy=policy,
        requests=args.requests,
        workload=default_workload(args.requests, args.max_new_tokens),
        time_scale=scale,
        request_seconds=args.request_seconds,
        pace_ms=args.pace_ms,
        chunk=args.chunk,
        group=args.group,
        decode_every=args.decode_every,
        planner=args.planner,
        start_at_s=args.start_at,
        timeout_s=args.timeout,
        boot_trace_s=boot,
        emulate_target_storage=args.storage == "target",
        cadence=getattr(args, "cadence", None),  # None: the policy's default
    )


def parse_boot(text: str | None):
    """--boot-trace-s: None (default: the target's), `real`, or a number of trace seconds."""
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.testbench import TARGET_BOOT_TRACE_S

    if text is None:
        return TARGET_BOOT_TRACE_S
    if text == "real":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise CliError(f"--boot-trace-s must be a finite number of trace seconds >= 0 or `real`, not {text!r}", 2)
    return value


def _check_trace(trace: str, start_at: float = 0.0) -> None:
    try:
        path = traces.resolve(trace)
    except FileNotFoundError as exc:
        raise CliError(str(exc), 2) from None
    problems = traces.validate(path)
    if problems:
        raise CliError(f"invalid trace: {problems[0]}", 2)
    duration = traces.load(path).duration_s
    if start_at >= duration:
        raise CliError(f"--start-at {start_at:g} is not before the end of trace {trace} ({duration:g} s)", 2)


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise CliError(f"unknown policy {policy!r}; choose from {', '.join(sorted(POLICIES))}", 2)


def cmd_run(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.testbench import EarlierRunError, Testbench

    owlog.setup(args.log_level, component="hil")
    check_run_numbers(args)  # first: --start-at is checked against the trace next
    _check_trace(args.trace, args.start_at)
    _check_policy(args.policy)
    if args.cadence == "adaptive" and args.policy != "orbitweaver":  # the payload would refuse it at every boot
        raise CliError(f"--cadence adaptive is orbitweaver's; the {args.policy} baseline keeps its own", 2)
    try:
        report = Testbench(_config(args, args.trace, args.policy)).run()
    except EarlierRunError as exc:
        raise CliError(str(exc), 2) from None
    except ModelError as exc:  # one the weight check cannot see (a tensor missing): the reference run's load
        raise CliError(str(exc), EXIT_MODEL) from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.summary())
        print(f"report: {os.path.join(args.out, 'report.json')} and {os.path.join(args.out, 'summary.txt')}")
        bus = os.path.join(args.out, "bus")
        print(f"data:   {bus}/ (the bus log, which `ow hil replay` re-drives, and the payload's)")
    return 0 if report.completion_rate == 1.0 and report.all_correct else 1


def cmd_campaign(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.campaign import WORKLOADS, run_campaign

    owlog.setup(args.log_level, component="hil")
    preset = CAMPAIGN_QUICK if args.quick else CAMPAIGN_FULL
    for axis in ("traces", "policies", "cadences", "workloads", "seeds"):
        if getattr(args, axis) is None:
            setattr(args, axis, preset[axis])
    if args.quick and args.boot_trace_s is None:
        args.boot_trace_s = CAMPAIGN_QUICK["boot_trace_s"]
    traces_ = [t for t in args.traces.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    cadences = [c for c in args.cadences.split(",") if c]
    workloads = [w for w in args.workloads.split(",") if w]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise CliError("--seeds must be comma-separated integers", 2) from None
    check_run_numbers(args)
    for t in traces_:
        _check_trace(t, args.start_at)
    for p in policies:
        _check_policy(p)
    if not traces_ or not policies or not seeds or not cadences or not workloads:
        raise CliError("--traces, --policies, --cadences, --workloads and --seeds each need at least one value", 2)
    if bad := [c for c in cadences if c not in ("fixed", "adaptive")]:
        raise CliError(f"unknown cadence {bad[0]!r} (fixed, adaptive)", 2)
    if bad := [w for w in workloads if w not in WORKLOADS]:
        raise CliError(f"unknown workload {bad[0]!r} ({', '.join(WORKLOADS)})", 2)
    if args.jobs < 1:
        raise CliError("--jobs must be at least 1", 2)
    stop = threading.Event()

    def interrupted(signum, frame) -> None:
        # at once, before the runs whose buses the same Ctrl-C stopped can be recorded as finished
        stop.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        cells = run_campaign(
            _config(args, traces_[0], policies[0]),
            traces_,
            policies,
            seeds,
            workloads=workloads,
            cadences=cadences,
            jobs=args.jobs,
            max_new_tokens=args.max_new_tokens,
            say=lambda line: print(line, flush=True),
            resume=args.resume,
            stop=stop,
        )
    except KeyboardInterrupt:
        from hil.campaign import RUN_RECORD

        finished = len(list(Path(args.out).glob(f"runs/*/{RUN_RECORD}")))
        print(
            f"[campaign] stopped: {finished} finished run(s) are kept in {args.out} (runs cut short are not); "
            "run the same command with --resume to run the rest",
            flush=True,
        )
        _print_campaign_outputs(args.out)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    _print_campaign_outputs(args.out)
    return 0 if all(c.report.all_correct for c in cells if any(r.completed for r in c.report.requests)) else 1


def _print_campaign_outputs(out: str) -> None:
    if not os.path.exists(os.path.join(out, "report.md")):
        print(f"report: none yet in {out} (no run finished)", flush=True)
        return
    print(f"report: {os.path.join(out, 'report.md')} (with its plots, *.png)", flush=True)
    runs = os.path.join(out, "runs", "<run>")
    print(f"data:   {os.path.join(out, 'campaign.json')}; each run in {runs}/", flush=True)


def cmd_replay(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.replay import replay

    owlog.setup("warning", component="hil")
    if not os.path.isfile(args.log):
        raise CliError(f"no such log: {args.log}", 2)
    out = args.out or os.path.join("runs", f"replay-{time.strftime('%Y%m%d-%H%M%S')}")
    check_directory_option(out, "--out")
    try:
        report = replay(args.log, out, model=args.model)
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    if args.json:
        print(json.dumps({"passed": report.passed, "differences": report.differences, "notes": report.notes}, indent=2))
    else:
        for note in report.notes:
            print(f"note: {note}")
        if report.passed:
            print(f"replay identical: {report.commands_sent} commands re-sent, no divergence ({out})")
        else:
            print(f"replay DIVERGED ({len(report.differences)} differences; {out}):")
            for d in report.differences:
                print(f"  - {d}")
    return 0 if report.passed else 1


def cmd_deploy(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.deploy import run_deploy

    owlog.setup("warning", component="hil")
    check_number(args.hours, "--hours", above=0)
    check_number(args.scale, "--scale", above=0)
    check_directory_option(args.out, "--out")
    if args.requests < 2:
        raise CliError("--requests must be at least 2", 2)
    report = run_deploy(ensure_model(args.model), args.out, args.hours, args.requests, args.seed, args.scale)
    if args.json:
        print(json.dumps(report.__dict__, indent=2, default=str))
    else:
        print(report.summary())
        print(f"report: {os.path.join(args.out, 'deploy-report.json')} and {os.path.join(args.out, 'summary.txt')}")
        print(f"data:   {args.out}/ (the two satellites' traces, bus logs and payload data)", flush=True)
    return 0 if report.completed == report.requests else 1
