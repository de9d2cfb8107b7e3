"""Management engine: model placement and robot-to-GPU traffic control (Robion §4.2).

Placement says which GPUs host which models: co-locate ("mix": every model on every GPU),
replicate one model over GPUs, or partition the GPUs into disjoint groups each serving a subset
(e.g. the fine-tuned variants of one architecture).

The traffic controller assigns each model's robots to the GPUs hosting it. With L_m(k) the robot
limit of model m on one GPU shared by k models (the most robots of m's architecture one GPU serves
at the target SLO attainment for every model when k variants share it — found by simulating the
lockstep engine with the profile; co-located models batch separately and wait behind each other's
locksteps, so L(k) falls fast with k), GPU g's load is sum_m x[m,g] / L_m(k_g), with k_g the
number of models on g, and must stay <= 1. Among assignments within that bound, the integer
program maximises per-model batching by splitting each model over as few GPUs as possible, then
(our addition) keeps as many GPUs in use as possible — for a fixed number of splits that is the
fewest models sharing a GPU — then minimises the most loaded GPU's load, then evens out the
GPUs below the peak:

    minimise   (overload,  sum y,  -sum_g u[g],  z,  sum_g pen(l[g]))   (lexicographically)
    subject to sum_g x[m,g] = R_m                                 (every robot placed)
               x[m,g] <= R_m * y[m,g]                             (y: model m uses GPU g)
               sum_k k w[g,k] = sum_m y[m,g],  sum_k w[g,k] <= 1  (w: g hosts exactly k models)
               sum_m x[m,g] / L_m(k) <= z, 1 + overload, l[g]     (rows active where w[g,k] = 1)
               u[g] <= sum_m y[m,g]                               (u: GPU g in use)
               pen(l) >= tangents of l^2                          (convex: spreads the load)

solved as up to five MILPs in sequence with scipy.optimize.milp (HiGHS) within one time budget;
when the budget runs out, the best assignment found so far is returned and flagged. With one
limit per model (co-location-blind, as in the paper's description) the w rows collapse to one.
A brute-force enumeration over the same lexicographic objective checks it on small instances.
`TrafficController` (controller.py) adds the co-location limits and checks every plan in the
simulator before it emits it.

Baselines, as the paper names them (our reading, see docs/vla.md):
  SMG — single model per GPU: all robots of a model go to one GPU (its home among its hosts);
        batching is maximal but a popular model overloads its GPU.
  EPS — even population split: each model's robots are spread evenly over all GPUs hosting it;
        load is balanced but every GPU sees small per-model queues (little batching).
"""

from __future__ import annotations

import fnmatch
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.vla import sim
from common.vla.config import model_spec


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
    def colocate(cls, models: Iterable[str], n_gpus: int) -> Placement:
        """'mix': every model on every GPU."""
        return cls("mix", n_gpus, {m: tuple(range(n_gpus)) for m in models})

    @classmethod
    def groups(
        cls, groups: list[tuple[list[str], list[int]]], n_gpus: int | None = None, name: str | None = None
    ) -> Placement:
        """Disjoint GPU groups, each hosting its models (a model may appear in one group only)."""
        hosts: dict[str, tuple[int, ...]] = {}
        used: set[int] = set()
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
    def replicate(cls, model: str, gpus: Iterable[int], n_gpus: int) -> Placement:
        return cls(f"replicate-{model}", n_gpus, {model: tuple(sorted(gpus))})

    @classmethod
    def parse(cls, spec: str, models: list[str], n_gpus: int) -> Placement:
        """'mix', or groups like 'pi0*:0,1;smolvla*:2,3' (model globs : GPU list, ';' between groups)."""

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
    optimal: bool = True  # False: the time budget ran out first; this is the best assignment found by then
    note: str = ""  # what stopped the search early, when something did

    def robots_on(self, gpu: int) -> dict[str, int]:
        return {m: n for (m, g), n in self.counts.items() if g == gpu and n}


TOL = 1e-9
DEFAULT_ILP_TIME_LIMIT_S = 2.0  # all stages together; an expired budget returns the best found
# A composition the limits say nothing about (more co-located models than were measured) costs
# this many GPUs per robot: never chosen while anything else fits, and flagged when it is.
UNMEASURED_LOAD_PER_ROBOT = 4.0

# Robot limits: one number per model (co-location-blind: the same limit whatever shares the GPU)
# or a sequence per model whose k-th entry (k = 1, 2, ...) is the most robots of this model's
# architecture one GPU serves when k models share it (see `colocation_limits`).
Limits = Mapping[str, "float | Sequence[float]"]


def limit_for(limits: Limits, model: str, k: int) -> float:
    """Robot limit of `model` on a GPU shared by k models; 0 when unknown (more models than measured)."""
    lim = limits[model]
    if isinstance(lim, (int, float)):
        return float(lim)
    return float(lim[k - 1]) if k <= len(lim) else 0.0


def _per_robot(limits: Limits, model: str, k: int) -> float:
    lim = limit_for(limits, model, k)
    return 1.0 / lim if lim > 0 else UNMEASURED_LOAD_PER_ROBOT


def colocation_aware(limits: Limits) -> bool:
    return any(not isinstance(v, (int, float)) and len(set(v)) > 1 for v in limits.values())


def gpu_load(robots_on_gpu: Mapping[str, int], limits: Limits) -> float:
    """Load of one GPU: sum over its models of robots / limit at its number of co-located models."""
    on = {m: n for m, n in robots_on_gpu.items() if n > 0}
    return sum(n * _per_robot(limits, m, len(on)) for m, n in on.items())


def _check(robots: Mapping[str, int], limits: Limits, placement: Placement) -> None:
    for m in robots:
        if m not in placement.hosts:
            raise ValueError(f"model {m} has robots but no GPU in placement {placement.name!r}")
        if m not in limits or limit_for(limits, m, 1) <= 0:
            raise ValueError(f"model {m} has no positive robot limit")


def _evaluate(
    method: str,
    counts: dict[tuple[str, int], int],
    robots,
    limits,
    placement,
    solve_ms=0.0,
    optimal: bool = True,
    note: str = "",
) -> TrafficAssignment:
    _check(robots, limits, placement)
    per_gpu: dict[int, dict[str, int]] = {g: {} for g in range(placement.n_gpus)}
    for (m, g), n in counts.items():
        per_gpu[g][m] = per_gpu[g].get(m, 0) + n
    loads = {g: gpu_load(on, limits) for g, on in per_gpu.items()}
    peak = max(loads.values()) if loads else 0.0
    overload = max(0.0, peak - 1.0)
    splits = sum(1 for n in counts.values() if n > 0)
    used = len({g for (_, g), n in counts.items() if n > 0})
    # Lexicographic objective: overload first; splits and GPUs in use only matter when all fits.
    fits = overload <= TOL
    key = (round(overload, 9), splits if fits else 0, -used if fits else 0, round(peak, 9))
    return TrafficAssignment(
        method,
        {k: v for k, v in counts.items() if v},
        key,
        splits,
        peak,
        overload <= TOL,
        solve_ms,
        loads,
        optimal,
        note,
    )


def assign_greedy(placement: Placement, robots: Mapping[str, int], limits: Limits) -> TrafficAssignment:
    """Each model whole on the host GPU that leaves the least peak load (the biggest models first).

    Instant; the ILP falls back to it when its time budget ends before HiGHS finds any assignment."""
    robots = {m: int(n) for m, n in robots.items() if n > 0}
    _check(robots, limits, placement)
    on: dict[int, dict[str, int]] = {g: {} for g in range(placement.n_gpus)}
    for m in sorted(robots, key=lambda m: -robots[m] * _per_robot(limits, m, 1)):

        def cost(g, m=m):
            after = {**on[g], m: robots[m]}
            return gpu_load(after, limits), len(after)

        best = min(placement.hosts[m], key=cost)
        on[best][m] = robots[m]
    counts = {(m, g): n for g, ms in on.items() for m, n in ms.items()}
    return _evaluate("greedy", counts, robots, limits, placement)


# Tangents of load^2 every 1/16 up to 2: the balance stage minimises the sum of this convex
# piecewise-linear penalty, which spreads load evenly over the GPUs below the peak (a coarser
# grid ties uneven splits whose loads fall between two tangent points).
_BALANCE_POINTS = tuple(i / 16 for i in range(33))


def assign_ilp(
    placement: Placement, robots: Mapping[str, int], limits: Limits, time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S
) -> TrafficAssignment:
    """Lexicographic optimum of (overload, splits, -GPUs in use, peak load, balance), one MILP each.

    Solving the criteria in sequence (each later MILP constrained to the earlier optima) gives
    HiGHS integral objectives with tight bounds, instead of one weighted objective whose tiny
    tie-break weights make optimality slow to prove. `time_limit_s` bounds all solves together
    and the answer never depends on it being enough: when it runs out, the best assignment found
    so far is returned with `optimal=False` (the stage's incumbent, else the previous stage's
    solution, else, before any, the greedy assignment).

    With co-location-aware limits (a sequence per model), binaries w[g,k] say that GPU g hosts
    exactly k models and switch on that GPU's load row for k (big-M rows for the other k).
    """
    # lazy: scipy (~0.3 s), only for the ILP assigner
    from scipy.optimize import Bounds, LinearConstraint, milp

    robots = {m: int(n) for m, n in robots.items() if n > 0}
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    _check(robots, limits, placement)
    if not robots:
        return _evaluate("ilp", {}, {}, {}, placement)
    pairs = [(m, g) for (m, g) in placement.pairs() if m in robots]
    n, n_gpus = len(pairs), placement.n_gpus
    on_gpu = {g: [i for i, (_, gg) in enumerate(pairs) if gg == g] for g in range(n_gpus)}
    # Per-k rows when limits vary with k, or when a GPU could hold more models than a table covers.
    tables = [t for t in (limits[m] for m in robots) if not isinstance(t, (int, float))]
    most = max((len(v) for v in on_gpu.values()), default=0)
    aware = colocation_aware({m: limits[m] for m in robots}) or any(len(t) < most for t in tables)
    # GPU g's possible model counts k, each with its own load row (one row when limits ignore k).
    ks = {g: (list(range(1, len(on_gpu[g]) + 1)) if aware else [0]) for g in range(n_gpus)}
    names: list[str] = []

    def var(name):
        names.append(name)
        return len(names) - 1

    ix = [var(f"x{i}") for i in range(n)]
    iy = [var(f"y{i}") for i in range(n)]
    iz, io = var("z"), var("o")
    iu = [var(f"u{g}") for g in range(n_gpus)]
    il = [var(f"l{g}") for g in range(n_gpus)]  # >= GPU g's load (tight once the balance stage runs)
    it = [var(f"t{g}") for g in range(n_gpus)]  # balance penalty of GPU g
    iw = {(g, k): var(f"w{g},{k}") for g in range(n_gpus) for k in ks[g] if aware}
    nv = len(names)
    rows, lo, hi = [], [], []
    balance = []  # rows only the balance stage needs (they slow the earlier stages down)

    def add(entries: dict[int, float], low, high):
        row = np.zeros(nv)
        for j, v in entries.items():
            row[j] += v
        rows.append(row)
        lo.append(low)
        hi.append(high)

    for m, r in robots.items():  # every robot placed
        add({ix[i]: 1.0 for i, (mm, _) in enumerate(pairs) if mm == m}, r, r)
    for i, (m, _) in enumerate(pairs):  # x <= R y
        add({ix[i]: 1.0, iy[i]: -robots[m]}, -np.inf, 0.0)
    for g in range(n_gpus):
        add({iu[g]: 1.0, **{iy[i]: -1.0 for i in on_gpu[g]}}, -np.inf, 0.0)  # u_g <= models on g
        if not on_gpu[g]:
            continue
        if aware:  # exactly one k is active on a used GPU, and it counts the models there
            add({iw[g, k]: float(k) for k in ks[g]} | {iy[i]: -1.0 for i in on_gpu[g]}, 0.0, 0.0)
            add({iw[g, k]: 1.0 for k in ks[g]}, 0.0, 1.0)
        for k in ks[g]:
            load = {ix[i]: _per_robot(limits, pairs[i][0], max(k, 1)) for i in on_gpu[g]}
            big = sum(robots[pairs[i][0]] * c for i, c in zip(on_gpu[g], load.values(), strict=True)) if aware else 0.0
            off = {iw[g, k]: big} if aware else {}  # the row binds only where w[g,k] = 1
            add(load | off | {io: -1.0}, -np.inf, 1.0 + big)  # load <= 1 + o
            add(load | off | {iz: -1.0}, -np.inf, big)  # load <= z
            balance.append((load | off | {il[g]: -1.0}, -np.inf, big))  # load <= l_g
        for p in _BALANCE_POINTS:  # t_g >= tangent of l_g^2 at p
            balance.append(({it[g]: 1.0, il[g]: -2.0 * p}, -p * p, np.inf))
    # Symmetry breaking: GPUs hosting the same models are interchangeable, so order their robot
    # counts. This removes equivalent solutions from the search without changing any optimum.
    for g in range(n_gpus - 1):
        if on_gpu[g] and placement.models_on(g) == placement.models_on(g + 1):
            if aware:
                add({**{ix[i]: 1.0 for i in on_gpu[g]}, **{ix[i]: -1.0 for i in on_gpu[g + 1]}}, 0.0, np.inf)
            else:
                add(
                    {
                        **{ix[i]: _per_robot(limits, pairs[i][0], 1) for i in on_gpu[g]},
                        **{ix[i]: -_per_robot(limits, pairs[i][0], 1) for i in on_gpu[g + 1]},
                    },
                    0.0,
                    np.inf,
                )
    integrality = np.zeros(nv)
    integrality[ix + iy + iu + list(iw.values())] = 1
    upper = np.full(nv, np.inf)
    upper[ix] = [robots[m] for m, _ in pairs]
    upper[iy + iu + list(iw.values())] = 1.0
    bounds = Bounds(np.zeros(nv), upper)
    proven, notes = [True], []

    def solve(c: dict[int, float], fixed=()):
        """The stage's solution, or None when the budget ended before HiGHS found one."""
        left = deadline - time.perf_counter()
        if left < 0.01:
            proven[0] = False
            notes.append("time budget spent before this stage")
            return None
        cost = np.zeros(nv)
        for j, v in c.items():
            cost[j] = v
        extra = [(np.array([cc.get(j, 0.0) for j in range(nv)]), a, b) for cc, a, b in fixed]
        A = np.array(rows + [e[0] for e in extra])
        res = milp(
            cost,
            constraints=LinearConstraint(A, lo + [e[1] for e in extra], hi + [e[2] for e in extra]),
            integrality=integrality,
            bounds=bounds,
            options={"time_limit": left, "mip_rel_gap": 1e-7},
        )
        if res.status != 0:  # 1: limit reached (with or without an incumbent); others: solver trouble
            proven[0] = False
            notes.append(f"HiGHS: {res.message}")
        return res if res.x is not None else None

    def done(res, method="ilp"):
        ms = (time.perf_counter() - t0) * 1e3
        if res is None:  # nothing from HiGHS at all: the greedy assignment, flagged
            g = assign_greedy(placement, robots, limits)
            return _evaluate(
                method,
                g.counts,
                robots,
                limits,
                placement,
                ms,
                False,
                "; ".join(notes + ["greedy assignment (no ILP incumbent in time)"]),
            )
        counts = {p: int(round(res.x[ix[i]])) for i, p in enumerate(pairs)}
        return _evaluate(method, counts, robots, limits, placement, ms, proven[0], "; ".join(notes))

    c_over = {io: 1.0}
    c_splits = {j: 1.0 for j in iy}
    c_unused = {j: -1.0 for j in iu}
    c_peak = {iz: 1.0}
    c_balance = {j: 1.0 for j in it}
    stages = [
        # 1. least overload: zero whenever the robots fit within every GPU's limit. When they do
        #    not, no assignment meets the SLOs and balancing matters more than batching: the
        #    least-overload solution (which also has the least peak load) is the answer.
        c_over,
        # 2. fewest (model, GPU) splits: concentrate each model's robots, for batching
        c_splits,
        # 3. as many GPUs in use as possible: with the splits fixed, the fewest models sharing a GPU
        c_unused,
        # 4. lowest peak load
        c_peak,
        # 5. balance: the sum of a convex penalty of each GPU's load (GPUs below the peak even out)
        c_balance,
    ]
    best = None
    fixed: list = []  # constraints fixed by the stages solved so far
    for stage, c in enumerate(stages):
        res = solve(c, fixed)
        if res is None:
            return done(best)
        best = res
        value = float(res.fun)
        if stage == 3:
            fixed.extend(balance)
        if stage == 0 and value > TOL:
            return done(best)
        if stage == 0:
            fixed.append((c, -np.inf, 0.0))
        elif stage in (1, 2):
            fixed.append((c, -np.inf, round(value) + 0.5))
        elif stage == 3:
            fixed.append((c, -np.inf, value + 1e-6))
    return done(best)


def _compositions(total: int, parts: int):
    """All ways to write `total` as an ordered sum of `parts` non-negative integers."""
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, out = -1, []
        for b in bars:
            out.append(b - prev - 1)
            prev = b
        out.append(total + parts - 2 - prev)
        yield out


def assign_brute_force(
    placement: Placement, robots: Mapping[str, int], limits: Limits, max_candidates: int = 2_000_000
) -> TrafficAssignment:
    """Exhaustive search over the same objective (small instances only)."""
    robots = {m: int(n) for m, n in robots.items() if n > 0}
    per_model = []
    total = 1
    for m, r in robots.items():
        gpus = placement.hosts[m]
        options = [dict(zip([(m, g) for g in gpus], comp, strict=True)) for comp in _compositions(r, len(gpus))]
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


def assign_smg(placement: Placement, robots: Mapping[str, int], limits: Limits) -> TrafficAssignment:
    """SMG: each model's robots all on one GPU, homes spread round-robin over its hosts."""
    counts: dict[tuple[str, int], int] = {}
    turn: dict[tuple[int, ...], int] = {}
    for m, r in robots.items():
        gpus = placement.hosts[m]
        k = turn.get(gpus, 0)
        turn[gpus] = k + 1
        counts[(m, gpus[k % len(gpus)])] = int(r)
    return _evaluate("smg", counts, {m: r for m, r in robots.items() if r}, limits, placement)


def assign_eps(placement: Placement, robots: Mapping[str, int], limits: Limits) -> TrafficAssignment:
    """EPS: each model's robots split evenly over all GPUs hosting it (remainders round-robin)."""
    counts, turn = {}, 0
    for m, r in robots.items():
        gpus = placement.hosts[m]
        base, extra = divmod(int(r), len(gpus))
        for i, g in enumerate(gpus):
            counts[(m, g)] = base + (1 if (i - turn) % len(gpus) < extra else 0)
        turn += extra
    return _evaluate("eps", counts, {m: r for m, r in robots.items() if r}, limits, placement)


ASSIGNERS: dict[str, Callable[[Placement, Mapping[str, int], Limits], TrafficAssignment]] = {
    "ilp": assign_ilp,
    "smg": assign_smg,
    "eps": assign_eps,
    "greedy": assign_greedy,
    "brute-force": assign_brute_force,
}


def robot_limits(
    profile,
    models: Iterable[str],
    *,
    target: float = 0.98,
    max_batch: int | Mapping[str, int] = 2,
    epochs: int = 3,
    duration_s: float = 10.0,
    seed: int = 0,
    cap: int = 128,
) -> dict[str, int]:
    """Most robots of each model one GPU serves alone at `target` attainment (Robion §4.2.2),
    found by simulating the lockstep engine with the profile. Variants share their architecture's
    result, as they share its profile."""

    by_arch: dict[str, int] = {}
    out = {}
    for m in models:
        arch = model_spec(m).arch
        if arch not in by_arch:
            mb = max_batch[m] if isinstance(max_batch, Mapping) else max_batch
            system = sim.robion(max_batch=mb)

            def run(n: int, system: sim.SystemConfig = system, arch: str = arch) -> sim.SimResult:
                workload = sim.Workload({arch: n}, epochs=epochs, duration_s=duration_s, seed=seed)
                return sim.simulate(system, workload, profile)

            by_arch[arch], _ = sim.max_robots(run, target=target, cap=cap)
        out[m] = by_arch[arch]
    return out


def format_assignment(a: TrafficAssignment, placement: Placement) -> str:
    lines = [
        f"{a.method}: splits={a.splits} peak_load={a.peak_load:.3f} within_limits={a.feasible} "
        f"optimal={'yes' if a.optimal else 'no (time limit)'} solve={a.solve_ms:.1f} ms"
    ]
    for g in range(placement.n_gpus):
        on = a.robots_on(g)
        desc = ", ".join(f"{m}={n}" for m, n in sorted(on.items())) or "-"
        lines.append(f"  GPU {g}: load {a.loads.get(g, 0.0):.3f}  {desc}")
    return "\n".join(lines)
