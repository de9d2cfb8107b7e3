"""Recovery latency of the real engine at 25 / 50 / 75 % prefill progress, for each planner.

A request on the `small` model (~100 M parameters, >= 1,024 prompt tokens, four images) is cut
after 25, 50 and 75 % of its prefill blocks (orbitweaver checkpoints). Each checkpoint directory
is then resumed in a fresh process, with the model weights and the checkpoint files dropped from
the page cache first (a cold boot), with each planner, in two columns:

    native           this machine as it is
    target-emulated  reads (weights and checkpoints) throttled by a token bucket to the read-to-
                     compute ratio of a Jetson AGX Orin with NVMe (flight/recovery/cost.py)

Two measures per cut point (docs/benchmarks.md):
    time to finish prefill  start of the resumed run -> prefill complete (restore + the rest of prefill)
    restart latency         that minus what the uninterrupted run took for the same rest of prefill
                            (measured block by block in a fresh process): the time the cut itself cost,
                            which is what the paper's 1.22-6.97x compares
The paper-defined baselines (sonic-layer, sonic-chunk, hcache) are cut and resumed too, each with
its own restore. The lower bound is max(total read time, total compute time) of a resumed run.
CPU timings, not Jetson timings.

    python -m bench.recovery_latency [--repeats 3] [--out runs/bench/recovery_latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.engine_overhead import ensure_images, ensure_model
from common.durable import ThrottledFS
from flight.checkpoint.policies import Geometry, get_policy
from flight.recovery.cost import ModelDims, native_and_emulated

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLANNERS = ("chunk-first", "layer-first", "optimal")
BASELINES = ("sonic-layer", "sonic-chunk", "hcache")  # each restores with its own scheduler
PROGRESS = (0.25, 0.5, 0.75)


def drop_cache(paths) -> None:
    """Evict files from the page cache (clean pages only; they are, after fsync)."""
    for root in paths:
        for d, _, files in os.walk(root):
            for f in files:
                try:
                    fd = os.open(os.path.join(d, f), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _inputs(model, images, prompt):
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from flight.model.inputs import inputs_from_files

    return inputs_from_files(model, images, prompt)


def make_checkpoint(model_dir, images, prompt, geometry, fraction, out, policy="orbitweaver") -> dict:
    """Run the request until `fraction` of its prefill blocks are done, then cut (in-process)."""
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from flight.engine import Engine, EngineOptions, SimulatedCut
    from flight.model.loader import load_model

    model = load_model(model_dir, device="cpu")
    inputs = _inputs(model, images, prompt)
    geometry = get_policy(policy).geometry(geometry, model.adapter.num_layers)
    blocks = len(geometry.layer_groups(model.adapter.num_layers)) * len(geometry.token_chunks(inputs.num_tokens))
    target = max(1, round(fraction * blocks))
    seen = {"n": 0}

    def events(name, **fields):
        if name == "prefill_block_done":
            seen["n"] += 1
            if seen["n"] == target:
                raise SimulatedCut(f"cut after {target} of {blocks} prefill blocks")

    try:
        Engine(model, EngineOptions(geometry=geometry, async_writes=False, policy=policy), events=events).run(
            inputs, out, 4
        )
    except SimulatedCut:
        pass
    return {"blocks": blocks, "done": target, "prompt_tokens": inputs.num_tokens}


def worker(args) -> None:
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    import torch

    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from flight.engine import Engine, EngineOptions
    from flight.model.loader import load_model

    torch.set_num_threads(args.threads)
    fs = ThrottledFS(args.read_bps, None) if args.read_bps else None
    model = load_model(args.model, device="cpu", read_hook=fs.charge_read if fs else None)
    inputs = _inputs(model, args.image, args.prompt)
    geometry = Geometry(args.chunk, args.group, 8, 2)
    stamps = []

    def events(name, **fields):
        if name == "prefill_block_done":
            stamps.append(time.perf_counter())

    result = Engine(
        model, EngineOptions(geometry=geometry, planner=args.planner, policy=args.policy), fs=fs, events=events
    ).run(inputs, args.ckpt_dir, 4)
    plan = result.plan or {}
    print(
        json.dumps(
            {
                "latency_s": result.phase_seconds["restore"] + result.phase_seconds["prefill"],
                "block_times": [t - stamps[0] for t in stamps] if stamps else [],
                "read_s": plan.get("read_s"),
                "compute_s": plan.get("compute_s"),
                "stall_s": plan.get("stall_s"),
                "resumed_from": result.resumed_from,
                "order": plan.get("order"),
                "token_ids": result.token_ids,
            }
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "recovery_latency.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--planner", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="orbitweaver", help=argparse.SUPPRESS)
    p.add_argument("--progress", default="0.25,0.5,0.75", help="prefill fractions to cut at (comma-separated)")
    p.add_argument("--modes", default="native,target-emulated", help="columns to measure (comma-separated)")
    p.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also cut and resume the paper-defined baselines (each with its own restore)",
    )
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--image", action="append", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    p.add_argument("--read-bps", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--prompt",
        default="describe every change between these four scenes and count the ships "
        "near the coast , then list the damaged buildings",
    )
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from bench.calibration import calibrate
    from flight.model.loader import load_model

    model_dir = ensure_model("small")
    images = ensure_images(4, 512)
    geometry = Geometry(args.chunk, args.group, 8, 2)
    model = load_model(model_dir, device="cpu")
    calibrated = calibrate(model=model, group=args.group)
    dims = ModelDims.from_text_config(model.adapter.text_config, dtype_bytes=model.dtype.itemsize)
    _, emulated = native_and_emulated(calibrated, dims, group=args.group, chunk=args.chunk)
    modes = {"native": None, "target-emulated": emulated.read_bytes_per_s}
    modes = {k: v for k, v in modes.items() if k in args.modes.split(",")}
    progress = [float(x) for x in args.progress.split(",") if x]
    print(
        f"target-emulated read bandwidth: {emulated.read_bytes_per_s / 2**20:.1f} MiB/s "
        f"(this CPU's compute is {emulated.meta.get('compute_slowdown_vs_target', 0):.0f}x slower than the Orin's)",
        file=sys.stderr,
    )
    rows = []
    scratch = tempfile.mkdtemp(dir=os.path.join(ROOT, "runs"))
    try:

        def resume(ckpt_template, policy, planner, read_bps, fresh=False):
            runs = []
            for _ in range(args.repeats):
                ckpt = os.path.join(scratch, "resume")
                shutil.rmtree(ckpt, ignore_errors=True)
                if not fresh:
                    shutil.copytree(ckpt_template, ckpt)
                drop_cache([ckpt, model_dir] if not fresh else [model_dir])
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.recovery_latency",
                    "--worker",
                    "--planner",
                    planner,
                    "--policy",
                    policy,
                    "--model",
                    model_dir,
                    "--ckpt-dir",
                    ckpt,
                    "--prompt",
                    args.prompt,
                    "--chunk",
                    str(args.chunk),
                    "--group",
                    str(args.group),
                    "--threads",
                    str(args.threads),
                ]
                for im in images:
                    cmd += ["--image", im]
                if read_bps:
                    cmd += ["--read-bps", repr(read_bps)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            return runs

        cells = [("orbitweaver", planner) for planner in PLANNERS]
        if args.baselines:
            cells += [(policy, "own") for policy in BASELINES]
        for policy in dict.fromkeys(p for p, _ in cells):
            # The uninterrupted run's prefill, block by block: what the rest of prefill takes
            # without a cut (restart latency = resumed time to finish prefill - that).
            reference = min(resume(None, policy, "chunk-first", None, fresh=True), key=lambda x: x["latency_s"])
            times = reference["block_times"]
            for fraction in progress:
                template = os.path.join(scratch, f"ckpt-{policy}-{int(fraction * 100)}")
                info = make_checkpoint(model_dir, images, args.prompt, geometry, fraction, template, policy)
                remaining = times[-1] - times[info["done"] - 1] if len(times) >= info["done"] else 0.0
                for mode, read_bps in modes.items():
                    for planner in [pl for pol, pl in cells if pol == policy]:
                        runs = resume(template, policy, "optimal" if planner == "own" else planner, read_bps)
                        best = min(runs, key=lambda x: x["latency_s"])  # best of N: the least disturbed run
                        lat, read, comp = best["latency_s"], best["read_s"] or 0.0, best["compute_s"] or 0.0
                        row = {
                            "progress": fraction,
                            "mode": mode,
                            "policy": policy,
                            "planner": planner if policy == "orbitweaver" else policy,
                            "latency_s": lat,
                            "restart_latency_s": max(0.0, lat - remaining),
                            "remaining_uninterrupted_s": remaining,
                            "read_s": read,
                            "compute_s": comp,
                            "lower_bound_s": max(read, comp),
                            "vs_lower_bound": lat / max(read, comp, 1e-9),
                            "blocks_done": info["done"],
                            "blocks": info["blocks"],
                            "runs": [x["latency_s"] for x in runs],
                            "order": best.get("order"),
                        }
                        rows.append(row)
                        print(
                            f"{int(fraction * 100):3d}% {mode:16s} {row['planner']:12s} finish prefill {lat:7.3f} s  "
                            f"restart {row['restart_latency_s']:7.3f} s (read {read:.3f} s, compute {comp:.3f} s)",
                            file=sys.stderr,
                        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "model": os.path.basename(model_dir),
        "prompt_tokens": info["prompt_tokens"],
        "geometry": {"chunk": args.chunk, "group": args.group},
        "repeats": args.repeats,
        "emulated_read_bytes_per_s": emulated.read_bytes_per_s,
        "rows": rows,
        "note": "CPU timings, not Jetson timings; cold page cache for weights and checkpoints",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)
    return 0


def optimal_vs_fixed(cells: dict) -> str:
    """Best fixed order's latency over optimal's, or which fixed plan optimal chose (then the two
    ran the same reads and computes in the same order, and any difference is noise)."""
    same = [
        p
        for p in ("layer-first", "chunk-first")
        if cells[p].get("order") and cells[p].get("order") == cells["optimal"].get("order")
    ]
    if same:
        return f"same plan as {same[0]}"
    best_other = min(cells["chunk-first"]["latency_s"], cells["layer-first"]["latency_s"])
    return f"{best_other / cells['optimal']['latency_s']:.2f}x"


def print_table(report: dict) -> None:
    print(
        f"\nRecovery, {report['model']} ({report['prompt_tokens']} prompt tokens, C={report['geometry']['chunk']} "
        f"G={report['geometry']['group']}), best of {report['repeats']}; CPU timings. "
        f"Cells: time to finish prefill / restart latency (s)"
    )
    names = list(dict.fromkeys(r["planner"] for r in report["rows"]))
    print(f"{'progress':>8s} {'mode':16s} " + " ".join(f"{p:>20s}" for p in names) + "   optimal vs best other order")
    for fraction in PROGRESS:
        for mode in ("native", "target-emulated"):
            cells = {r["planner"]: r for r in report["rows"] if r["progress"] == fraction and r["mode"] == mode}
            if not cells:
                continue
            line = f"{int(fraction * 100):7d}% {mode:16s} " + " ".join(
                f"{cells[p]['latency_s']:9.3f} / {cells[p]['restart_latency_s']:7.3f}" if p in cells else f"{'-':>20s}"
                for p in names
            )
            if all(p in cells for p in PLANNERS):
                line += f"   {optimal_vs_fixed(cells)}"
            print(line)


if __name__ == "__main__":
    sys.exit(main())
