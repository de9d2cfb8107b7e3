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
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PAPER = {
    "e2e_speedup": {"sonic-layer": 2.95, "sonic-chunk": 1.98, "hcache": 1.65},
    "overhead": "< 5 %",
    "bytes_vs_sonic_layer": "2.33-3.56x fewer",
    "energy_overhead": "3.75-4.74 %",
    "planner_ms": "< 100 ms (36 layers, G >= 2)",
    "recovery_speedup": "1.22-6.97x",
}
POLICIES = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache")


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
                                                                     os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def bytes_and_energy(model_dir: str, images_by_size: dict, prompt: str) -> dict:
    """Uninterrupted run of every policy; bytes written and the power-model energy."""
    from flight.checkpoint.policies import Geometry
    from flight.engine import Engine, EngineOptions
    from flight.model.inputs import build_inputs, load_image
    from flight.model.loader import load_model
    from hil.testbench import PowerModel

    power = PowerModel()
    out = {}
    model = load_model(model_dir, device="cpu")
    for label, images in images_by_size.items():
        inputs = build_inputs(model.tokenizer, model.image_processor, [load_image(p) for p in images], prompt,
                              model.adapter.image_token_id)
        rows, walls = {}, {}
        for round_ in range(3):  # interleaved rounds, the fastest of each: less noise than one run
            for policy in ("none",) + POLICIES:
                with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as d:
                    start = time.perf_counter()
                    r = Engine(model, EngineOptions(geometry=Geometry(256, 4, 8, 2), policy=policy)).run(inputs, d, 16)
                    walls.setdefault(policy, []).append(time.perf_counter() - start)
                rows[policy] = {"bytes": r.bytes_written, "tokens": inputs.num_tokens}
        for policy, row in rows.items():
            row["wall_s"] = min(walls[policy])
            row["energy_j"] = row["wall_s"] * power.compute_w + row["bytes"] / power.ssd_write_bytes_per_s * power.ssd_write_w
        out[label] = rows
    return out


def decode_compression(model_dir: str, images: list, prompt: str) -> dict:
    """Cut late in decode; resume with full and with int8 decode records: recovery time, bytes,
    and how far the answer moves."""
    from flight.checkpoint.policies import Geometry
    from flight.engine import Engine, EngineOptions, SimulatedCut
    from flight.model.inputs import build_inputs, load_image
    from flight.model.loader import load_model

    geometry = Geometry(256, 4, 16, 2)
    n = 64
    model = load_model(model_dir, device="cpu")
    inputs = build_inputs(model.tokenizer, model.image_processor, [load_image(p) for p in images], prompt,
                          model.adapter.image_token_id)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as d:
        ref = Engine(model, EngineOptions(geometry=geometry)).run(inputs, d, n)
    out = {}
    for mode in ("none", "int8"):
        with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as d:
            seen = {"n": 0}

            def cut(name, **_):
                if name == "decode_step_done":
                    seen["n"] += 1
                    if seen["n"] == n - 3:
                        raise SimulatedCut("late in decode")

            try:
                Engine(model, EngineOptions(geometry=geometry, decode_kv_compression=mode, async_writes=False),
                       events=cut).run(inputs, d, n)
            except SimulatedCut:
                pass
            log_bytes = os.path.getsize(os.path.join(d, "decode.log"))
            fresh = load_model(model_dir, device="cpu")
            r = Engine(fresh, EngineOptions(geometry=geometry, decode_kv_compression=mode)).run(inputs, d, n)
            same = sum(a == b for a, b in zip(r.token_ids, ref.token_ids))
            out[mode] = {"decode_log_bytes": log_bytes, "restore_s": r.phase_seconds["restore"] + r.phase_seconds["prefill"],
                         "tokens_equal": same, "tokens": len(ref.token_ids),
                         "bitwise": r.token_ids == ref.token_ids and bool((r.logits == ref.logits).all()),
                         "max_logit_diff": float((r.logits - ref.logits).abs().max())}
    return out


def e2e_campaign(model_dir: str, images: list, prompt: str, traces: list, out_dir: str, request_seconds: float,
                 workloads: list, seeds: list, jobs: int) -> dict:
    """The `small` model (12 layers: a cut inside a whole-chunk checkpoint loses up to 12
    layer-chunks, inside an OrbitWeaver block 2), a prefill-heavy request (two 512 px images, a
    short answer) as in the paper's multi-frame missions, paced and storage-emulated, the boot
    emulated; every trace x workload x seed, OrbitWeaver with fixed and adaptive cadence beside
    the baselines (hil/campaign.py)."""
    from hil.campaign import run_campaign, speedups, summarise
    from hil.testbench import BenchConfig, RequestSpec

    base = BenchConfig(trace=traces[0], model=model_dir, out_dir=out_dir, requests=2,
                       workload=[RequestSpec(tuple(images), prompt, 8)], time_scale="auto",
                       request_seconds=request_seconds, chunk=64, group=2, decode_every=4, vision_every=2,
                       emulate_target_storage=True)
    cells = run_campaign(base, traces, list(POLICIES), seeds, say=lambda s: print(s, flush=True),
                         workloads=workloads, cadences=["fixed", "adaptive"], jobs=jobs)
    rows = summarise(cells)
    return {"summary": rows, "ratios": speedups(rows, "orbitweaver (fixed)"),
            "ratios_adaptive": speedups(rows, "orbitweaver (adaptive)"), "report": os.path.join(out_dir, "report.md")}


def plot_bars(path, title, groups, series, ylabel):
    import matplotlib

    matplotlib.use("Agg")
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
    p.add_argument("--traces", default="trace-a,trace-b,sat1-like,sat2-like,dellingr-like", help="end-to-end traces")
    p.add_argument("--jobs", type=int, default=2, help="end-to-end runs at once")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the parts already measured in OUT (their JSON files) and run only the missing ones")
    args = p.parse_args(argv)
    from common import log as owlog

    owlog.setup("error")
    from bench import engine_overhead, recovery_latency, recovery_planner

    out = args.out
    os.makedirs(out, exist_ok=True)
    data: dict = {"machine": machine(), "paper": PAPER, "quick": args.quick}
    t0 = time.time()
    model = engine_overhead.ensure_model("small")
    small_imgs = engine_overhead.ensure_images(4, 512)
    large_imgs = engine_overhead.ensure_images(8, 512)
    prompt = "describe every change between these scenes and count the ships near the coast , then list the damaged buildings"

    def part(name: str, title: str, measure):
        """Measure one part (or reuse its JSON with --reuse) and keep it in `data`."""
        path = os.path.join(out, f"{name}.json")
        if not (args.reuse and os.path.exists(path)):
            print(f"== {title} ==", flush=True)
            result = measure(path)
            if result is not None:
                with open(path, "w") as f:
                    json.dump(result, f, indent=2, default=str)
        with open(path) as f:
            data[name] = json.load(f)

    def writes_its_own(main_fn, argv):
        """A benchmark script that writes its JSON itself: run it, keep nothing."""
        return lambda path: main_fn(argv + [path]) and None or None

    part("overhead", "Fig. 12: uninterrupted overhead",
         writes_its_own(engine_overhead.main, ["--rounds", "2" if args.quick else "3", "--out"]))
    part("bytes_energy", "Fig. 13/14: bytes written and energy per policy", lambda path: bytes_and_energy(
        model, {"4 images": small_imgs, "8 images": large_imgs}, prompt))
    part("planner", "Sec. 5.3: planner time and plan quality (simulated)",
         writes_its_own(recovery_planner.main, ["--seeds", "2" if args.quick else "5", "--no-gap", "--json"]))
    part("recovery", "Fig. 11: recovery latency, real engine",
         writes_its_own(recovery_latency.main, ["--repeats", "1" if args.quick else "2", "--out"]))
    part("compression", "Sec. 6: decode-KV compression", lambda path: decode_compression(model, small_imgs, prompt))
    traces = [t for t in args.traces.split(",") if t][: 1 if args.quick else None]
    part("e2e", "Fig. 10: end-to-end through the testbench", lambda path: e2e_campaign(
        model, small_imgs[:2], prompt, traces, os.path.join(out, "e2e"), request_seconds=20.0 if args.quick else 30.0,
        workloads=["paper"] if args.quick else ["paper", "back-to-back"], seeds=[0] if args.quick else [0, 1],
        jobs=args.jobs))
    data["elapsed_s"] = time.time() - t0
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    write_report(out, data)
    print(f"\nreport: {os.path.join(out, 'report.md')}")
    return 0


def write_report(out: str, d: dict) -> None:
    m = d["machine"]
    lines = ["# OrbitWeaver benchmark report", "",
             f"Hardware: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}; "
             f"torch {m['torch']}. **These are CPU timings on this machine, not Jetson timings**: read the ratios. "
             f"Where I/O matters, a *target-emulated* column throttles storage to the read-to-compute ratio of a "
             f"Jetson AGX Orin with NVMe (docs/recovery.md §7).", ""]
    # summary table
    ov = d["overhead"]
    be = d["bytes_energy"]
    ratios_bytes = {lab: rows["sonic-layer"]["bytes"] / rows["orbitweaver"]["bytes"] for lab, rows in be.items()}
    energy_over = {lab: rows["orbitweaver"]["energy_j"] / rows["none"]["energy_j"] - 1 for lab, rows in be.items()}
    e2e = d["e2e"]
    speedups = {}
    for base in ("sonic-layer", "sonic-chunk", "hcache"):
        vals = [r["ratio"] for r in e2e["ratios"] if r["policy"] == base and r["ratio"]]
        speedups[base] = statistics.geometric_mean(vals) if vals else None
    rec = d["recovery"]["rows"]
    pt = next((r for r in d["planner"]["planner_time"] if "36" in r["case"] and r["groups"] == 18), None)
    lines += ["## Summary beside the paper", "",
              "| measure | ours | paper |", "|---|---|---|"]
    lines.append(f"| E2E speedup over SONIC-layer / SONIC-chunk / HCache (geo-mean over the traces where both completed "
                 f"everything; orbitweaver fixed cadence) | "
                 + " / ".join(f"{speedups[b]:.2f}x" if speedups[b] else "n/a" for b in ("sonic-layer", "sonic-chunk", "hcache"))
                 + " | 2.95x / 1.98x / 1.65x |")
    lines.append(f"| uninterrupted overhead vs no checkpoints (median) | {100 * (ov['overhead_ratio_median'] - 1):+.1f} % | < 5 % |")
    lines.append(f"| bytes written, SONIC-layer / OrbitWeaver | "
                 + ", ".join(f"{v:.2f}x ({k})" for k, v in ratios_bytes.items()) + " | 2.33-3.56x |")
    lines.append(f"| energy overhead, uninterrupted (power model) | "
                 + ", ".join(f"{100 * v:+.1f} % ({k})" for k, v in energy_over.items()) + " | 3.75-4.74 % |")
    if pt:
        lines.append(f"| optimal planner time, 36 layers, G = 2 | {pt['cold_ms']:.0f} ms cold, {pt['warm_ms']:.0f} ms warm | < 100 ms |")
    from bench.recovery_latency import optimal_vs_fixed

    comp = {}
    for r in rec:
        if r["planner"] == "optimal":
            cells = {x["planner"]: x for x in rec if x["progress"] == r["progress"] and x["mode"] == r["mode"]}
            comp[(r["progress"], r["mode"])] = optimal_vs_fixed(cells)
    lines.append("| recovery, best fixed order / optimal (real engine) | "
                 + ", ".join(f"{v} ({int(k[0] * 100)} % {k[1]})" for k, v in sorted(comp.items())) + " | 1.22-6.97x |")
    for variant in ("orbitweaver (fixed)", "orbitweaver (adaptive)"):
        lines.append(f"| completion rate per trace, {variant} | "
                     + ", ".join(f"{r['trace']} {r['workload']}: {r['completion_rate']:.0%}" for r in e2e["summary"]
                                 if r["policy"] == variant) + " | 100 % |")
    lines += ["", "## Fig. 12 — uninterrupted overhead", "",
              f"{ov['model']}, {ov['prompt_tokens']} prompt tokens, C={ov['geometry']['chunk']} G={ov['geometry']['group']} "
              f"D={ov['geometry']['decode_every']}: none {ov['wall_s_median']['none']:.2f} s, orbitweaver "
              f"{ov['wall_s_median']['orbitweaver']:.2f} s (median), ratio {ov['overhead_ratio_median']:.3f}; per round "
              f"{', '.join(f'{x:.3f}' for x in ov['overhead_ratios'])}. Checkpoints: {ov['bytes_written'] / 2**20:.1f} MiB, "
              f"written at {ov['checkpoint_write_bytes_per_s'] / 2**20:.0f} MiB/s in the background (dd with fsync: "
              f"{ov['dd_write_bytes_per_s'] / 2**20:.0f} MiB/s). Peak RSS delta {ov['peak_rss_delta_bytes'] / 2**20:+.1f} MiB = "
              f"{ov['peak_rss_delta_blocks']:+.2f} prefill blocks (median of the runs; allocator noise is a few MiB). "
              f"State held by checkpointing at its peak (exact, from the writer): "
              + ", ".join(f"{ph} {n:.2f}" for ph, n in ov.get('held_state_peak_blocks', {}).items())
              + " prefill blocks (goal <= 2; in the vision phase one optional vision state at a time).", ""]
    labels = list(be)
    plot_bars(os.path.join(out, "bytes.png"), "Fig. 13: bytes written, uninterrupted", labels,
              {pol: [be[l][pol]["bytes"] / 2**20 for l in labels] for pol in POLICIES}, "MiB")
    plot_bars(os.path.join(out, "energy.png"), "Fig. 14: energy (power model), uninterrupted", labels,
              {pol: [be[l][pol]["energy_j"] for l in labels] for pol in ("none",) + POLICIES}, "J")
    lines += ["## Fig. 13 / 14 — bytes written and energy, uninterrupted", "",
              "| prompt | policy | tokens | MiB written | vs orbitweaver | wall (s) | energy (J) |", "|---|---|---|---|---|---|---|"]
    for l in labels:
        for pol in ("none",) + POLICIES:
            r = be[l][pol]
            rel = r["bytes"] / be[l]["orbitweaver"]["bytes"] if be[l]["orbitweaver"]["bytes"] else 0
            lines.append(f"| {l} | {pol} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | {rel:.2f}x | {r['wall_s']:.2f} | {r['energy_j']:.0f} |")
    lines += ["", "![bytes](bytes.png) ![energy](energy.png)", "",
              "Energy = 30 W x wall + 3.5 W x bytes / 1.5 GB/s (docs/hil.md power model).", ""]
    lines += ["## Fig. 11 — recovery latency (real engine, cold page cache)", "",
              f"{d['recovery']['model']}, {d['recovery']['prompt_tokens']} prompt tokens; latency = resumed run start to "
              f"prefill complete; x LB = over max(total read, total compute) of that run. Target-emulated reads: "
              f"{d['recovery']['emulated_read_bytes_per_s'] / 2**20:.1f} MiB/s.", "",
              "| progress | column | chunk-first | layer-first | optimal |", "|---|---|---|---|---|"]
    for prog in (0.25, 0.5, 0.75):
        for mode in ("native", "target-emulated"):
            cells = {r["planner"]: r for r in rec if r["progress"] == prog and r["mode"] == mode}
            if len(cells) == 3:
                lines.append(f"| {int(prog * 100)} % | {mode} | " + " | ".join(
                    f"{cells[p]['latency_s']:.2f} s (x{cells[p]['vs_lower_bound']:.2f} LB)" for p in ("chunk-first", "layer-first", "optimal")) + " |")
    lines += ["", "Reading the measured table: in the native column reads cost almost nothing, so every plan does "
              "the same work and the spread between planners is run-to-run noise (a few per cent, best of the "
              "repeats). In the target-emulated column the fixed chunk-first order stalls on reads (well above "
              "the bound) while layer-first and optimal stay within about 10 % of it; where optimal "
              "finds no better order than layer-first it runs layer-first's plan itself (a tie goes to the known "
              "order), so the summary says 'same plan' instead of comparing two noisy runs of one plan. Under the "
              "planner's own cost model (the simulated table below, "
              "at the real model dimensions) optimal is never slower than either fixed order."]
    plan_rows = [r for r in d["planner"]["makespan"] if r["column"] == "target-emulated"]
    lines += ["", "Simulated plans at the real dimensions (docs/recovery.md), makespan over the lower bound, target-emulated:", "",
              "| model | frontier | done | chunk-first | layer-first | optimal |", "|---|---|---|---|---|---|"]
    for r in plan_rows:
        lines.append(f"| {r.get('model', '')} | {r['frontier']} | {r['progress']:.0%} | {r['chunk-first']:.3f} | "
                     f"{r['layer-first']:.3f} | {r['optimal']:.3f} |")
    c = d["compression"]
    lines += ["", "## Sec. 6 — decode-KV compression (int8, off by default)", "",
              "| decode records | log bytes | restore (s) | tokens equal | bitwise | max logit diff |", "|---|---|---|---|---|---|"]
    for mode, r in c.items():
        lines.append(f"| {mode} | {r['decode_log_bytes'] / 2**20:.2f} MiB | {r['restore_s']:.3f} | {r['tokens_equal']}/{r['tokens']} | "
                     f"{'yes' if r['bitwise'] else 'no'} | {r['max_logit_diff']:.3g} |")
    lines += ["", "## Fig. 10 — end to end, real processes through the testbench", "",
              "The small model (12 layers) paced per layer-chunk so that one uninterrupted request maps onto the "
              "trace's 180 s reference request; the boot emulated (15 trace s); checkpoint storage throttled to the "
              "Orin's read/write-to-compute ratio; prefill-heavy requests (two 512 px images, C=64, G=2): two per "
              "trace (the paper's workload) and four back to back.", "",
              "| workload | trace | policy | completed | outputs | mean e2e (trace s) | cuts | units lost | MiB |",
              "|---|---|---|---|---|---|---|---|---|"]
    from hil.campaign import completion_text

    for r in e2e["summary"]:
        lines.append(f"| {r['workload']} | {r['trace']} | {r['policy']} | {completion_text(r)} | "
                     f"{'bitwise' if r['bitwise'] else '-'} | {r['e2e_mean_trace_s'] or 0:.0f} | {r['cuts']} | "
                     f"{r['lost_units']} | {r['mib_written']:.1f} |")
    lines += ["", "Makespan ratios (baseline / orbitweaver with fixed cadence), only where both completed every request:", ""]
    lines += [f"- {r['workload']} {r['trace']} {r['policy']}: " + (f"{r['ratio']:.2f}x" if r["ratio"] else f"n/a ({r['why_not']})")
              for r in e2e["ratios"]]
    lines += ["", f"The campaign's own report (all runs, plots): `{os.path.relpath(e2e['report'], out)}`."]
    shutil.copy(os.path.join(os.path.dirname(e2e["report"]), "e2e.png"), os.path.join(out, "e2e.png"))
    lines += ["", "![e2e](e2e.png)", "", "## Where ours differs from the paper, and why", "",
              "- Compute here is a CPU running a ~100 M-parameter model (benchmarks) or a paced tiny model (testbench); "
              "the Jetson runs 2-8 B models on a GPU. In the native column reading all weights and KV costs well under "
              "1 % of the prefill compute, so recovery plans hardly differ; the target-emulated column restores the "
              "Orin's ratio and is where the planner's ordering shows.",
              "- The payload's boot in the end-to-end campaign is emulated like the compute (15 trace s: a Jetson "
              "Orin's boot, docs/hil.md); what the flight process does after it runs on this CPU and is counted in "
              "trace time at the campaign's scale.",
              "- Bytes written compare policies on the same engine and record format; the paper's ratios are for "
              "2K-32K-token prompts on 2-8 B models, ours for ~1-2K tokens on the small model.",
              "", f"Total benchmark time {d['elapsed_s'] / 60:.1f} min."]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
