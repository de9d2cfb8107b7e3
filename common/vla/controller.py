"""The traffic controller: co-location-aware robot limits, the ILP, and a check of every plan.

Robion's management engine (§4.2.2) benchmarks each model's robot limit on one GPU and keeps every
GPU's load within it. Served alone, a SmolVLA-like model meets its SLO for 54 robots; four
variants sharing that GPU meet it for 8 robots in all — each variant batches on its own and a
request waits behind the other variants' locksteps — and what shares the GPU matters as much as
how many: a pi0 batch beside a SmolVLA one is another lockstep than two pi0 batches (the paper
profiles cross-model stage pairs, §4.1.3). So the controller here:

1. measures the limit of every *composition* of a GPU (how many models of each architecture share
   it, up to `max_models_per_gpu` models; the attainment of the *worst* model counts), by
   simulating the lockstep engine with the profile (`colocation_limits`);
2. solves the traffic ILP with those limits (`management.assign_ilp`);
3. simulates each GPU of the plan with its own seeds and judges it by a stated test over the
   draws (`ControllerSettings.acceptance`); when a model on some GPU fails it, lowers the limits
   of that GPU's composition just below the failing load and solves again (at most `max_rounds`
   times). A plan is emitted as within limits only once every GPU passed; otherwise it is flagged.
   With the two-stage rule (`bootstrap`, the default) a plan that passes the cheap screen (100
   draws) is confirmed on fresh draws (1,000, other seeds) before it is accepted: the ILP and the
   search over loads pick the plans the screen's sample flattered (a phase alignment its 100
   draws never showed), and only an independent sample can judge a plan selected that way.

Derating is once per key (a composition) per round, by the worst failing GPU of that key: N
identical GPUs that fail together are one piece of evidence, not N (derating once per failing GPU
cut a limit by the factor to the N-th power). What a plan learns stays with that plan: every
`plan()` starts from the measured limits, so one experiment's failures do not lower the next one's
limits (set `carry_learned_limits` to keep them on purpose). Limits given by model count (L(k),
`ow vla plan --limits`) are derated per (architecture, k) the same way.

GPUs are independent in the simulator (each robot talks to one GPU), so a GPU's check depends only
on what it serves; the simulated draws are cached per GPU load (and may be shared between
controllers that judge them by different rules).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import t as student_t

from common.vla import sim
from common.vla.config import MODELS, model_spec
from common.vla.management import (
    DEFAULT_ILP_TIME_LIMIT_S,
    Composition,
    Limits,
    Placement,
    TrafficAssignment,
    assign_ilp,
    composition,
    format_assignment,
    format_composition,
    gpu_load,
)
from common.vla.profiles import ProfileTable

DERATE_MARGIN = 0.98  # a failing composition's limits drop to 98 % of its load: it no longer fits

# A model's limits: per composition of the GPU (measured), or per number of models sharing it
# (k = 1, 2, ...; given by hand, or one number for every k).
Table = tuple[float, ...] | dict[Composition, float]


@dataclass(frozen=True)
class ControllerSettings:
    target: float = 0.98  # SLO attainment every model must reach in any replay of a plan
    # A plan (and a measured limit) is accepted by a stated test over independent one-epoch draws
    # of robot phases and network delays (see ACCEPTANCE_RULES and docs/vla.md):
    #  * "bootstrap-once": every model must reach `plan_target` in all but a
    #    (1 - confidence) share of `resamples` replays of `replay_epochs` epochs resampled from the
    #    draws, the share split evenly over every (model, GPU) the test covers (Bonferroni: a whole
    #    plan holds in a replay with `confidence`); no normal model, the draws' own tail counts;
    #  * "bootstrap" (default): two stages of that test. The screen (`epochs` draws from `seed`)
    #    rejects cheaply; a plan that passes it is accepted only if it passes again on
    #    `confirm_epochs` fresh draws (seeds from `confirm_seed`), independent of the screen that
    #    selected it. Limits are measured with the screen alone (a limit it flattered is caught,
    #    and derated, at the confirmation of the plan that uses it);
    #  * "prediction": each model's one-sided `confidence` Student-t prediction bound
    #    mean - t * sd * sqrt(1/n + 1/replay_epochs) (one model at a time);
    #  * "worst-draw": each of `check_draws` draws reaches `plan_target` (the first rule, with
    #    a 0.99 margin; with 19 draws of `replay_epochs` epochs at 0.98 it is the exact
    #    order-statistic test: a replay falls below the worst of 19 with probability 1/20).
    plan_target: float = 0.98
    acceptance: str = "bootstrap"
    confidence: float = 0.95
    replay_epochs: int = 20  # the replay the plan must hold in (the bench's: 20 epochs)
    # per check: one-epoch draws (100 so that a phase alignment that costs a few % turns up in the
    # sample), or split over `check_draws` for the worst-draw rule
    epochs: int = 100
    check_draws: int = 3
    resamples: int = 8000  # bootstrap replays per check (enough for a 0.05 / 32 quantile)
    duration_s: float = 10.0
    seed: int = 1000  # apart from the bench's seeds, so that a replay is an independent draw
    # the two-stage rule's confirmation: ten times the screen's draws (an alignment one epoch in
    # 300 shows up in 1,000 draws with 96 % probability, in 100 with 28 %), seeds apart from the
    # screen's and the bench's
    confirm_epochs: int = 1000
    confirm_seed: int = 2000
    max_models_per_gpu: int = 4
    time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S
    max_rounds: int = 6
    cap: int = 128
    # Keep what one plan's failed checks taught for the plans after it (off: every plan starts
    # from the measured limits, so experiments do not depend on the order they ran in).
    carry_learned_limits: bool = False

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, not {self.acceptance!r}")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0.5, 1), not {self.confidence}")
        if self.resamples < 100:
            raise ValueError(f"resamples must be at least 100, not {self.resamples}")
        if self.acceptance == "bootstrap":
            if self.confirm_epochs < 1:
                raise ValueError(f"confirm_epochs must be at least 1, not {self.confirm_epochs}")
            screen = range(self.seed, self.seed + self.epochs)
            confirm = range(self.confirm_seed, self.confirm_seed + self.confirm_epochs)
            if screen.start < confirm.stop and confirm.start < screen.stop:
                raise ValueError(
                    f"the confirmation's seeds {confirm.start}-{confirm.stop - 1} overlap the screen's "
                    f"{screen.start}-{screen.stop - 1}: its draws must be fresh"
                )

    @property
    def two_stage(self) -> bool:
        return self.acceptance == "bootstrap"

    def confirmation(self) -> ControllerSettings:
        """The second stage of the two-stage rule: the same bootstrap test on the fresh draws."""
        return dataclasses.replace(
            self, acceptance="bootstrap-once", epochs=self.confirm_epochs, seed=self.confirm_seed
        )

    def describe(self) -> str:
        """The acceptance rule in words, for reports."""
        if self.acceptance == "bootstrap":
            return (
                f"bootstrap, two stages: a screen of {self.epochs} one-epoch draws (seeds from {self.seed}), then "
                f"{self.confirm_epochs} fresh draws (seeds from {self.confirm_seed}) for a plan that passes it; each "
                f"every model at {self.plan_target:.0%} in {self.confidence:.0%} of {self.resamples} resampled "
                f"{self.replay_epochs}-epoch replays (Bonferroni over the models and GPUs tested together)"
            )
        if self.acceptance == "bootstrap-once":
            return (
                f"bootstrap-once: every model at {self.plan_target:.0%} in {self.confidence:.0%} of {self.resamples} "
                f"resampled {self.replay_epochs}-epoch replays of {self.epochs} one-epoch draws "
                f"(Bonferroni over the models and GPUs tested together)"
            )
        if self.acceptance == "prediction":
            return (
                f"prediction: one-sided {self.confidence:.0%} Student-t bound per model for a "
                f"{self.replay_epochs}-epoch replay from {self.epochs} one-epoch draws at {self.plan_target:.0%}"
            )
        return f"worst-draw: each of {self.check_draws} draws ({self.epochs} epochs in all) at {self.plan_target:.0%}"


ACCEPTANCE_RULES = ("bootstrap", "bootstrap-once", "prediction", "worst-draw")


def prediction_bound(attainments: list[float], replay_epochs: int, confidence: float) -> float:
    """One-sided `confidence` lower prediction bound of a model's SLO attainment in a replay of
    `replay_epochs` epochs, from the attainments of independent one-epoch draws:
    mean - t(confidence, n - 1) * sd * sqrt(1/n + 1/replay_epochs). Epochs, not requests, are
    the independent samples: the requests of one epoch share the robots' phases."""
    n = len(attainments)
    mean = sum(attainments) / n
    if n < 2:
        return mean
    sd = math.sqrt(sum((a - mean) ** 2 for a in attainments) / (n - 1))
    spread = sd * math.sqrt(1.0 / n + 1.0 / max(1, replay_epochs))
    return mean - float(student_t.ppf(confidence, n - 1)) * spread


def bootstrap_bounds(
    met: Mapping[str, list[int]],
    requests: Mapping[str, list[int]],
    replay_epochs: int,
    risk: float,
    resamples: int,
    seed: int,
) -> dict[str, float]:
    """Per model, the `risk` lower quantile of its SLO attainment (requests met / requests) in
    replays of `replay_epochs` epochs drawn with replacement from the independent one-epoch draws
    (`met[m][i]`, `requests[m][i]`: draw i). Every model is resampled with the same epochs, as a
    replay runs them together. Nonparametric: a rare bad epoch weighs as itself, not as a normal
    spread; what the draws never showed it cannot see. The quantile is the order statistic
    floor(risk * resamples) (the lower one), so a bound holds in all but that many replays."""
    models = list(met)
    draws = len(met[models[0]]) if models else 0
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, draws, size=(resamples, max(1, replay_epochs)))
    index = min(resamples - 1, max(0, math.floor(risk * resamples)))
    out = {}
    for m in models:
        got = np.asarray(met[m], dtype=float)[picks].sum(axis=1)
        asked = np.asarray(requests[m], dtype=float)[picks].sum(axis=1)
        attainment = np.divide(got, asked, out=np.ones_like(got), where=asked > 0)
        out[m] = float(np.partition(attainment, index)[index])
    return out


@dataclass(frozen=True)
class GpuCheck:
    gpu: int
    robots: dict[str, int]
    load: float
    per_model: dict[str, float]  # model -> simulated SLO attainment

    @property
    def worst(self) -> float:
        return min(self.per_model.values())


@dataclass(frozen=True)
class ControllerPlan:
    assignment: TrafficAssignment
    checks: tuple[GpuCheck, ...]
    verified: bool  # every GPU passed the simulated check
    rounds: int
    note: str = ""
    # The limits after this plan's derating (model -> L(k) per k) and what lowered them.
    learned: Mapping[str, Table] | None = None
    derated: tuple[str, ...] = ()
    # two-stage rule: `checks` are the confirmation's judgement once a plan got that far, and
    # `screen` the screen's of the same assignment; `confirmed` says the plan passed both
    # (False for a plan asked for without confirmation, or judged by a one-stage rule)
    confirmed: bool = False
    screen: tuple[GpuCheck, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.assignment.feasible and self.verified

    @property
    def counts(self) -> dict[tuple[str, int], int]:
        return self.assignment.counts


# Raw draws of one GPU composition: (robots, max batch, draws, epochs per draw, duration, seed)
# -> one SimResult per draw. Shared by every acceptance rule (they judge the same draws), so
# comparing rules costs no extra simulation.
DrawCache = dict[tuple, list[sim.SimResult]]


def _draw_shape(s: ControllerSettings) -> tuple[int, int]:
    """(draws, epochs per draw): one-epoch draws for the resampling rules, `check_draws` for worst-draw."""
    draws = max(1, s.check_draws if s.acceptance == "worst-draw" else s.epochs)
    return draws, max(1, s.epochs // draws)


def simulate_draws(
    profile: ProfileTable,
    robots: Mapping[str, int],
    max_batch: Mapping[str, int],
    s: ControllerSettings,
    cache: DrawCache | None = None,
) -> list[sim.SimResult]:
    """One GPU serving `robots`, simulated in independent draws of robot phases and network delays
    (seeds from `s.seed`)."""
    draws, per_draw = _draw_shape(s)
    key = (
        tuple(sorted(robots.items())),
        tuple(sorted((m, max_batch[m]) for m in robots)),
        draws,
        per_draw,
        s.duration_s,
        s.seed,
    )
    if cache is not None and key in cache:
        return cache[key]
    results = [
        sim.simulate(
            sim.robion(max_batch=dict(max_batch)),
            sim.Workload(dict(robots), epochs=per_draw, duration_s=s.duration_s, seed=s.seed + d),
            profile,
        )
        for d in range(draws)
    ]
    if cache is not None:
        cache[key] = results
    return results


def judge(results: list[sim.SimResult], s: ControllerSettings, family: int = 0) -> dict[str, float]:
    """Each model's attainment as the acceptance rule judges it (accepted when >= plan_target):
    its bootstrap bound, its t prediction bound, or its worst draw. `family`: how many (model,
    GPU) pairs one decision covers, over which the bootstrap spreads its risk (0: this GPU's
    models)."""
    models = list(results[0].per_model)
    if s.acceptance == "worst-draw":
        return {m: min(r.per_model[m].attainment for r in results) for m in models}
    if s.acceptance == "prediction":
        return {
            m: prediction_bound([r.per_model[m].attainment for r in results], s.replay_epochs, s.confidence)
            for m in models
        }
    risk = (1.0 - s.confidence) / max(1, family or len(models))
    return bootstrap_bounds(
        {m: [r.per_model[m].met for r in results] for m in models},
        {m: [r.per_model[m].requests for r in results] for m in models},
        s.replay_epochs,
        risk,
        s.resamples,
        s.seed,
    )


def check(
    profile: ProfileTable,
    robots: Mapping[str, int],
    max_batch: Mapping[str, int],
    s: ControllerSettings,
    cache: DrawCache | None = None,
) -> sim.SimResult:
    """One GPU serving `robots`, judged by the acceptance rule over independent draws: each model's
    attainment in the result is what the rule accepts or rejects (a composition whose attainment
    swings with the phases, a tight-SLO model beside a slow one, must hold with that confidence,
    not only on average)."""
    results = simulate_draws(profile, robots, max_batch, s, cache)
    bounds = judge(results, s)
    judged: dict[str, sim.ModelStats] = {}
    for m in robots:
        stats = [r.per_model[m] for r in results]
        if s.acceptance == "worst-draw":  # the worst draw itself
            judged[m] = min(stats, key=lambda st: st.attainment)
            continue
        requests = sum(st.requests for st in stats)
        met = max(0, min(requests, math.floor(max(0.0, bounds[m]) * requests + 1e-9)))
        judged[m] = sim.ModelStats(m, requests, met, max(st.p50_ms for st in stats), max(st.p99_ms for st in stats))
    first = results[0]
    return sim.SimResult(
        first.system,
        first.robots,
        sum(w.requests for w in judged.values()),
        sum(w.met for w in judged.values()),
        first.p50_ms,
        max(r.p99_ms for r in results),
        judged,
    )


def compositions(archs: Mapping[str, int], most: int) -> list[Composition]:
    """Every composition of at most `most` models from `archs` (architecture -> variants
    available), by model count, then by name."""
    names = sorted(archs)
    out = []
    for counts in itertools.product(*(range(min(archs[a], most) + 1) for a in names)):
        if 1 <= sum(counts) <= most:
            out.append(tuple((a, n) for a, n in zip(names, counts, strict=True) if n))
    return sorted(out, key=lambda c: (sum(n for _, n in c), c))


def _without_one(comp: Composition) -> list[Composition]:
    """The compositions one model fewer than `comp` (each architecture's model removed in turn)."""
    out = []
    for i, (arch, n) in enumerate(comp):
        rest = list(comp)
        if n > 1:
            rest[i] = (arch, n - 1)
        else:
            del rest[i]
        if rest:
            out.append(tuple(rest))
    return out


def colocation_limits(
    profile: ProfileTable,
    models,
    max_batch: Mapping[str, int] | int = 2,
    settings: ControllerSettings = ControllerSettings(),
    progress: Callable[[str], None] | None = None,
    cache: DrawCache | None = None,
) -> dict[str, dict[Composition, float]]:
    """L_m(c) per model: its robot limit on a GPU of composition c (how many models of each
    architecture share it), for every composition of at most `max_models_per_gpu` models of the
    given models' architectures (the paper profiles cross-model stage pairs, §4.1.3).

    Measured: the most robots in all, N(c), that one GPU serves at `plan_target` for every model
    (the acceptance rule's judgement) with equal robots per model, the models being the first
    variants of each architecture (variants share their architecture's profile). Spread over the
    architectures by what each costs alone: a robot of architecture a costs 1 / L_a alone, so on
    a GPU of composition c with k models, L_a(c) = N(c) * (sum over c's models of 1 / L_b) * L_a / k,
    which puts the measured equal split at a load of exactly 1 (and is N(c) itself for one
    architecture). A limit never rises when a model joins (a measured rise is noise: a GPU with
    more models is not easier); a composition one model more than one serving nobody is not
    measured (it has no limit, and costs UNMEASURED_LOAD_PER_ROBOT in the ILP)."""

    def mb_of(arch: str) -> int:
        if not isinstance(max_batch, Mapping):
            return max_batch
        return next(max_batch[m] for m in models if model_spec(m).arch == arch)

    archs = sorted({model_spec(m).arch for m in models})
    variants = {a: [v.name for v in MODELS.values() if v.arch == a][: settings.max_models_per_gpu] for a in archs}
    totals: dict[Composition, int] = {}
    per_arch: dict[str, dict[Composition, float]] = {a: {} for a in archs}
    for comp in compositions({a: len(v) for a, v in variants.items()}, settings.max_models_per_gpu):
        k = sum(n for _, n in comp)
        fewer = _without_one(comp)
        if any(totals.get(f, 0) == 0 for f in fewer):
            continue
        cap = settings.cap if k == 1 else max(1, min(totals[f] // (k - 1) for f in fewer))
        on = [v for a, n in comp for v in variants[a][:n]]
        mb = {v: mb_of(model_spec(v).arch) for v in on}

        def worst(n: int, on: list[str] = on, mb: dict[str, int] = mb) -> sim.SimResult:
            return check(profile, {v: n for v in on}, mb, settings, cache)

        per, _ = sim.max_robots(worst, settings.plan_target, cap=cap)
        totals[comp] = per * k
        if per == 0:
            continue
        cost = sum(n / totals[((a, 1),)] for a, n in comp)
        for a, _ in comp:
            limit = totals[comp] * cost * totals[((a, 1),)] / k
            for f in fewer:  # never above the same architecture's limit with one model fewer
                if dict(f).get(a):
                    limit = min(limit, per_arch[a][f])
            per_arch[a][comp] = limit
        if progress:
            progress(
                f"co-location limit {format_composition(comp)}: {totals[comp]} robots in all "
                f"({', '.join(f'{a} {per_arch[a][comp]:.1f}' for a, _ in comp)} per robot of that architecture)"
            )
    return {m: dict(per_arch[model_spec(m).arch]) for m in models}


def _table(value, max_models: int) -> Table:
    if isinstance(value, (int, float)):  # co-location-blind: the same limit for any k
        return (float(value),) * max_models
    if isinstance(value, Mapping):
        return {tuple(c): float(v) for c, v in value.items()}
    return tuple(float(x) for x in value)


def _copy(table: Table) -> Table:
    return dict(table) if isinstance(table, dict) else tuple(table)


class TrafficController:
    def __init__(
        self,
        profile: ProfileTable,
        limits: Limits,
        max_batch: Mapping[str, int] | int = 2,
        settings: ControllerSettings = ControllerSettings(),
        cache: DrawCache | None = None,
    ):
        self.profile, self.settings = profile, settings
        self.max_batch = max_batch
        # The measured limits (model -> L(c) per composition, or L(k) per model count); a plan
        # derates a copy of them.
        self.limits: dict[str, Table] = {m: _table(v, settings.max_models_per_gpu) for m, v in limits.items()}
        # raw draws per GPU composition (may be shared with controllers of other rules, same profile)
        self._draws: DrawCache = cache if cache is not None else {}
        self.derated: list[str] = []  # what every plan's checks taught, for the report

    @classmethod
    def calibrate(
        cls,
        profile: ProfileTable,
        models,
        max_batch: Mapping[str, int] | int = 2,
        settings: ControllerSettings = ControllerSettings(),
        progress: Callable[[str], None] | None = None,
        cache: DrawCache | None = None,
    ) -> TrafficController:
        cache = cache if cache is not None else {}
        limits = colocation_limits(profile, models, max_batch, settings, progress, cache)
        return cls(profile, limits, max_batch, settings, cache)

    def _mb(self, m: str) -> int:
        return self.max_batch[m] if isinstance(self.max_batch, Mapping) else self.max_batch

    def check_gpu(self, robots: Mapping[str, int], family: int = 0, confirm: bool = False) -> dict[str, float]:
        """Per-model SLO attainment of one GPU serving `robots` alone, as the acceptance rule judges
        it (`family`: the (model, GPU) pairs the decision covers; 0: this GPU's; `confirm`: the
        two-stage rule's confirmation on its fresh draws instead of the screen). Draws are cached
        by composition."""
        s = self.settings.confirmation() if confirm else self.settings
        on = {m: n for m, n in sorted(robots.items()) if n}
        results = simulate_draws(self.profile, on, {m: self._mb(m) for m in on}, s, self._draws)
        return judge(results, s, family)

    def plan(self, placement: Placement, robots: Mapping[str, int], confirm: bool = True) -> ControllerPlan:
        """The checked assignment of `robots`. With the two-stage rule a plan that passes the screen
        is confirmed on fresh draws (a failed confirmation derates like a failed screen);
        `confirm=False` stops at the screen (a search over loads screens upwards and confirms only
        the plans it would emit, the confirmation costing ten screens)."""
        s = self.settings
        robots = {m: int(n) for m, n in robots.items() if n > 0}
        unknown = [m for m in robots if m not in self.limits]
        if unknown:
            raise ValueError(f"no robot limits for {', '.join(unknown)}")
        learned = {m: _copy(v) for m, v in self.limits.items()}
        derated: list[str] = []

        def result(
            a: TrafficAssignment,
            checks: list[GpuCheck],
            verified: bool,
            rnd: int,
            note: str = "",
            confirmed: bool = False,
            screen: list[GpuCheck] | None = None,
        ):
            if s.carry_learned_limits:
                self.limits = {m: _copy(v) for m, v in learned.items()}
            self.derated.extend(derated)
            frozen = {m: _copy(v) for m, v in learned.items()}
            return ControllerPlan(
                a, tuple(checks), verified, rnd, note, frozen, tuple(derated), confirmed, tuple(screen or ())
            )

        for rnd in range(1, s.max_rounds + 1):
            limits = {m: _copy(v) for m, v in learned.items() if m in robots}
            a = assign_ilp(placement, robots, limits, time_limit_s=s.time_limit_s)
            placed = [a.robots_on(g) for g in range(placement.n_gpus)]
            # the plan holds in a replay when every model on every GPU does: one decision
            family = sum(len(on) for on in placed)
            checks = [
                GpuCheck(g, on, gpu_load(on, limits), self.check_gpu(on, family)) for g, on in enumerate(placed) if on
            ]
            failing = [c for c in checks if c.worst < s.plan_target]
            if not a.feasible:
                return result(a, checks, False, rnd, "the robots exceed the GPUs' limits")
            if not failing and s.two_stage and confirm:
                screened = checks
                checks = [GpuCheck(c.gpu, c.robots, c.load, self.check_gpu(c.robots, family, True)) for c in screened]
                failing = [c for c in checks if c.worst < s.plan_target]
                if not failing:
                    return result(a, checks, True, rnd, confirmed=True, screen=screened)
                # the screen's sample flattered this plan: the fresh draws' evidence derates it
                derated.extend(f"confirmation: {note}" for note in derate(learned, failing))
                continue
            if not failing:
                return result(a, checks, True, rnd)
            derated.extend(derate(learned, failing))
        note = f"a GPU still missed {s.plan_target:.1%} after {s.max_rounds} rounds"
        return result(a, checks, False, s.max_rounds, note)


def _key(c: GpuCheck, limits: Mapping[str, Table]) -> tuple[Any, ...]:
    """What a failing GPU's evidence is about: its composition (limits keyed by composition), or
    its number of models and each of its architectures (limits keyed by model count)."""
    if any(isinstance(limits[m], dict) for m in c.robots):
        return ("composition", composition(c.robots))
    return ("count", len(c.robots))


def derate(limits: dict[str, Table], failing: list[GpuCheck]) -> list[str]:
    """Lower, in place, the limits that let the failing GPUs through, below their loads: each key
    (a composition; with limits keyed by model count, an architecture at a model count) once, by
    the worst (lowest-load) failing GPU of that key, however many GPUs failed with it. Returns
    what was lowered, for the report."""

    factors: dict[tuple[Any, ...], tuple[float, GpuCheck]] = {}
    for c in failing:
        factor = min(c.load, 1.0) * DERATE_MARGIN
        kind, what = _key(c, limits)
        keys: list[tuple[Any, ...]] = [(kind, what)]
        if kind == "count":  # each architecture on it at that model count
            keys = [(kind, what, a) for a in sorted(_archs(c.robots))]
        for key in keys:
            if key not in factors or factor < factors[key][0]:
                factors[key] = (factor, c)
    notes = []
    for key, (factor, c) in sorted(factors.items(), key=lambda kv: str(kv[0])):
        if key[0] == "composition":
            comp = key[1]
            for table in limits.values():
                if isinstance(table, dict) and comp in table:
                    table[comp] *= factor
            alike = [f for f in failing if _key(f, limits) == key]
            what = f"limits on {format_composition(comp)}"
        else:
            k, arch = key[1], key[2]
            for m, table in limits.items():
                if model_spec(m).arch == arch and not isinstance(table, dict) and k <= len(table):
                    limits[m] = tuple(v * factor if i == k - 1 else v for i, v in enumerate(table))
            alike = [f for f in failing if len(f.robots) == k and arch in _archs(f.robots)]
            what = f"limits of {arch} with {k} models"
        notes.append(
            f"GPU {c.gpu} {dict(c.robots)} (load {c.load:.2f}) reached {c.worst:.1%}"
            + (f" (worst of {len(alike)} failing GPUs)" if len(alike) > 1 else "")
            + f": {what} x {factor:.2f}"
        )
    return notes


def _archs(models) -> set[str]:
    return {model_spec(m).arch for m in models}


def format_limits(limits: Mapping[str, Table]) -> dict[str, dict[str, float] | list[float]]:
    """Limits as JSON: per model, composition ("1 pi0 + 1 smolvla") -> limit, or the list per k."""
    return {
        m: {format_composition(c): round(v, 3) for c, v in t.items()} if isinstance(t, dict) else list(t)
        for m, t in limits.items()
    }


def format_plan(plan: ControllerPlan, placement: Placement) -> str:
    lines = [format_assignment(plan.assignment, placement)]
    for c in plan.checks:
        lines.append(f"  GPU {c.gpu} simulated: " + ", ".join(f"{m} {v:.1%}" for m, v in c.per_model.items()))
    verdict = "every model meets the check" if plan.verified else f"NOT verified: {plan.note}"
    if plan.confirmed:
        verdict += " (screen and confirmation on fresh draws)"
    lines.append(f"  controller: {verdict} (round {plan.rounds})")
    return "\n".join(lines)


PLAN_FORMAT = "orbitweaver.vla.plan/1"


def write_plan(path, plan: ControllerPlan, placement: Placement, robots: Mapping[str, int], profile: str) -> None:
    """The plan file `ow vla serve --plan` and `ow vla cluster --plan` run (format in docs/vla.md)."""

    doc = {
        "format": PLAN_FORMAT,
        "profile": profile,
        "placement": placement.name,
        "n_gpus": placement.n_gpus,
        "robots": dict(robots),
        "gpus": [
            {"gpu": g, "robots": plan.assignment.robots_on(g)}
            for g in range(placement.n_gpus)
            if plan.assignment.robots_on(g)
        ],
        "within_limits": plan.assignment.feasible,
        "checked": plan.verified,
        "optimal": plan.assignment.optimal,
        "note": plan.note or plan.assignment.note,
        "checks": {str(c.gpu): c.per_model for c in plan.checks},
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def read_plan(path) -> dict[int, dict[str, int]]:
    """GPU -> {model: robots} from a plan file, validated."""

    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ValueError(
            f"{path}: not a VLA plan (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
            f"expected {PLAN_FORMAT!r})"
        )
    gpus: dict[int, dict[str, int]] = {}
    for entry in doc.get("gpus", []):
        g, on = int(entry["gpu"]), {str(m): int(n) for m, n in entry["robots"].items()}
        bad = [m for m in on if m not in MODELS]
        if bad or any(n < 0 for n in on.values()) or g in gpus:
            raise ValueError(f"{path}: bad GPU entry {entry!r}")
        gpus[g] = on
    if not gpus:
        raise ValueError(f"{path}: the plan places no robots")
    return gpus
