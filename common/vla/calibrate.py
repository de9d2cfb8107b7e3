"""Calibrate the derived GPU profile to the paper's own anchor, as a band over what it leaves open.

The derived profiles (analytic.py) have one parameter no public number fixes: the deadline. The
paper's robots run the models on board (Jetson AGX Thor) and the edge server must beat that
latency; the Thor latency of these models is not public, so the SLO is `factor x (batch-1 VLM +
ADiT + network round trip)` on the server. At the shipped 2.5 a simulated RTX PRO 6000 serves 13
pi0 robots where the paper states **18 pi0 robots on one GPU at 98 % with a max batch of 2** (its
single-GPU figure). That statement is the anchor: for each setting of the model's unpinned
parameters the factor is fitted so that the simulated GPU serves exactly 18 (`fit_slo_factor`),
and the experiments then run at that factor.

The parameters the paper does not pin down, and the values tried (`GRID`):

* `kernel_us`, the per-kernel floor: paper §6 says VLA kernels run 8-10 us each -> 8, 9, 10.
* `corun_slowdown`, how much a VLM and an ADiT slow each other while they share the GPU's DRAM
  and L2: not measured anywhere public -> 0, 5, 10 %.

(`efficiency` is fixed by the pi0 paper's RTX 4090 breakdown, analytic.calibration.) Every
headline is reported over this grid (and the bench's seeds) as a band, never as its best point.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.vla import sim
from common.vla.analytic import SHIPPED, AnalyticParams, derive_profile
from common.vla.profiles import ProfileTable

#: The paper's single-GPU statement the factor is fitted to.
ANCHOR_MODEL = "pi0"
ANCHOR_ROBOTS = 18
ANCHOR_MAX_BATCH = 2
ANCHOR_TARGET = 0.98
#: the unpinned parameters' values (see the module's docstring for their sources)
GRID: tuple[AnalyticParams, ...] = tuple(
    SHIPPED.with_(kernel_us=k, corun_slowdown=c) for k in (8.0, 9.0, 10.0) for c in (0.0, 0.05, 0.10)
)
FACTOR_RANGE = (1.5, 8.0)
FACTOR_TOLERANCE = 0.02


@dataclass(frozen=True)
class CalibrationSettings:
    epochs: int = 20
    duration_s: float = 10.0
    seeds: tuple[int, ...] = (0, 1, 2)


@dataclass
class Fit:
    params: AnalyticParams
    factor: float  # the smallest factor at which the GPU serves at least the anchor's robots
    factor_low: float  # the same (bisection's bound)
    factor_high: float  # smallest factor at which it serves more than the anchor (may equal it)
    robots_at_factor: list[int] = field(default_factory=list)  # per seed, at `factor`

    def profile(self, gpu_key: str = "rtx-pro-6000") -> ProfileTable:
        return derive_profile(gpu_key, params=self.params.with_(slo_factor=self.factor))


def anchor_robots(profile: ProfileTable, s: CalibrationSettings) -> list[int]:
    """Per seed, the most pi0 robots one GPU serves at the anchor's target and max batch."""

    out = []
    for seed in s.seeds:

        def run(n: int, seed: int = seed) -> sim.SimResult:
            workload = sim.Workload({ANCHOR_MODEL: n}, epochs=s.epochs, duration_s=s.duration_s, seed=seed)
            return sim.simulate(sim.robion(max_batch=ANCHOR_MAX_BATCH), workload, profile)

        out.append(sim.max_robots(run, ANCHOR_TARGET, cap=64)[0])
    return out


def fit_slo_factor(
    params: AnalyticParams,
    s: CalibrationSettings = CalibrationSettings(),
    gpu_key: str = "rtx-pro-6000",
    progress: Callable[[str], None] | None = None,
) -> Fit:
    """The SLO factor at which the simulated GPU serves the anchor's robots (the median over the
    seeds): bisection for the smallest factor reaching ANCHOR_ROBOTS, and the smallest reaching
    one more for the report (more robots with a longer deadline: the count does not fall as the
    factor grows, up to the seeds' noise, which the median smooths)."""

    def robots(factor: float) -> int:
        return int(statistics.median(anchor_robots(derive_profile(gpu_key, params=params.with_(slo_factor=factor)), s)))

    def smallest_reaching(target: int) -> float:
        lo, hi = FACTOR_RANGE
        if robots(hi) < target:
            raise ValueError(f"even a factor of {hi} serves fewer than {target} {ANCHOR_MODEL} robots with {params}")
        while hi - lo > FACTOR_TOLERANCE:
            mid = 0.5 * (lo + hi)
            if robots(mid) >= target:
                hi = mid
            else:
                lo = mid
        return hi

    low = smallest_reaching(ANCHOR_ROBOTS)
    high = smallest_reaching(ANCHOR_ROBOTS + 1)
    # The count rises in steps (a batch of two more fits once the deadline allows it): it may
    # go from 17 straight to 19, so no factor gives exactly 18. The fit is the smallest factor
    # that serves at least the anchor, the paper's statement read as "18 robots meet 98 %"; what
    # the GPU serves there is reported beside it.
    factor = round(low, 3)
    fit = Fit(params, factor, round(low, 3), round(high, 3))
    fit.robots_at_factor = anchor_robots(fit.profile(gpu_key), s)
    if progress:
        progress(
            f"kernel {params.kernel_us:g} us, co-run slowdown {params.corun_slowdown:.0%}: SLO factor "
            f"{fit.factor:g} (the smallest serving {ANCHOR_ROBOTS}; more from {fit.factor_high:g}); "
            f"{ANCHOR_MODEL} robots at it per seed {fit.robots_at_factor}"
        )
    return fit


def fit_grid(
    grid: Sequence[AnalyticParams] = GRID,
    s: CalibrationSettings = CalibrationSettings(),
    gpu_key: str = "rtx-pro-6000",
    progress: Callable[[str], None] | None = None,
) -> list[Fit]:
    return [fit_slo_factor(p, s, gpu_key, progress) for p in grid]
