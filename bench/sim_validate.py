"""The simulator against testbench runs, per request: measured vs predicted end-to-end time.

    python -m bench.sim_validate RUN_DIR [RUN_DIR ...] [--model DIR] [--json OUT]

Each RUN_DIR is one testbench run (`ow hil run`, or a campaign's `runs/<name>`: report.json,
references.json, bus/bus-log.jsonl); a campaign directory stands for all of its runs. Every request
of every run is predicted by hil/sim/validate.py as `make bench` does it (bench/sim_figures.py's
`validation`), with that run's own parameters; `--image`, `--prompt`, `--tokens` and the geometry
below stand in only for a run that does not record its own requests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench.report import after_stop_verdict, by_cuts_sentence, given_previous_cell, given_previous_sentence
from flight.checkpoint.policies import Geometry

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_dirs(paths: list[str]) -> list[str]:
    """Run directories: each path itself if it holds a report.json, else its runs/ (or itself)
    searched one level down (a campaign's output directory). Runs still going (no report.json)
    are left out."""
    out = []
    for path in paths:
        if os.path.isfile(os.path.join(path, "report.json")):
            out.append(path)
            continue
        parent = os.path.join(path, "runs") if os.path.isdir(os.path.join(path, "runs")) else path
        out += sorted(
            os.path.join(parent, name)
            for name in os.listdir(parent)
            if os.path.isfile(os.path.join(parent, name, "report.json"))
        )
    return out


def _n(value) -> str:
    return "-" if value is None else str(value)


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(result: dict) -> list[str]:
    """One line per request, then the summary. G: the prefill block's layers the simulated task
        ran with; early r/s: the early records the adaptive cadence asked for, in the run (the payload's
    log) and in the simulation."""
    head = (
        f"{'run':<48} {'req':>3} {'policy (cadence)':<26} {'cuts r/s':>8} {'G':>2} {'early r/s':>9} "
        f"{'measured':>9} {'predicted':>9}  {'error':<12} error behind the request before as it ran"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        cadence = r.get("cadence") or "fixed"
        policy = r["policy"] + ("" if r["policy"] != "orbitweaver" else f" ({cadence})")
        predicted_done = r.get("predicted_completed")
        if not r.get("comparable", True):
            error = f"not measured ({r.get('failure') or 'no COMPLETED report'})"
        elif predicted_done is not None and bool(predicted_done) != (r.get("e2e_trace_s") is not None):
            error = "MISS: " + ("only the simulation completes" if predicted_done else "only the run completes")
        elif r.get("error") is not None:
            error = f"{r['error'] * 100:+.1f} %"
        else:
            error = after_stop_verdict(r) or "n/a"
        cuts = f"{r.get('cuts') if r.get('cuts') is not None else '-'}/{r.get('predicted_cuts', '-')}"
        group = r.get("predicted_group")
        early = f"{_n(r.get('early_records'))}/{_n(r.get('predicted_early_records'))}"
        lines.append(
            f"{os.path.basename(str(r['run_dir']).rstrip('/')):<48} {r['request']:>3} {policy:<26} {cuts:>8} "
            f"{'-' if group is None else group:>2} {early:>9} "
            f"{_s(r.get('e2e_trace_s')):>9} {_s(r.get('predicted_e2e_trace_s')):>9}  {error:<12} "
            f"{given_previous_cell(r)}"
        )
    errors = [r for r in result["rows"] if r.get("error") is not None]
    within = sum(1 for r in errors if abs(r["error"]) <= 0.10)
    largest = result.get("max_abs_error")
    lines += [
        "",
        f"requests: {result['requests']} in {result['runs']} runs; compared: {len(errors)}; within 10 %: {within}; "
        f"largest error: {'-' if largest is None else f'{largest * 100:.1f} %'}; "
        f"completed on one side only: {result['completion_misses']}; "
        f"commit latency: {result['commit_latency_s'] * 1e3:.2f} ms",
    ]
    if by_cuts := by_cuts_sentence(result):
        lines.append(by_cuts.strip())
    if given := given_previous_sentence(result):
        lines.append(given.strip())
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim_validate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="testbench run directories, or campaign directories")
    p.add_argument(
        "--model",
        default=os.path.join(ROOT, "runs", "models", "qwen3-vl-tiny"),
        help="the model the runs served, for a run whose recorded model directory is gone (a run names its own)",
    )
    p.add_argument("--image", action="append", default=[], help="stand-in image (runs that record none)")
    p.add_argument("--prompt", default="describe the scene", help="stand-in prompt (runs that record none)")
    p.add_argument("--tokens", type=int, default=8, help="stand-in answer length (runs that record none)")
    p.add_argument(
        "--commit-latency-ms",
        type=float,
        help="this disk's commit latency (default: measured now, which a loaded disk inflates)",
    )
    p.add_argument("--json", metavar="OUT", help="also write the whole result (every row) as JSON")
    args = p.parse_args(argv)
    dirs = run_dirs(args.runs)
    if not dirs:
        p.error("no finished run (a directory with report.json) among the paths given")
    # lazy: torch/transformers (seconds), only once the arguments are known to be good
    from hil.sim.validate import validate

    with tempfile.TemporaryDirectory(prefix="sim-validate-") as scratch:
        latency = args.commit_latency_ms / 1e3 if args.commit_latency_ms is not None else None
        result = validate(
            dirs, args.model, args.image, args.prompt, args.tokens, Geometry(64, 2, 4, 2), scratch, latency
        )
    print("\n".join(table(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
