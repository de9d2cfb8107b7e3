"""Management engine: model placement and robot-to-GPU traffic control (Robion §4.2).

Placement says which GPUs host which models: co-locate ("mix": every model on every GPU),
replicate one model over GPUs, or partition the GPUs into disjoint groups each serving a subset
(e.g. the fine-tuned variants of one architecture).

The traffic controller assigns each model's robots to the GPUs hosting it. With L_m the robot
limit of model m on one GPU (the most robots one GPU serves alone at the target SLO attainment,
found by benchmarking — here by simulation with the profile), GPU g's load is
sum_m x[m,g] / L_m and must stay <= 1. Among assignments within that bound, the integer program
maximises per-model batching by splitting each model over as few GPUs as possible, then
(our addition) keeps as many GPUs in use as possible — for a fixed number of splits that is
the fewest models sharing a GPU — and then minimises the most loaded GPU's load:

    minimise   (overload,  sum_{m,g} y[m,g],  -sum_g u[g],  z)   (lexicographically; the middle
                                                                two only count when overload = 0)
    subject to sum_g x[m,g] = R_m                        (every robot placed)
               x[m,g] <= R_m * y[m,g]                    (y: model m uses GPU g)
               sum_m x[m,g] / L_m <= z                   (z: the peak load)
               sum_m x[m,g] / L_m <= 1 + overload        (only > 0 when no assignment fits)
               u[g] <= sum_m y[m,g]                      (u: GPU g in use)
               x integer >= 0, y, u binary, z, overload >= 0

solved as up to four MILPs in sequence with scipy.optimize.milp (HiGHS). A brute-force enumeration
over the same lexicographic objective checks it on small instances.

Baselines, as the paper names them (our reading, see docs/vla.md):
  SMG — single model per GPU: all robots of a model go to one GPU (its home among its hosts);
        batching is maximal but a popular model overloads its GPU.
  EPS — even population split: each model's robots are spread evenly over all GPUs hosting it;
        load is balanced but every GPU sees small per-model queues (little batching).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np


@dataclass(frozen=True)
class Placement:
    name: str
    n_gpus: int
    hosts: Mapping[str, tuple[int, ...]]  # model -> GPUs hosting it

    def __post_init__(self):
        for m, gs in self.hosts.items():
            if not gs or any(not 0 <= g < self.n_gpus for g in gs):
                raise ValueError(f"model {m} must be hosted on GPUs within 0..{self.n_gpus - 1}, got {gs}")

    @property
    def models(self) -> list[str]:
        return list(self.hosts)

    def models_on(self, gpu: int) -> list[str]:
        return [m for m, gs in self.hosts.items() if gpu in gs]

    def pairs(self) -> list[tuple[str, int]]:
        return [(m, g) for m, gs in self.hosts.items() for g in gs]

    @classmethod
    def colocate(cls, models: Iterable[str], n_gpus: int) -> "Placement":
        """'mix': every model on every GPU."""
        return cls("mix", n_gpus, {m: tuple(range(n_gpus)) for m in models})

    @classmethod
    def groups(cls, groups: list[tuple[list[str], list[int]]], n_gpus: int | None = None, name: str | None = None) -> "Placement":
        """Disjoint GPU groups, each hosting its models (a model may appear in one group only)."""
        hosts, used = {}, set()
        for models, gpus in groups:
            if used & set(gpus):
                raise ValueError("GPU groups must be disjoint")
            used |= set(gpus)
            for m in models:
                if m in hosts:
                    raise ValueError(f"model {m} is in two groups")
                hosts[m] = tuple(sorted(gpus))
        n = n_gpus or (max(used) + 1)
        label = name or "groups-" + ":".join(str(len(g)) for _, g in groups)
        return cls(label, n, hosts)

    @classmethod
    def replicate(cls, model: str, gpus: Iterable[int], n_gpus: int) -> "Placement":
        return cls(f"replicate-{model}", n_gpus, {model: tuple(sorted(gpus))})

    @classmethod
    def parse(cls, spec: str, models: list[str], n_gpus: int) -> "Placement":
        """'mix', or groups like 'pi0*:0,1;smolvla*:2,3' (model globs : GPU list, ';' between groups)."""
        import fnmatch

        if spec == "mix":
            return cls.colocate(models, n_gpus)
        groups = []
        for part in spec.split(";"):
            try:
                pats, gpus = part.split(":")
                gpu_list = [int(g) for g in gpus.split(",") if g.strip()]
            except ValueError:
                raise ValueError(f"bad placement group {part!r}; expected 'model-glob[,glob]:gpu,gpu'") from None
            chosen = [m for m in models if any(fnmatch.fnmatch(m, p.strip()) for p in pats.split(","))]
            groups.append((chosen, gpu_list))
        placement = cls.groups(groups, n_gpus, name=spec)
        unplaced = set(models) - set(placement.hosts)
        if unplaced:
            raise ValueError(f"placement {spec!r} hosts no GPU for {sorted(unplaced)}")
        return placement


@dataclass(frozen=True)
class TrafficAssignment:
    method: str
    counts: dict[tuple[str, int], int]  # (model, GPU) -> robots
    objective: tuple[float, int, int, float]  # (overload, splits, -GPUs used, peak load), lexicographic
    splits: int  # (model, GPU) pairs in use
    peak_load: float
    feasible: bool  # every GPU within its robot limit
    solve_ms: float = 0.0
    loads: dict[int, float] = field(default_factory=dict)
    optimal: bool = True  # False: the solver's time limit hit first; this is its best assignment

    def robots_on(self, gpu: int) -> dict[str, int]:
        return {m: n for (m, g), n in self.counts.items() if g == gpu and n}


TOL = 1e-9


def _check(robots: Mapping[str, int], limits: Mapping[str, float], placement: Placement) -> None:
    for m in robots:
        if m not in placement.hosts:
            raise ValueError(f"model {m} has robots but no GPU in placement {placement.name!r}")
        if limits.get(m, 0) <= 0:
            raise ValueError(f"model {m} has no positive robot limit")


def _evaluate(method: str, counts: dict[tuple[str, int], int], robots, limits, placement, solve_ms=0.0,
              optimal: bool = True) -> TrafficAssignment:
    _check(robots, limits, placement)
    loads = {g: 0.0 for g in range(placement.n_gpus)}
    for (m, g), n in counts.items():
        loads[g] += n / limits[m]
    peak = max(loads.values()) if loads else 0.0
    overload = max(0.0, peak - 1.0)
    splits = sum(1 for n in counts.values() if n > 0)
    used = len({g for (_, g), n in counts.items() if n > 0})
    # Lexicographic objective: overload first; splits and GPUs in use only matter when all fits.
    fits = overload <= TOL
    key = (round(overload, 9), splits if fits else 0, -used if fits else 0, round(peak, 9))
    return TrafficAssignment(method, {k: v for k, v in counts.items() if v}, key, splits, peak,
                             overload <= TOL, solve_ms, loads, optimal)


def assign_ilp(placement: Placement, robots: Mapping[str, int], limits: Mapping[str, float],
               time_limit_s: float = 1.0) -> TrafficAssignment:
    """Lexicographic optimum of (overload, splits, -GPUs in use, peak load), one MILP per criterion.

    Solving the criteria in sequence (each later MILP constrained to the earlier optima) gives
    HiGHS integral objectives with tight bounds, instead of one weighted objective whose tiny
    tie-break weights make optimality slow to prove. `time_limit_s` bounds all solves together;
    if it runs out (in practice only when the robots do not fit: a makespan problem whose optimum
    is slow to prove) the best assignment found is returned with `optimal=False`.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    robots = {m: int(n) for m, n in robots.items() if n > 0}
    t0 = time.perf_counter()
    _check(robots, limits, placement)
    if not robots:
        return _evaluate("ilp", {}, {}, {}, placement)
    pairs = [(m, g) for (m, g) in placement.pairs() if m in robots]
    n, n_gpus = len(pairs), placement.n_gpus
    # variables: x (n robots per pair), y (n pair in use), z (peak load), o (overload), u (GPU in use)
    ix, iy, iz, io, iu = 0, n, 2 * n, 2 * n + 1, 2 * n + 2
    nv = 2 * n + 2 + n_gpus
    rows, lo, hi = [], [], []

    def add(row, low, high):
        rows.append(row), lo.append(low), hi.append(high)

    def vec(**entries):
        row = np.zeros(nv)
        for k, v in entries.items():
            row[int(k[1:])] = v
        return row

    for m, r in robots.items():  # every robot placed
        row = np.zeros(nv)
        row[[ix + i for i, (mm, _) in enumerate(pairs) if mm == m]] = 1.0
        add(row, r, r)
    for i, (m, _) in enumerate(pairs):  # x <= R y
        add(vec(**{f"v{ix + i}": 1.0, f"v{iy + i}": -robots[m]}), -np.inf, 0.0)
    loads = {}
    for g in range(n_gpus):
        load = np.zeros(nv)
        on_g = [i for i, (_, gg) in enumerate(pairs) if gg == g]
        for i in on_g:
            load[ix + i] = 1.0 / limits[pairs[i][0]]
        loads[g] = load
        used = np.zeros(nv)
        used[iu + g] = 1.0
        used[[iy + i for i in on_g]] = -1.0
        add(used, -np.inf, 0.0)  # u_g <= sum of y on g: a GPU counts as used only with a model on it
        if not on_g:
            continue
        add(load - vec(**{f"v{iz}": 1.0}), -np.inf, 0.0)  # load <= z
        add(load - vec(**{f"v{io}": 1.0}), -np.inf, 1.0)  # load <= 1 + o
    # Symmetry breaking: GPUs hosting the same models are interchangeable, so order their loads.
    # This removes equivalent solutions from the search without changing any optimum.
    for g in range(n_gpus - 1):
        if loads[g].any() and placement.models_on(g) == placement.models_on(g + 1):
            add(loads[g] - loads[g + 1], 0.0, np.inf)
    integrality = np.r_[np.ones(2 * n), 0, 0, np.ones(n_gpus)]
    upper = np.r_[[robots[m] for m, _ in pairs], np.ones(n), np.inf, np.inf, np.ones(n_gpus)]
    bounds = Bounds(np.zeros(nv), upper)
    deadline = t0 + time_limit_s
    proven = [True]

    def solve(c, extra=()):
        A = np.array(rows + [e[0] for e in extra])
        opts = {"time_limit": max(0.05, deadline - time.perf_counter()), "mip_rel_gap": 1e-7}
        res = milp(c, constraints=LinearConstraint(A, lo + [e[1] for e in extra], hi + [e[2] for e in extra]),
                   integrality=integrality, bounds=bounds, options=opts)
        if res.x is None:
            raise RuntimeError(f"traffic ILP found no solution: {res.message}")
        proven[0] &= res.status == 0  # 1: time limit reached, with an incumbent
        return res

    def done(res):
        counts = {p: int(round(res.x[ix + i])) for i, p in enumerate(pairs)}
        return _evaluate("ilp", counts, robots, limits, placement, (time.perf_counter() - t0) * 1e3, proven[0])

    c_over = vec(**{f"v{io}": 1.0})
    c_splits = np.zeros(nv)
    c_splits[iy:iy + n] = 1.0
    c_unused = np.zeros(nv)
    c_unused[iu:iu + n_gpus] = -1.0
    c_peak = vec(**{f"v{iz}": 1.0})
    # 1. least overload: zero whenever the robots fit within every GPU's limit. When they do not,
    #    no assignment meets the SLOs and balancing matters more than batching: the least-overload
    #    solution (which also has the least peak load) is the answer.
    res = solve(c_over)
    if res.fun > TOL:
        return done(res)
    fixed = [(c_over, -np.inf, 0.0)]
    # 2. fewest (model, GPU) splits: concentrate each model's robots, for batching
    splits = round(solve(c_splits, fixed).fun)
    fixed.append((c_splits, -np.inf, splits + 0.5))
    # 3. as many GPUs in use as possible: with the splits fixed, the fewest models sharing a GPU
    unused = round(solve(c_unused, fixed).fun)
    fixed.append((c_unused, -np.inf, unused + 0.5))
    # 4. lowest peak load
    return done(solve(c_peak, fixed))


def _compositions(total: int, parts: int):
    """All ways to write `total` as an ordered sum of `parts` non-negative integers."""
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, out = -1, []
        for b in bars:
            out.append(b - prev - 1)
            prev = b
        out.append(total + parts - 2 - prev)
        yield out


def assign_brute_force(placement: Placement, robots: Mapping[str, int], limits: Mapping[str, float],
                       max_candidates: int = 2_000_000) -> TrafficAssignment:
    """Exhaustive search over the same objective (small instances only)."""
    robots = {m: int(n) for m, n in robots.items() if n > 0}
    per_model = []
    total = 1
    for m, r in robots.items():
        gpus = placement.hosts[m]
        options = [dict(zip([(m, g) for g in gpus], comp)) for comp in _compositions(r, len(gpus))]
        per_model.append(options)
        total *= len(options)
    if total > max_candidates:
        raise ValueError(f"{total} candidate assignments: too many for brute force")
    best = None
    for combo in itertools.product(*per_model):
        counts = {}
        for part in combo:
            counts.update(part)
        cand = _evaluate("brute-force", counts, robots, limits, placement)
        if best is None or cand.objective < best.objective:
            best = cand
    return best if best is not None else _evaluate("brute-force", {}, robots, limits, placement)


def assign_smg(placement: Placement, robots: Mapping[str, int], limits: Mapping[str, float]) -> TrafficAssignment:
    """SMG: each model's robots all on one GPU, homes spread round-robin over its hosts."""
    counts, turn = {}, {}
    for m, r in robots.items():
        gpus = placement.hosts[m]
        k = turn.get(gpus, 0)
        turn[gpus] = k + 1
        counts[(m, gpus[k % len(gpus)])] = int(r)
    return _evaluate("smg", counts, {m: r for m, r in robots.items() if r}, limits, placement)


def assign_eps(placement: Placement, robots: Mapping[str, int], limits: Mapping[str, float]) -> TrafficAssignment:
    """EPS: each model's robots split evenly over all GPUs hosting it (remainders round-robin)."""
    counts, turn = {}, 0
    for m, r in robots.items():
        gpus = placement.hosts[m]
        base, extra = divmod(int(r), len(gpus))
        for i, g in enumerate(gpus):
            counts[(m, g)] = base + (1 if (i - turn) % len(gpus) < extra else 0)
        turn += extra
    return _evaluate("eps", counts, {m: r for m, r in robots.items() if r}, limits, placement)


ASSIGNERS = {"ilp": assign_ilp, "smg": assign_smg, "eps": assign_eps, "brute-force": assign_brute_force}


def robot_limits(profile, models: Iterable[str], *, target: float = 0.98, max_batch: int | Mapping[str, int] = 2,
                 epochs: int = 3, duration_s: float = 10.0, seed: int = 0, cap: int = 128) -> dict[str, int]:
    """Most robots of each model one GPU serves alone at `target` attainment (Robion §4.2.2),
    found by simulating the lockstep engine with the profile. Variants share their architecture's
    result, as they share its profile."""
    from common.vla import sim
    from common.vla.config import model_spec

    by_arch: dict[str, int] = {}
    out = {}
    for m in models:
        arch = model_spec(m).arch
        if arch not in by_arch:
            mb = max_batch[m] if isinstance(max_batch, Mapping) else max_batch
            system = sim.robion(max_batch=mb)
            by_arch[arch], _ = sim.max_robots(
                lambda n: sim.simulate(system, sim.Workload({arch: n}, epochs=epochs, duration_s=duration_s, seed=seed),
                                       profile), target=target, cap=cap)
        out[m] = by_arch[arch]
    return out


def format_assignment(a: TrafficAssignment, placement: Placement) -> str:
    lines = [f"{a.method}: splits={a.splits} peak_load={a.peak_load:.3f} within_limits={a.feasible} "
             f"optimal={'yes' if a.optimal else 'no (time limit)'} solve={a.solve_ms:.1f} ms"]
    for g in range(placement.n_gpus):
        on = a.robots_on(g)
        desc = ", ".join(f"{m}={n}" for m, n in sorted(on.items())) or "-"
        lines.append(f"  GPU {g}: load {a.loads.get(g, 0.0):.3f}  {desc}")
    return "\n".join(lines)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf
