"""`ow vla bench`: the paper's experiments on the simulator, printed beside the paper's numbers.

Every number printed here is measured by running the simulator (driven by the shared scheduler
code and a profile table) in this process; the paper's figures are printed next to them for
comparison and are never used in a computation.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from common.vla import sim
from common.vla.config import EIGHT_MODELS, model_spec
from common.vla.management import (Placement, assign_eps, assign_ilp, assign_smg, robot_limits)
from common.vla.profiles import ProfileTable

TARGET = 0.98
PAPER = {
    "vs_monolithic": 1.5, "vs_omni": 6.7, "p99_vs_monolithic": 1.4, "static_sm_loss": 0.18,
    "esf_vs_rr": 1.06, "esf_vs_lqf": 1.07, "smg_misses": 8.2, "eps_misses": 4.4,
    "eight_by_four": 64, "intra_gpu": 72, "best_inter_gpu": 60,
}
EXPERIMENTS = ("single", "policies", "traffic", "ilp", "multi", "inter-gpu")


@dataclass(frozen=True)
class BenchSettings:
    # The paper runs five epochs; random robot phases make the 98 % point vary by a few robots
    # between draws, so the default pools twenty (--quick: five).
    epochs: int = 20
    duration_s: float = 10.0
    max_batches: tuple[int, ...] = (1, 2, 4)
    seed: int = 0
    models: tuple[str, ...] = ("pi0", "smolvla")

    @classmethod
    def quick(cls) -> "BenchSettings":
        return cls(epochs=5, duration_s=6.0, max_batches=(1, 2, 4))

    def workload(self, robots: dict[str, int]) -> sim.Workload:
        return sim.Workload(robots, epochs=self.epochs, duration_s=self.duration_s, seed=self.seed)


@dataclass
class BenchReport:
    lines: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def add(self, text: str = "") -> None:
        self.lines.append(text)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def _fmt_ratio(r: float) -> str:
    return "inf" if r == float("inf") else f"{r:.2f}x"


def best_max_robots(make: Callable[[int], sim.SystemConfig], robots_for: Callable[[int], dict[str, int]],
                    profile: ProfileTable, s: BenchSettings, cap: int = 128) -> tuple[int, int, sim.SimResult | None]:
    """Max load at the target over the allowed max batch sizes: (robots, max_batch, result)."""
    best = (0, s.max_batches[0], None)
    for mb in s.max_batches:
        system = make(mb)
        n, seen = sim.max_robots(lambda k: sim.simulate(system, s.workload(robots_for(k)), profile), TARGET, cap)
        if n > best[0]:
            best = (n, mb, seen.get(n))
    return best


# ---------------------------------------------------------------- experiments


def single_model(profile: ProfileTable, s: BenchSettings, rep: BenchReport) -> dict:
    """§5.2: max robots at 98 % SLO attainment for one model on one GPU, per system."""
    systems = {
        "robion": lambda mb: sim.robion(max_batch=mb),
        "monolithic": lambda mb: sim.monolithic(max_batch=mb),
        "vllm-omni-style": lambda mb: sim.vllm_omni(max_batch=mb),
        "robion-static-sm": lambda mb: sim.robion(max_batch=mb, sm_mode="static", static_share=96 / 188),
    }
    rep.add(f"== Single model on one GPU ({profile.device.get('name')}): max robots at {TARGET:.0%} SLO attainment ==")
    rep.add(f"{'model':10} {'SLO ms':>7} " + " ".join(f"{k:>17}" for k in systems) + "   robion/mono  robion/omni")
    out = {}
    for m in s.models:
        res = {k: best_max_robots(mk, lambda n, m=m: {m: n}, profile, s) for k, mk in systems.items()}
        out[m] = res
        cells = " ".join(f"{res[k][0]:>11} (mb {res[k][1]})" for k in systems)
        rep.add(f"{m:10} {profile.slo_ms(model_spec(m).arch):7.1f} {cells}   "
                f"{_fmt_ratio(_ratio(res['robion'][0], res['monolithic'][0])):>11}  "
                f"{_fmt_ratio(_ratio(res['robion'][0], res['vllm-omni-style'][0])):>11}")
    vs_mono = [_ratio(out[m]["robion"][0], out[m]["monolithic"][0]) for m in s.models]
    vs_omni = [_ratio(out[m]["robion"][0], out[m]["vllm-omni-style"][0]) for m in s.models]
    static_loss = [1 - _ratio(out[m]["robion-static-sm"][0], out[m]["robion"][0]) for m in s.models]
    rep.add(f"mean robion/monolithic: {statistics.fmean(vs_mono):.2f}x   (paper: {PAPER['vs_monolithic']}x)")
    rep.add(f"mean robion/vllm-omni-style: {statistics.fmean(vs_omni):.2f}x   (paper: {PAPER['vs_omni']}x)")
    rep.add(f"static VLM SM restriction (96/188 SMs) loses {statistics.fmean(static_loss):.0%} of the load "
            f"(paper: ~{PAPER['static_sm_loss']:.0%})")
    # p99 at Monolithic's highest load before saturation (paper: Robion 1.4x lower on average)
    p99 = []
    for m in s.models:
        n, mb_m = out[m]["monolithic"][0], out[m]["monolithic"][1]
        if n == 0:
            continue
        mono = sim.simulate(sim.monolithic(max_batch=mb_m), s.workload({m: n}), profile)
        rob = sim.simulate(sim.robion(max_batch=out[m]["robion"][1]), s.workload({m: n}), profile)
        p99.append(_ratio(mono.p99_ms, rob.p99_ms))
        rep.add(f"  {m}: p99 at {n} robots: robion {rob.p99_ms:.1f} ms, monolithic {mono.p99_ms:.1f} ms")
    if p99:
        rep.add(f"mean p99 monolithic/robion at monolithic's max load: {statistics.fmean(p99):.2f}x "
                f"(paper: {PAPER['p99_vs_monolithic']}x lower)")
    rep.add()
    return {"per_model": {m: {k: {"robots": v[0], "max_batch": v[1]} for k, v in r.items()} for m, r in out.items()},
            "mean_vs_monolithic": statistics.fmean(vs_mono), "mean_vs_omni": statistics.fmean(vs_omni),
            "best_max_batch": {m: out[m]["robion"][1] for m in s.models}}


POLICY_CASES = (
    ("same arch, same SLO", {"pi0": 8, "pi0-ft1": 8}, None),
    ("same arch, SLOs 115/400 ms", {"pi0": 4, "pi0-ft1": 12}, {"pi0": 115.0, "pi0-ft1": 400.0}),
    ("smolvla 75 ms + pi0 400 ms", {"smolvla": 8, "pi0": 14}, {"smolvla": 75.0, "pi0": 400.0}),
)


def policy_case(profile: ProfileTable, s: BenchSettings, robots: dict, slo: dict | None, policy: str,
                max_batch: int = 2) -> sim.SimResult:
    return sim.simulate(sim.robion(policy=policy, max_batch=max_batch), s.workload(robots), profile, slo_ms=slo)


def policies(profile: ProfileTable, s: BenchSettings, rep: BenchReport) -> dict:
    """§5.3: co-located models on one GPU, queue policy ESF vs RR vs LQF (SLO attainment)."""
    rep.add("== Co-located models on one GPU: SLO attainment by queue policy (max batch 2) ==")
    rep.add(f"{'case':30} {'robots':>26}   {'ESF':>6} {'RR':>6} {'LQF':>6}")
    out, esf_rr, esf_lqf = {}, [], []
    for name, robots, slo in POLICY_CASES:
        att = {p: policy_case(profile, s, robots, slo, p).attainment for p in ("esf", "rr", "lqf")}
        out[name] = att
        esf_rr.append(_ratio(att["esf"], att["rr"]))
        esf_lqf.append(_ratio(att["esf"], att["lqf"]))
        rep.add(f"{name:30} {str(robots):>26}   {att['esf']:6.3f} {att['rr']:6.3f} {att['lqf']:6.3f}")
    rep.add(f"mean ESF/RR {statistics.fmean(esf_rr):.3f}x, ESF/LQF {statistics.fmean(esf_lqf):.3f}x "
            f"(paper: {PAPER['esf_vs_rr']}x and {PAPER['esf_vs_lqf']}x)")
    rep.add()
    return out


def _assign_and_simulate(assigner, placement: Placement, robots: dict[str, int], limits: dict[str, int],
                         profile: ProfileTable, s: BenchSettings, max_batch) -> tuple[sim.SimResult, object]:
    a = assigner(placement, robots, limits)
    r = sim.simulate(sim.robion(max_batch=max_batch), s.workload(robots), profile, assignment=a.counts)
    return r, a


def traffic(profile: ProfileTable, s: BenchSettings, rep: BenchReport, limits: dict[str, int], max_batch) -> dict:
    """§5.4 Fig. 11: four pi0 variants on all four GPUs; SLO miss rate by traffic controller."""
    models = ["pi0", "pi0-ft1", "pi0-ft2", "pi0-ft3"]
    placement = Placement.colocate(models, 4)
    rep.add(f"== Traffic control: 4 pi0 variants co-located on 4 GPUs (limit {limits['pi0']} robots/GPU) — SLO miss rate ==")
    rep.add(f"{'robots per variant':20} {'ILP (Robion)':>13} {'SMG':>8} {'EPS':>8}   SMG/ILP  EPS/ILP")
    out, smg_r, eps_r = {}, [], []
    for dist in ((8, 8, 8, 24), (28, 16, 16, 8), (12, 12, 12, 12)):
        robots = dict(zip(models, dist))
        miss = {}
        for name, fn in (("ilp", assign_ilp), ("smg", assign_smg), ("eps", assign_eps)):
            r, _ = _assign_and_simulate(fn, placement, robots, limits, profile, s, max_batch)
            miss[name] = r.miss_rate
        out[str(dist)] = miss
        floor = max(miss["ilp"], 1e-3)  # below 0.1 % misses the ratio is reported against 0.1 %
        smg_r.append(miss["smg"] / floor)
        eps_r.append(miss["eps"] / floor)
        rep.add(f"{str(dist):20} {miss['ilp']:13.3%} {miss['smg']:8.3%} {miss['eps']:8.3%}   "
                f"{smg_r[-1]:7.1f}x {eps_r[-1]:7.1f}x")
    rep.add(f"mean: SMG misses {statistics.fmean(smg_r):.1f}x, EPS {statistics.fmean(eps_r):.1f}x Robion's "
            f"(paper: {PAPER['smg_misses']}x and {PAPER['eps_misses']}x)")
    rep.add()
    return out


def ilp_timing(rep: BenchReport, instances: int = 20, seed: int = 0) -> dict:
    """The traffic ILP for 8 models x 4 GPUs (paper §4.3: ~10 s for this step; target here < 1 s).

    Random robot mixes of up to 96 robots and random limits, on the mix placement and on two
    disjoint groups; instances where the robots fit and where they cannot are timed apart."""
    rng = random.Random(seed)
    fit, over, not_proven = [], [], 0
    for i in range(instances):
        placement = Placement.colocate(EIGHT_MODELS, 4) if i % 2 == 0 else Placement.parse(
            "pi0*:0,1;smolvla*:2,3", list(EIGHT_MODELS), 4)
        robots = {m: rng.randint(0, 12) for m in EIGHT_MODELS}
        limits = {m: rng.randint(8, 40) for m in EIGHT_MODELS}
        a = assign_ilp(placement, robots, limits)
        (fit if a.feasible else over).append(a.solve_ms)
        not_proven += not a.optimal
    rep.add(f"== Traffic ILP, 8 models x 4 GPUs, {instances} random instances (scipy.optimize.milp / HiGHS) ==")
    if fit:
        rep.add(f"robots fit ({len(fit)}): median {statistics.median(fit):.0f} ms, max {max(fit):.0f} ms "
                f"({'< 1 s' if max(fit) < 1000 else 'OVER 1 s'}; paper's initialisation step: ~10 s)")
    if over:
        rep.add(f"robots do not fit ({len(over)}): median {statistics.median(over):.0f} ms, max {max(over):.0f} ms; "
                f"{not_proven} stopped at the 1 s budget with the best assignment found")
    rep.add()
    return {"fit_max_ms": max(fit) if fit else None, "over_max_ms": max(over) if over else None,
            "not_proven": not_proven}


def multi_model(profile: ProfileTable, s: BenchSettings, rep: BenchReport, limits: dict[str, int],
                max_batch) -> dict:
    """§5.4 Fig. 12: 8 VLA variants on a 4-GPU server, equal robots per model, up to 96 robots."""
    models = list(EIGHT_MODELS)
    placements = [Placement.colocate(models, 4)] + [
        Placement.parse(spec, models, 4) for spec in ("pi0*:0,1;smolvla*:2,3", "pi0*:0,1,2;smolvla*:3", "pi0*:0;smolvla*:1,2,3")]
    rep.add("== 8 models x 4 GPUs (4 pi0-like + 4 SmolVLA-like variants), robots split equally, ILP traffic control ==")
    out = {}
    for pl in placements:
        def run(n, pl=pl):
            robots = {m: n for m in models}
            return _assign_and_simulate(assign_ilp, pl, robots, limits, profile, s, max_batch)[0]

        n, seen = sim.max_robots(run, TARGET, cap=12)
        out[pl.name] = n * len(models)
        r = seen.get(n)
        rep.add(f"placement {pl.name:24} max robots at {TARGET:.0%}: {n * len(models):3d}"
                + (f"  (p99 {r.p99_ms:.0f} ms)" if r else ""))
    best = max(out, key=out.get)
    rep.add(f"best placement {best}: {out[best]} robots (sweep capped at 96 = 12 per model; "
            f"paper: {PAPER['eight_by_four']})")
    rep.add()
    return out


def inter_gpu(profile: ProfileTable, s: BenchSettings, rep: BenchReport, limits: dict[str, int],
              max_batch) -> dict:
    """§5.4 Fig. 13: one pi0 model on 4 GPUs — intra-GPU (Robion, replicated) vs inter-GPU Dis-k:m."""
    rep.add("== pi0 on 4 GPUs: intra-GPU stage disaggregation (Robion x4) vs inter-GPU Dis-k:m ==")
    placement = Placement.replicate("pi0", range(4), 4)
    out = {}

    def robion_run(n):
        return _assign_and_simulate(assign_ilp, placement, {"pi0": n}, limits, profile, s, max_batch)[0]

    out["robion-x4"], _ = sim.max_robots(robion_run, TARGET, cap=128)
    for k in (1, 2, 3):
        system_for = (lambda mb, k=k: sim.disaggregated(k, 4 - k, max_batch=mb))
        out[f"dis-{k}:{4 - k}"], _, _ = best_max_robots(system_for, lambda n: {"pi0": n}, profile, s)
    for name, n in out.items():
        rep.add(f"{name:12} max robots at {TARGET:.0%}: {n}")
    best_dis = max(v for k, v in out.items() if k.startswith("dis"))
    rep.add(f"robion-x4 / best inter-GPU: {_fmt_ratio(_ratio(out['robion-x4'], best_dis))} "
            f"(paper: {PAPER['intra_gpu']} vs {PAPER['best_inter_gpu']} robots = "
            f"{PAPER['intra_gpu'] / PAPER['best_inter_gpu']:.2f}x)")
    rep.add()
    return out


def run_bench(profile: ProfileTable, settings: BenchSettings, experiments=EXPERIMENTS,
              emit: Callable[[str], None] | None = None) -> BenchReport:
    rep = BenchReport()
    start = time.perf_counter()

    def flush():
        if emit:
            for line in rep.lines[flush.n:]:
                emit(line)
        flush.n = len(rep.lines)

    flush.n = 0
    rep.add(f"profile {profile.name} ({profile.backend}; {profile.device.get('count', 1)} x {profile.device.get('name')}); "
            f"{settings.epochs} epochs x {settings.duration_s:g} s, robots at 2 Hz, target {TARGET:.0%}")
    rep.add()
    flush()
    best_mb = {}
    if "single" in experiments:
        rep.data["single"] = single_model(profile, settings, rep)
        best_mb = rep.data["single"]["best_max_batch"]
        flush()
    if "policies" in experiments:
        rep.data["policies"] = policies(profile, settings, rep)
        flush()
    need_limits = {"traffic", "multi", "inter-gpu"} & set(experiments)
    if need_limits:
        arch_mb = {}
        for arch in ("pi0", "smolvla"):
            arch_mb[arch] = best_mb.get(arch) or best_max_robots(
                lambda b: sim.robion(max_batch=b), lambda n, a=arch: {a: n}, profile, settings)[1]
        mb = {m: arch_mb[model_spec(m).arch] for m in EIGHT_MODELS}
        limits = robot_limits(profile, EIGHT_MODELS, max_batch=mb, epochs=settings.epochs,
                              duration_s=settings.duration_s, seed=settings.seed)
        rep.add(f"robot limits per GPU at {TARGET:.0%} (Robion; best max batch per architecture): "
                + ", ".join(f"{a}={limits[a]} (mb {arch_mb[a]})" for a in ("pi0", "smolvla")))
        rep.add()
        rep.data["limits"] = limits
        flush()
        if "traffic" in experiments:
            rep.data["traffic"] = traffic(profile, settings, rep, limits, mb)
            flush()
    if "ilp" in experiments:
        rep.data["ilp"] = ilp_timing(rep)
        flush()
    if need_limits and "multi" in experiments:
        rep.data["multi"] = multi_model(profile, settings, rep, limits, mb)
        flush()
    if need_limits and "inter-gpu" in experiments:
        rep.data["inter_gpu"] = inter_gpu(profile, settings, rep, limits, mb)
        flush()
    rep.add(f"bench took {time.perf_counter() - start:.1f} s")
    flush()
    return rep
