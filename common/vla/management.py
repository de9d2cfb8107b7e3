"""Management engine: model placement and robot-to-GPU traffic control (Robion §4.2).

Placement says which GPUs host which models: co-locate ("mix": every model on every GPU),
replicate one model over GPUs, or partition the GPUs into disjoint groups each serving a subset
(e.g. the fine-tuned variants of one architecture).

The traffic controller assigns each model's robots to the GPUs hosting it. With L_m(c) the robot
limit of model m on one GPU whose models form the composition c (how many models of each
architecture share it: pi0 + SmolVLA is another composition than two pi0 variants — found by
simulating the lockstep engine with the profile; co-located models batch separately and wait
behind each other's locksteps, so L falls fast as models join), GPU g's load is
sum_m x[m,g] / L_m(c_g) and must stay <= 1. Limits may also be keyed by the number of models
only (L_m(k), one table per model) or be one number per model (co-location-blind). Among
assignments within that bound, the integer program maximises per-model batching by splitting
each model over as few GPUs as possible, then (our addition) keeps as many GPUs in use as
possible — for a fixed number of splits that is the fewest models sharing a GPU — then
minimises the most loaded GPU's load, then evens out the GPUs below the peak:

    minimise   (overload,  sum y,  -sum_g u[g],  z,  sum_g pen(l[g]))   (lexicographically)
    subject to sum_g x[m,g] = R_m                                 (every robot placed)
               y[m,g] <= x[m,g] <= R_m * y[m,g]                   (y: model m uses GPU g)
               sum_c n_a(c) w[g,c] = sum_{m of a} y[m,g] for each architecture a,
               sum_c w[g,c] <= 1                                  (w: g hosts exactly composition c)
               sum_m x[m,g] / L_m(c) <= z, 1 + overload, l[g]     (rows active where w[g,c] = 1)
               u[g] <= sum_m y[m,g]                               (u: GPU g in use)
               pen(l) >= tangents of l^2                          (convex: spreads the load)

solved as up to five MILPs in sequence with scipy.optimize.milp (HiGHS) within one time budget;
when the budget runs out, the best assignment found so far is returned and flagged. With one
limit per model (co-location-blind, as in the paper's description) the w rows collapse to one.
With limits keyed by the number of models only, the compositions collapse to model counts k
(one "architecture"); compositions no limit covers share one row at UNMEASURED_LOAD_PER_ROBOT.
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

# A GPU's composition: how many of its models belong to each architecture, as sorted
# (architecture, count) pairs. Fine-tuned variants share their architecture's profile (paper
# §4.1.3), so the composition, not the models' names, decides what a GPU serves.
Composition = tuple[tuple[str, int], ...]

# Robot limits, per model, in one of three forms:
#  * one number (co-location-blind: the same limit whatever shares the GPU);
#  * a sequence whose k-th entry (k = 1, 2, ...) is the limit when k models share the GPU;
#  * a mapping from Composition to the limit on a GPU of that composition (`colocation_limits`).
Limits = Mapping[str, "float | Sequence[float] | Mapping[Composition, float]"]


def composition(models: Iterable[str]) -> Composition:
    """The composition of a GPU hosting `models`: (architecture, number of its models), sorted."""
    counts: dict[str, int] = {}
    for m in models:
        arch = model_spec(m).arch
        counts[arch] = counts.get(arch, 0) + 1
    return tuple(sorted(counts.items()))


def format_composition(comp: Composition) -> str:
    return " + ".join(f"{n} {arch}" for arch, n in comp)


def limit_at(limits: Limits, model: str, comp: Composition) -> float:
    """Robot limit of `model` on a GPU of composition `comp` (with limits keyed by the number of
    models, only the composition's model count matters); 0 when the limits do not cover it."""
    lim = limits[model]
    if isinstance(lim, (int, float)):
        return float(lim)
    if isinstance(lim, Mapping):
        return float(lim.get(comp, 0.0))
    k = sum(n for _, n in comp)
    return float(lim[k - 1]) if 1 <= k <= len(lim) else 0.0


def _cost_at(limits: Limits, model: str, comp: Composition | None) -> float:
    """Load of one robot of `model` on a GPU of composition `comp` (None: one no limit covers)."""
    lim = limit_at(limits, model, comp) if comp is not None else 0.0
    return 1.0 / lim if lim > 0 else UNMEASURED_LOAD_PER_ROBOT


def limit_in(limits: Limits, model: str, on: Sequence[str]) -> float:
    """Robot limit of `model` on a GPU hosting the models `on` (itself among them); 0 when the
    limits say nothing about that GPU (more models than measured, or a composition not measured)."""
    if isinstance(limits[model], Mapping):
        return limit_at(limits, model, composition(on))
    return limit_at(limits, model, (("", len(on)),))


def limit_for(limits: Limits, model: str, k: int) -> float:
    """Robot limit of `model` on a GPU shared by k models (composition-keyed limits: k = 1 only,
    the model alone); 0 when unknown."""
    lim = limits[model]
    if isinstance(lim, Mapping):
        if k != 1:
            raise ValueError(f"limits of {model} are keyed by composition, not by the number of models")
        return limit_in(limits, model, [model])
    return limit_in(limits, model, [model] * k)


def _per_robot(limits: Limits, model: str, on: Sequence[str]) -> float:
    lim = limit_in(limits, model, on)
    return 1.0 / lim if lim > 0 else UNMEASURED_LOAD_PER_ROBOT


def colocation_aware(limits: Limits) -> bool:
    return any(isinstance(v, Mapping) or (not isinstance(v, (int, float)) and len(set(v)) > 1) for v in limits.values())


def gpu_load(robots_on_gpu: Mapping[str, int], limits: Limits) -> float:
    """Load of one GPU: sum over its models of robots / limit at the GPU's composition."""
    on = {m: n for m, n in robots_on_gpu.items() if n > 0}
    return sum(n * _per_robot(limits, m, list(on)) for m, n in on.items())


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
    for m in sorted(robots, key=lambda m: -robots[m] * _per_robot(limits, m, [m])):

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
    # Per-composition rows when limits vary with what shares a GPU, or when a GPU could hold more
    # models than a table covers.
    tables = [t for t in (limits[m] for m in robots) if not isinstance(t, (int, float, Mapping))]
    most = max((len(v) for v in on_gpu.values()), default=0)
    aware = colocation_aware({m: limits[m] for m in robots}) or any(len(t) < most for t in tables)
    keyed = any(isinstance(limits[m], Mapping) for m in robots)
    # A model's group: its architecture where limits are keyed by composition, one group ("")
    # where they are keyed by the number of models (a composition is then a model count).
    group = {m: (model_spec(m).arch if keyed else "") for m in robots}
    # GPU g's possible compositions, each with its own load row (one row when limits ignore them);
    # those no limit covers share one catch-all row (None), every robot on it costing
    # UNMEASURED_LOAD_PER_ROBOT, so that the ILP does not grow with compositions it cannot use.
    comps: dict[int, list[Composition | None]] = {}
    for g in range(n_gpus):
        hosted = [pairs[i][0] for i in on_gpu[g]]
        if not aware or not hosted:
            comps[g] = [] if not hosted else [()]
            continue
        caps = {a: sum(1 for m in hosted if group[m] == a) for a in sorted({group[m] for m in hosted})}
        measured: list[Composition | None] = []
        catch_all = False
        for counts in itertools.product(*(range(c + 1) for c in caps.values())):
            comp = tuple((a, k) for a, k in zip(caps, counts, strict=True) if k)
            if not comp:
                continue
            if any(limit_at(limits, m, comp) > 0 for m in hosted if dict(comp).get(group[m])):
                measured.append(comp)
            else:
                catch_all = True
        comps[g] = measured + ([None] if catch_all else [])
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
    iw = {(g, c): var(f"w{g},{c}") for g in range(n_gpus) for c in comps[g] if aware}
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
    for i, (m, _) in enumerate(pairs):  # y <= x <= R y: y says whether robots are placed
        add({ix[i]: 1.0, iy[i]: -robots[m]}, -np.inf, 0.0)
        if aware:  # a model counted on a GPU without robots there would pick a wrong composition
            add({ix[i]: 1.0, iy[i]: -1.0}, 0.0, np.inf)
    for g in range(n_gpus):
        add({iu[g]: 1.0, **{iy[i]: -1.0 for i in on_gpu[g]}}, -np.inf, 0.0)  # u_g <= models on g
        if not on_gpu[g]:
            continue
        if aware:  # exactly one composition is active on a used GPU, and it counts the models there
            for a in sorted({group[pairs[i][0]] for i in on_gpu[g]}):
                counted = {iw[g, cc]: float(dict(cc).get(a, 0)) for cc in comps[g] if cc is not None}
                counted |= {iy[i]: -1.0 for i in on_gpu[g] if group[pairs[i][0]] == a}
                if None in comps[g]:  # the counts may differ only where the catch-all is active
                    add(counted, -np.inf, 0.0)
                    add(counted | {iw[g, None]: float(len(on_gpu[g]))}, 0.0, np.inf)
                else:
                    add(counted, 0.0, 0.0)
            add({iw[g, cc]: 1.0 for cc in comps[g]}, 0.0, 1.0)
        for klass in comps[g]:
            if aware:
                load = {ix[i]: _cost_at(limits, pairs[i][0], klass) for i in on_gpu[g]}
            else:
                load = {ix[i]: _per_robot(limits, pairs[i][0], [pairs[i][0]]) for i in on_gpu[g]}
            big = sum(robots[pairs[i][0]] * v for i, v in zip(on_gpu[g], load.values(), strict=True)) if aware else 0.0
            off = {iw[g, klass]: big} if aware else {}  # the row binds only where w[g,klass] = 1
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
                        **{ix[i]: _per_robot(limits, pairs[i][0], [pairs[i][0]]) for i in on_gpu[g]},
                        **{ix[i]: -_per_robot(limits, pairs[i][0], [pairs[i][0]]) for i in on_gpu[g + 1]},
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
