"""The paper's Figures 10-14 at the real model sizes, in the lifecycle simulator.

    fig10(...)  end-to-end time per trace x variant x arrival x seed: geo-mean and maximum speedup
                of OrbitWeaver (fixed cadence, the paper's; and its adaptive cadence) over each
                baseline (paper-defined and strengthened), completion
    fig11(...)  recovery after a cut at 25/50/75 % of prefill: restart latency (time the cut
                costs: restore + prefill after the restart, minus what the uninterrupted run
                needed from the same point) and time to finish prefill
    fig12_14()  uninterrupted: slowdown against no checkpoints (Fig. 12), bytes written (Fig. 13),
                energy from the testbench's power model (Fig. 14)

Every number is derived from definitions (docs/baselines.md, docs/sim.md): nothing is fitted
to the paper's results. Free parameters (boot time, commit latency) are reported as bands.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

import traces
from flight.checkpoint.policies import Geometry

from .lifecycle import CHECKPOINT_KINDS, Durable, Payload, RequestModel, trace_telemetry, trace_windows
from .models import REAL_MODELS, frames_request
from .platform import target_platform

PAPER_POLICIES = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache")
STRENGTHENED = ("sonic-layer+", "sonic-chunk+", "hcache+")
BASELINES = ("sonic-layer", "sonic-chunk", "hcache")
#: OrbitWeaver under its adaptive checkpoint cadence (`--cadence adaptive`), the label the
#: testbench campaign's report gives it; "orbitweaver" alone is the paper's fixed cadence, the
#: reference of every speedup. The baselines keep their definitions' fixed cadence.
ADAPTIVE = "orbitweaver (adaptive)"
#: Figure 10's variants: the paper-defined policies, OrbitWeaver adaptive, the strengthened baselines.
VARIANTS = PAPER_POLICIES + (ADAPTIVE,) + STRENGTHENED
TRACES = ("trace-a", "trace-b", "sat1-like", "sat2-like", "dellingr-like")
#: OrbitWeaver's geometry on the target (the engine's defaults: C = 1024, G = 4, D = 16, k = 4).
GEOMETRY = Geometry(chunk=1024, group=4, decode_every=16, vision_every=4)
#: The paper's power model (docs/hil.md): computing, and NVMe write power at its rate.
COMPUTE_W, SSD_WRITE_W, SSD_WRITE_BYTES_PER_S = 30.0, 3.5, 1.5e9


def variant_policy(variant: str) -> tuple[str, str]:
    """(policy, cadence) of a Figure 10 variant."""
    return ("orbitweaver", "adaptive") if variant == ADAPTIVE else (variant, "fixed")


def trace_for(name: str, seed: int):
    return traces.load(name) if seed == 0 else traces.generate(name, seed=seed)


def arrivals(trace, n: int) -> list[float]:
    """n arrival instants spread evenly over the trace's on-time in its first half, so each
    request has the second half to finish in (and lands in a window, not in an off period)."""
    windows = [w for w in trace.windows() if w.start_s < trace.duration_s / 2]
    on = [(w.start_s, min(w.end_s, trace.duration_s / 2)) for w in windows]
    total = sum(b - a for a, b in on)
    out = []
    for i in range(n):
        target, acc = total * (i + 0.5) / n, 0.0
        for a, b in on:
            if acc + (b - a) >= target:
                out.append(a + (target - acc))
                break
            acc += b - a
    return out


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


@dataclass
class Config:
    model: str = "qwen3-vl-2b"
    target: str = "orin-agx"
    frames: int = 8
    tokens_per_frame: int = 2048
    new_tokens: int = 128
    boot_s: float = 20.0
    commit_latency_s: float = 1e-3

    def label(self) -> str:
        return (
            f"{self.model} on {self.target}, {self.frames} frames x {self.tokens_per_frame} tokens, "
            f"boot {self.boot_s:g} s, commit {self.commit_latency_s * 1e3:g} ms"
        )

    def build(self, policy: str) -> RequestModel:
        """The request under `policy` (a policy, or a Figure 10 variant: the cadence is the
        payload's, given to `RequestModel.run` by a `Payload`)."""
        policy = variant_policy(policy)[0]
        spec = REAL_MODELS[self.model]
        request = frames_request(self.frames, self.tokens_per_frame, new_tokens=self.new_tokens)
        platform = target_platform(
            spec, request, self.target, boot_s=self.boot_s, commit_latency_s=self.commit_latency_s
        )
        return RequestModel(spec, request, platform, policy, GEOMETRY)


def fig10(
    config: Config,
    traces_=TRACES,
    seeds=(0, 1, 2),
    n_arrivals: int = 8,
    policies=VARIANTS,
    say=None,
) -> dict:
    """Each arrival is a request alone on the payload. Under the adaptive cadence its payload
    has lived through every window of the trace before the arrival's (the window history the
    real `Cadence` starts each process with), hears the trace's shutdown warnings and its power
    and thermal telemetry at the trace's period (at real time the bus does not decimate it);
    under the fixed cadence none of that changes a decision."""
    models = {p: config.build(p) for p in policies}
    rows = []
    for name in traces_:
        for seed in seeds:
            trace = trace_for(name, seed)
            windows, warns = trace_windows(trace)
            telemetry, step = trace_telemetry(trace), trace.telemetry_period_s or 1.0
            for i, arrival in enumerate(arrivals(trace, n_arrivals)):
                for variant, model in models.items():
                    cadence = variant_policy(variant)[1]
                    payload = Payload(model.platform, windows, warns, cadence, telemetry, step)
                    o = model.run(windows, arrival, warns, horizon=trace.duration_s, payload=payload)
                    rows.append(
                        {
                            "trace": name,
                            "seed": seed,
                            "arrival": i,
                            "policy": variant,
                            "cadence": cadence,
                            "completed": o.completed,
                            "e2e_s": o.e2e_s,
                            "cuts": o.cuts,
                            "bytes": o.bytes_written,
                            "group": o.group,
                            "early_records": o.early_records,
                        }
                    )
            if say:
                say(f"  {name} seed {seed}: {n_arrivals} arrivals x {len(policies)} variants")
    return {"config": config.label(), "rows": rows, "summary": summarise10(rows, policies)}


def speedups(rows: list[dict], reference: str, others) -> tuple[dict, dict]:
    """({other: geo-mean, max, min, pairs, other unfinished}, {trace: {other: geo-mean}}) of
    other end-to-end / `reference` end-to-end over the arrivals both complete."""
    by = {(r["trace"], r["seed"], r["arrival"], r["policy"]): r for r in rows}
    keys = sorted({(r["trace"], r["seed"], r["arrival"]) for r in rows})
    overall: dict[str, dict] = {}
    per_trace: dict[str, dict] = {}
    for base in others:
        ratios, unfinished = [], 0
        for k in keys:
            ref, b = by.get(k + (reference,)), by.get(k + (base,))
            if not ref or not b or not ref["completed"]:
                continue
            if not b["completed"]:
                unfinished += 1
                continue
            ratios.append(b["e2e_s"] / ref["e2e_s"])
        overall[base] = {
            "geomean": geomean(ratios),
            "max": max(ratios) if ratios else None,
            "min": min(ratios) if ratios else None,
            "pairs": len(ratios),
            "baseline_unfinished": unfinished,
        }
        for trace in sorted({k[0] for k in keys}):
            vals = [
                by[k + (base,)]["e2e_s"] / by[k + (reference,)]["e2e_s"]
                for k in keys
                if k[0] == trace
                and by.get(k + (base,), {}).get("completed")
                and by.get(k + (reference,), {}).get("completed")
            ]
            per_trace.setdefault(trace, {})[base] = geomean(vals)
    return overall, per_trace


def summarise10(rows: list[dict], policies) -> dict:
    """completion per variant; speedup and per_trace: each baseline against OrbitWeaver with the
    fixed cadence (the paper's); with the adaptive variant, speedup_adaptive and
    per_trace_adaptive: each baseline against OrbitWeaver adaptive, and adaptive_vs_fixed:
    OrbitWeaver fixed end-to-end / adaptive end-to-end (> 1: the adaptive cadence is faster),
    its completion beside the fixed one's, and the adaptive variant's early records and G."""
    keys = sorted({(r["trace"], r["seed"], r["arrival"]) for r in rows})
    by = {(r["trace"], r["seed"], r["arrival"], r["policy"]): r for r in rows}
    out: dict[str, dict] = {"completion": {}}
    for p in policies:
        done = [by[k + (p,)]["completed"] for k in keys if k + (p,) in by]
        out["completion"][p] = sum(done) / max(1, len(done))
    baselines = [p for p in policies if not p.startswith("orbitweaver")]
    out["speedup"], out["per_trace"] = speedups(rows, "orbitweaver", baselines)
    if ADAPTIVE in policies:
        out["speedup_adaptive"], out["per_trace_adaptive"] = speedups(rows, ADAPTIVE, baselines)
        vs, per_trace = speedups(rows, ADAPTIVE, ["orbitweaver"])
        adaptive_rows = [r for r in rows if r["policy"] == ADAPTIVE]
        out["adaptive_vs_fixed"] = dict(
            vs["orbitweaver"],
            per_trace={t: v["orbitweaver"] for t, v in per_trace.items()},
            early_records=sum(r.get("early_records", 0) for r in adaptive_rows),
            groups={str(g): n for g, n in sorted(Counter(r["group"] for r in adaptive_rows if r.get("group")).items())},
        )
    return out


def cut_state(model: RequestModel, fraction: float) -> tuple[Durable, float, float]:
    """(durable state, cut time, prefill end) of an uninterrupted session cut when `fraction`
    of the prefill blocks have been computed."""
    res = model.uninterrupted()
    blocks = sorted(c.started for c in res.commits if c.kind == "block")
    total = model.NG * model.NC
    # compute ends of blocks in the fresh (chunk-first) order: the k-th block's commit starts at its end
    k = max(1, round(fraction * total))
    prefill_end = res.prefill_end_at  # the session starts at 0: inputs and setup come before vision
    cut = blocks[min(k, len(blocks)) - 1] + 1e-9 if blocks else prefill_end - (1 - fraction) * res.phase_s["prefill"]
    return res.durable_at(Durable(), cut), cut, prefill_end


def fig11(config: Config, fractions=(0.25, 0.5, 0.75), policies=PAPER_POLICIES + STRENGTHENED) -> list[dict]:
    rows = []
    for policy in policies:
        model = config.build(policy)
        for f in fractions:
            d, cut, prefill_end = cut_state(model, f)
            res = model.session(d, 0.0, 0.0)
            finish = res.restart_prefill_s  # restart -> prefill complete (boot excluded)
            remaining = max(0.0, prefill_end - cut)
            rows.append(
                {
                    "policy": policy,
                    "progress": f,
                    "finish_prefill_s": finish,
                    "restart_latency_s": max(0.0, finish - remaining),
                    "remaining_s": remaining,
                }
            )
    return rows


def fig12_14(
    config: Config, tokens_per_frame=(256, 1024, 2048, 4096), policies=("none",) + PAPER_POLICIES + STRENGTHENED
) -> list[dict]:
    rows = []
    for tpf in tokens_per_frame:
        cfg = Config(**{**config.__dict__, "tokens_per_frame": tpf})
        base: tuple[float, float] | None = None  # (seconds, energy) of "none", the first policy
        for policy in policies:
            res = cfg.build(policy).uninterrupted()
            # Fig. 13 counts checkpoint bytes; the TASK_INPUTS record every task writes whatever
            # the policy still costs its write energy
            nbytes = sum(c.nbytes for c in res.commits if c.kind in CHECKPOINT_KINDS)
            written = sum(c.nbytes for c in res.commits)
            energy = COMPUTE_W * res.finished_at + SSD_WRITE_W * written / SSD_WRITE_BYTES_PER_S
            if policy == "none":
                base = (res.finished_at, energy)
            assert base is not None, "the policies start with 'none', the baseline"
            rows.append(
                {
                    "prompt_tokens": cfg.frames * tpf,
                    "policy": policy,
                    "seconds": res.finished_at,
                    "bytes": nbytes,
                    "energy_j": energy,
                    "slowdown": res.finished_at / base[0],
                    "energy_ratio": energy / base[1],
                }
            )
    return rows
