"""Campaigns: a matrix of traces x policies x seeds through the testbench, and the report an
operator reads after a test day (markdown with tables, PNG plots)."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from hil.testbench import BenchConfig, BenchReport, Testbench


@dataclass
class CampaignCell:
    trace: str
    policy: str
    seed: int
    report: BenchReport
    report_dir: str = ""


def trace_for_seed(trace: str, seed: int, out_dir: Path) -> str:
    """A generated trace kind gets one realisation per seed (seed 0: the shipped file); other
    traces are used as they are."""
    import traces
    from traces.catalog import GENERATED_NAMES

    if seed == 0 or trace not in GENERATED_NAMES:
        return trace
    path = out_dir / "traces" / f"{trace}-seed{seed}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        traces.dump(traces.generate(trace, seed=seed), path)
    return str(path)


def run_campaign(base: BenchConfig, traces_: list[str], policies: list[str], seeds: list[int], say=print) -> list[CampaignCell]:
    out = Path(base.out_dir)
    cells = []
    total = len(traces_) * len(policies) * len(seeds)
    for trace in traces_:
        for seed in seeds:
            trace_arg = trace_for_seed(trace, seed, out)
            for policy in policies:
                n = len(cells) + 1
                cell_dir = out / "runs" / f"{Path(trace).stem}-s{seed}-{policy}"
                say(f"[campaign] {n}/{total}: trace {trace} seed {seed} policy {policy}")
                cfg = replace(base, trace=trace_arg, policy=policy, out_dir=str(cell_dir))
                report = Testbench(cfg, say=lambda line: None).run()
                say("  " + report.summary().replace("\n", "\n  "))
                cells.append(CampaignCell(trace, policy, seed, report, str(cell_dir)))
    write_report(out, cells)
    return cells


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _fmt(value, spec=".1f", none="-"):
    return none if value is None else format(value, spec)


def write_report(out: Path, cells: list[CampaignCell]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in cells:
        r = c.report
        done = [q for q in r.requests if q.completed]
        rows.append({
            "trace": c.trace, "policy": c.policy, "seed": c.seed,
            "completed": f"{len(done)}/{len(r.requests)}", "completion_rate": r.completion_rate,
            "correct": r.all_correct, "e2e_trace_s": _mean(q.e2e_trace_s for q in done),
            "cuts": r.cuts_total, "recovery_s": _mean(x for q in r.requests for x in q.recovery_latency_s),
            "lost_units": sum(sum(q.work_lost_units) for q in r.requests), "mib_written": r.bytes_written / 2**20,
            "energy_j": r.energy_j, "wall_s": r.wall_s})
    (out / "campaign.json").write_text(json.dumps({"rows": rows, "runs": [c.report.to_json() for c in cells]}, indent=2))
    traces_ = sorted({c.trace for c in cells})
    policies = list(dict.fromkeys(c.policy for c in cells))
    plots = []
    for metric, label, fname in (("e2e_trace_s", "mean end-to-end time (trace s)", "e2e.png"),
                                 ("completion_rate", "requests completed (fraction)", "completion.png"),
                                 ("mib_written", "MiB written by the payload", "bytes.png"),
                                 ("recovery_s", "mean recovery latency (wall s, power-up to first compute)", "recovery.png")):
        fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(traces_), 3.2))
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            vals = []
            for trace in traces_:
                v = [row[metric] for row in rows if row["trace"] == trace and row["policy"] == policy and row[metric] is not None]
                vals.append(statistics.mean(v) if v else 0.0)
            ax.bar([t + i * width for t in range(len(traces_))], vals, width, label=policy)
        ax.set_xticks([t + width * (len(policies) - 1) / 2 for t in range(len(traces_))], traces_)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        plots.append((label, fname))
    lines = ["# Testbench campaign", "",
             f"{len(cells)} runs: traces {', '.join(traces_)}; policies {', '.join(policies)}; "
             f"seeds {', '.join(str(s) for s in sorted({c.seed for c in cells}))}.",
             "Real bus and payload processes (SIGKILL at every cut), real ZeroMQ/CurveZMQ link, tiny model on "
             "this machine's CPU, paced and time-scaled as each run's line says. Every output is checked bit "
             "for bit against an uninterrupted reference.", "",
             "| trace | policy | seed | completed | outputs | mean e2e (trace s) | cuts | mean recovery (s) | "
             "units lost | MiB written | energy (J) | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['trace']} | {row['policy']} | {row['seed']} | {row['completed']} | "
                     f"{'bitwise equal' if row['correct'] else 'MISMATCH or none'} | {_fmt(row['e2e_trace_s'], '.0f')} | "
                     f"{row['cuts']} | {_fmt(row['recovery_s'], '.2f')} | {row['lost_units']} | "
                     f"{row['mib_written']:.1f} | {row['energy_j']:.0f} | {row['wall_s']:.0f} |")
    lines += ["", "Per-run details: `runs/<trace>-s<seed>-<policy>/summary.txt` and `report.json`.", ""]
    for label, fname in plots:
        lines += [f"## {label[0].upper() + label[1:]}", "", f"![{label}]({fname})", ""]
    lines += ["Definitions (docs/hil.md): end-to-end = task accepted to COMPLETED; recovery latency = payload "
              "power-up to the first progress report of the resumed task (boot included); units lost = work "
              "units (vision blocks, prefill blocks, decode steps) done before a cut and done again after it; "
              "bytes written = the payload process's device-level writes (/proc write_bytes) summed over power "
              "cycles; energy = the documented power model times the time in each state.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
