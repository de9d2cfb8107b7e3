"""The paper's Figures 10-14 at the real model sizes (hil/sim), and the simulator's validation.

    python -m bench.sim_figures [--quick] [--out runs/bench/sim.json]

Writes the numbers to OUT (JSON) and the figures beside it as PNG: OUT's stem + `-fig10.png`
(end-to-end time per trace and variant), `-fig11.png` (restart latency after a cut at 25/50/75 %
of prefill), `-fig12.png` (slowdown of an uninterrupted request against no checkpointing),
`-fig13.png` (checkpoint bytes written), `-fig14.png` (energy against no checkpointing), each with
one panel per configuration; it prints the Figure 10 summary and the files' paths.

Configurations (docs/sim.md): Qwen3-VL-2B on a Jetson AGX Orin and Qwen3-VL-8B on a Jetson Orin
NX, eight frames per request (8K-32K prompt tokens), 128 answer tokens, OrbitWeaver at C = 1024,
G = 4, D = 16, k = 4. Figure 10 runs all five traces x eight variants (four paper-defined policies,
OrbitWeaver with its adaptive cadence, three strengthened baselines) x 8 arrivals x 3 seeds; its
free parameters (payload boot, commit latency) are swept as a band. Simulated time, not measured
time: the validation table (`validate`) says how well the simulator predicts the real processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from flight.checkpoint.policies import Geometry

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CONFIGS: dict[str, dict[str, Any]] = {  # keyword arguments of hil.sim.figures.Config
    "2b-agx": dict(model="qwen3-vl-2b", target="orin-agx", frames=8, tokens_per_frame=2048),
    "8b-nx": dict(model="qwen3-vl-8b", target="orin-nx", frames=8, tokens_per_frame=4096),
}
BOOT_BAND = (10.0, 30.0)  # seconds: a Jetson's Linux boot + payload process start
COMMIT_BAND = (0.25e-3, 4e-3)  # seconds per durable record commit (two NVMe flushes)


def _fig10_one(args):
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from hil.sim.figures import Config, fig10

    cfg, trace, seeds, n = args
    return fig10(Config(**cfg), traces_=(trace,), seeds=seeds, n_arrivals=n)["rows"]


def fig10_parallel(cfg: dict, seeds, n_arrivals: int, workers: int = 2) -> dict:
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from hil.sim.figures import TRACES, VARIANTS, Config, summarise10

    with ProcessPoolExecutor(workers) as pool:
        rows = [r for part in pool.map(_fig10_one, [(cfg, t, seeds, n_arrivals) for t in TRACES]) for r in part]
    return {"config": Config(**cfg).label(), "rows": rows, "summary": summarise10(rows, VARIANTS)}


def speedup_lines(summary: dict) -> list[str]:
    """The printed Figure 10 summary: geo-mean speedups over each baseline of OrbitWeaver with
    the fixed cadence and with the adaptive one, completion per variant, adaptive against fixed."""
    adaptive = summary.get("speedup_adaptive", {})
    lines = ["  geo-mean speedup over    fixed   adaptive"]
    for base, v in summary["speedup"].items():
        a = adaptive.get(base, {}).get("geomean")
        lines.append(f"    {base:<20} {_x(v['geomean']):>8} {_x(a):>10}")
    lines.append("  completion: " + ", ".join(f"{p} {c:.0%}" for p, c in summary["completion"].items()))
    vs = summary.get("adaptive_vs_fixed")
    if vs:
        lines.append(
            f"  adaptive vs fixed (fixed e2e / adaptive e2e): geo-mean {_x(vs['geomean'])}, "
            f"min {_x(vs['min'])}, max {_x(vs['max'])} over {vs['pairs']} arrivals; "
            f"{vs['early_records']} early records; G {vs['groups']}"
        )
    return lines


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


FIGURES = ("fig10", "fig11", "fig12", "fig13", "fig14")


def figure_paths(out_json: str) -> dict[str, str]:
    """Where the figures of a run writing `out_json` go: beside it, named after it."""
    stem = os.path.splitext(os.path.abspath(out_json))[0]
    return {name: f"{stem}-{name}.png" for name in FIGURES}


def plot_figures(out: dict, out_json: str) -> dict[str, str]:
    """Draw Figures 10-14 from `main`'s numbers (`out`, as written to `out_json`) into PNG files
    beside it; returns {figure: path}."""
    # lazy: matplotlib (~0.5 s), only to draw the plots
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (~0.5 s), only to draw the plots
    import matplotlib.pyplot as plt

    paths = figure_paths(out_json)
    configs = list(out["configs"].values())

    def panels(title: str):
        fig, axes = plt.subplots(1, len(configs), figsize=(6.5 * len(configs), 4.2), squeeze=False)
        fig.suptitle(title)
        return fig, list(zip(axes[0], configs, strict=True))

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(paths[name], dpi=100)
        plt.close(fig)

    # Figure 10: mean end-to-end time of the completed arrivals, per trace and variant
    fig, cells = panels("Figure 10: end-to-end time per trace (simulated, completed arrivals)")
    for ax, entry in cells:
        rows = entry["fig10"]["rows"]
        traces_ = list(dict.fromkeys(r["trace"] for r in rows))
        variants_ = list(dict.fromkeys(r["policy"] for r in rows))  # "orbitweaver (adaptive)" is one
        width = 0.8 / max(1, len(variants_))
        for k, variant in enumerate(variants_):
            means = []
            for trace in traces_:
                done = [r["e2e_s"] for r in rows if r["trace"] == trace and r["completed"] and r["policy"] == variant]
                means.append(sum(done) / len(done) if done else 0.0)
            ax.bar([i + k * width for i in range(len(traces_))], means, width, label=variant)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(traces_))], traces_, fontsize=8)
        ax.set_ylabel("end-to-end (s)")
        ax.set_title(entry["label"], fontsize=8)
        ax.legend(fontsize=6)
    save(fig, "fig10")

    # Figure 11: restart latency against the point of the cut
    fig, cells = panels("Figure 11: restart latency after a cut in prefill")
    for ax, entry in cells:
        for policy in dict.fromkeys(r["policy"] for r in entry["fig11"]):
            points = [(r["progress"], r["restart_latency_s"]) for r in entry["fig11"] if r["policy"] == policy]
            ax.plot([100 * x for x, _ in points], [y for _, y in points], marker="o", label=policy)
        ax.set_xlabel("cut at % of prefill")
        ax.set_ylabel("restart latency (s)")
        ax.set_title(entry["label"], fontsize=8)
        ax.legend(fontsize=6)
    save(fig, "fig11")

    # Figures 12-14: one uninterrupted request per prompt length
    for name, key, label, scale in (
        ("fig12", "slowdown", "time / time without checkpoints", 1.0),
        ("fig13", "bytes", "checkpoint bytes written (GB)", 1e-9),
        ("fig14", "energy_ratio", "energy / energy without checkpoints", 1.0),
    ):
        fig, cells = panels(f"Figure {name[3:]}: {label}, uninterrupted request")
        for ax, entry in cells:
            for policy in dict.fromkeys(r["policy"] for r in entry["fig12_14"]):
                points = [(r["prompt_tokens"], r[key] * scale) for r in entry["fig12_14"] if r["policy"] == policy]
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.set_title(entry["label"], fontsize=8)
            ax.legend(fontsize=6)
        save(fig, name)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Writes OUT (the numbers, JSON) and Figures 10-14 beside it (OUT's stem + -fig10.png ... -fig14.png).",
    )
    p.add_argument("--quick", action="store_true", help="one seed, 8 arrivals, no parameter band (about a minute)")
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "runs", "bench", "sim.json"),
        help="the numbers (default runs/bench/sim.json)",
    )
    args = p.parse_args(argv)
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from hil.sim.figures import Config, fig11, fig12_14

    seeds = (0,) if args.quick else (0, 1, 2)
    t0 = time.time()
    out: dict[str, Any] = {"configs": {}, "seeds": list(seeds), "arrivals": 8}
    for name, cfg in CONFIGS.items():
        base = dict(cfg, boot_s=20.0, commit_latency_s=1e-3)
        print(f"== real-size simulation: {Config(**base).label()} ==", flush=True)
        entry: dict[str, Any] = {"label": Config(**base).label(), "fig10": fig10_parallel(base, seeds, 8)}
        s = entry["fig10"]["summary"]
        print("\n".join(speedup_lines(s)), flush=True)
        entry["fig10_band"] = []
        if not args.quick:
            for boot in BOOT_BAND:
                for commit in COMMIT_BAND:
                    variant = dict(base, boot_s=boot, commit_latency_s=commit)
                    summary = fig10_parallel(variant, (0,), 8)["summary"]
                    entry["fig10_band"].append({"boot_s": boot, "commit_latency_s": commit, "summary": summary})
        entry["fig11"] = fig11(Config(**base))
        entry["fig12_14"] = fig12_14(Config(**base), tokens_per_frame=(256, 1024, 2048, 4096))
        out["configs"][name] = entry
    out["elapsed_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    paths = plot_figures(out, args.out)
    print(f"sim figures: {time.time() - t0:.0f} s; numbers in {args.out}")
    for name, path in paths.items():
        print(f"  Figure {name[3:]}: {path}")
    return 0


def validation(run_dirs: list[str], model_dir: str, images, prompt: str, out_path: str) -> dict:
    """The simulator against every request of the real-process campaign's runs
    (hil/sim/validate.py). Each run's own requests and flight arguments are used; `images`,
    `prompt`, the answer length and the geometry here stand in only for a run that does not
    record them."""
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from hil.sim.validate import validate

    result = validate(run_dirs, model_dir, images, prompt, 8, Geometry(64, 2, 4, 2), os.path.dirname(out_path))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def repeats(val: dict, out_dir: str, times: int, jobs: int, resume: bool = False, say=print) -> dict:
    """Every run holding a request the simulator missed (`beyond`), run `times` more times with
    its own configuration (hil.campaign.run_again): per missed request the end-to-end time each
    run of it measured, beside the prediction. A prediction within 10 % of one of them is as
    close to the testbench as the testbench is to itself; where the runs of one configuration
    differ by more than 10 % among themselves, no single prediction can be within 10 % of all.
    Information beside the validation's verdict, which stays as it is."""
    # lazy: the testbench and the simulator (transformers' processors), only for this part
    from pathlib import Path

    from bench.report import beyond
    from hil.campaign import RunSlots, run_again
    from hil.sim.validate import run_facts

    missed = [r for r in val.get("rows", []) if beyond(r)]
    run_dirs = sorted({r["run_dir"] for r in missed})
    again = run_again(run_dirs, Path(out_dir), times, RunSlots(jobs), say=say, resume=resume) if run_dirs else {}
    tasks = {d: run_facts(d)["tasks"] for ds in again.values() for d in ds}
    measured = {d: [t["e2e_trace_s"] for t in ts] for d, ts in tasks.items()}
    cuts = {d: [t["cuts"] for t in ts] for d, ts in tasks.items()}
    rows = []
    for r in missed:
        i = r.get("request", 0)
        dirs = again[r["run_dir"]]
        real = [r.get("e2e_trace_s")] + [measured[d][i] if i < len(measured[d]) else None for d in dirs]
        predicted = r.get("predicted_e2e_trace_s") if r.get("predicted_completed") else None
        done = [x for x in real if x is not None]
        rows.append(
            {
                "run_dir": r["run_dir"],
                "again_dirs": dirs,
                "request": i,
                "trace": r["trace"],
                "policy": r["policy"],
                "cadence": r.get("cadence"),
                "predicted_e2e_trace_s": predicted,
                "predicted_cuts": r.get("predicted_cuts"),
                "real_e2e_trace_s": real,  # the validated run's first, then its repeats'; None: not completed
                "real_cuts": [r.get("cuts")] + [cuts[d][i] if i < len(cuts[d]) else None for d in dirs],
                # the testbench against itself: largest / smallest completed time, or None where
                # some runs completed it and others did not
                "real_spread": (max(done) / min(done) - 1) if done and len(done) == len(real) else None,
                "real_disagree": 0 < len(done) < len(real),
                "within_one": any(
                    (x is None and predicted is None)
                    or (x is not None and predicted is not None and abs(predicted / x - 1) <= 0.10)
                    for x in real
                ),
            }
        )
    return {
        "times": times,
        "missed": len(rows),
        "runs": len(run_dirs),
        "within_one": sum(row["within_one"] for row in rows),
        "testbench_beyond_10_percent": sum(
            row["real_disagree"] or (row["real_spread"] is not None and row["real_spread"] > 0.10) for row in rows
        ),
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
