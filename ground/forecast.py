"""Completion forecast for the tasks queued on and running on the payload (docs/ground.md,
"Completion forecast").

Inputs, all downlinked by the payload (docs/wire-protocol.md, PAYLOAD_PROFILE and
WINDOW_HISTORY) and kept in `<state>/forecast-basis.json` by `GroundState.note_forecast_packet`:

* the profile: model, policy, cadence, the seconds per durable unit of each phase its own process
  measured, the units of each phase of its last task, and the overhead of a power-up (power-up
  to the first unit of work: boot, restore);
* the window history: when each power window started (payload clock, Unix seconds) and how long
  each ended one lasted;
* the running task's progress (phase, done, total) from the last HOUSEKEEPING or PROGRESS.

Method: a Monte Carlo over futures of power windows. Each draw continues the current window
(its length drawn from those lived through that outlasted its age) and then strings together
blocks of consecutive (window, gap) pairs of the history, resampled whole (a block bootstrap keeps
an orbit's pattern of long and short gaps); each length is jittered and, while the history is
short, a long gap the history has not shown may be drawn (the prior), so that a few windows of
history do not make a confident forecast. The queue's remaining units are walked across each
draw's windows by `common.sim.windows.finish_times` (boot and recovery per power-up, the unit in
flight at a cut lost unless the bus announced the cut: each drawn cut is announced with the share
of announced cuts the ground heard). Periods the payload is known to be off (`known_off`: a
contact plan) cut the drawn windows, and the history's gaps they explain are not drawn again.
Where the history shows an orbital pattern (`orbit_period`: its duty cycle correlates with itself
one period later; or the period is given), the windows to come are drawn from the history at the
same orbital phase (`_phase_windows`); where it does not, the history is resampled without phase
and the forecast says why ("window_model"). Each draw also scales the profile's pace by a
log-normal factor (UNIT_SIGMA: the unit model's own spread). The 10th, 50th and 90th percentiles
over draws are widened around the median by BAND_WIDEN; both fitted on training traces only
(bench/forecast_bench.py).

A forecast is refused, with the reason, where it cannot be made: no profile yet, no window
history, a task whose model or phase sizes are unknown. It never guesses silently.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

from common.sim.windows import finish_times

PHASES = ("vision", "prefill", "decode")
#: States of a task that no longer waits for the payload.
FINAL_STATES = frozenset({"completed", "failed", "rejected", "cancelled", "lost"})
#: Consecutive history pairs resampled together.
BLOCK_PAIRS = 3
#: Log-normal jitter of each resampled window and gap: SIGMA_FLOOR with a long history, growing as
#: SIGMA_SHORT / sqrt(pairs) when it is short (calibrated on training traces: trace-a, sat2-like).
SIGMA_FLOOR = 0.15
SIGMA_SHORT = 0.9
#: Chance per drawn gap of a long gap the history has not shown (eclipse, thermal recovery, FDIR
#: hold-off): PRIOR_LONG_GAP / (pairs + 1), its length LONG_GAP_FACTOR_RANGE x the longest window
#: or gap seen.
PRIOR_LONG_GAP = 0.5
LONG_GAP_FACTOR_RANGE = (1.0, 6.0)
#: The band's width: the draws' 10-90 band is widened around the median by BAND_WIDEN, and each
#: draw scales the profile's pace (seconds per unit, power-up overhead) by a log-normal factor of
#: sigma UNIT_SIGMA (the unit model's own error, which the windows' spread does not hold: a task
#: that ends inside the current window otherwise gets a band of zero width). Fitted together on
#: the training kinds only (trace-a, sat2-like): the window model's seeds 1 and 2 (772 forecasts)
#: and the real runs of those kinds (seed 101, 302 forecasts). Of UNIT_SIGMA 0.025/0.05/0.075/0.1
#: and BAND_WIDEN 1.0-1.5 in steps of 0.1, the pair that put at least 80 % of completions inside
#: the band in both sets with the fewest inside over both (the narrowest calibrated band): 0.025
#: and 1.3 (89 % and 81 %; 0.05 and 1.2: 92 % and 80 %). Before: 1.5 (fitted before the pace
#: spread and the phase model) and 0.05 (set from real trace-b runs), 94-100 % inside where the
#: windows are regular (bench/forecast_bench.py; docs/ground.md, "Measured accuracy").
BAND_WIDEN = 1.3
UNIT_SIGMA = 0.025
#: Orbital phase (`orbit_period`). Periods looked for in the window history (LEO: 88-127 min, with
#: a margin); a period is taken only where the history's duty cycle correlates with itself one
#: period later at least this much (an orbit's eclipse or warming structure repeats; FDIR does not).
PERIOD_RANGE_S = (80 * 60.0, 130 * 60.0)
PERIOD_MIN_CORRELATION = 0.3
#: ... and PERIOD_Z / sqrt(independent stretches compared): a smoothed series correlates by chance
#: over a short overlap (FDIR-only histories reached 0.5-0.7 over half an orbit).
PERIOD_Z = 2.0
#: History needed, in periods (the correlation then compares at least half an orbit).
PERIOD_MIN_ORBITS = 1.5
#: The period search's step and the span its duty cycle is averaged over (seconds).
PERIOD_STEP_S = 60.0
PERIOD_SMOOTH_S = 600.0
#: Same phase: history events within this share of the period of now's phase (either side), or
#: the PHASE_MIN_CHOICES nearest where fewer are that close.
PHASE_BAND = 1.0 / 24.0
PHASE_MIN_CHOICES = 3
#: Phase bins per orbit of the lookup of same-phase history cuts (about a minute each).
PHASE_BINS = 96
#: A history gap is taken as caused by known off periods (a contact plan's passes) where they
#: cover at least this share of it: the main cause. Any overlap was enough before, and an eclipse
#: with a pass inside it then left the history as a short gap, so the draws lost the eclipses.
EXPLAINED_SHARE = 0.5
#: Window models: "phase" (resampled at the same orbital phase where a period is known or found,
#: else as "history", saying why) and "history" (resampled without regard to phase).
WINDOW_MODELS = ("phase", "history")


def forecast_profile(msg: Any) -> dict:
    """A PAYLOAD_PROFILE as the forecast basis keeps it."""
    return {
        "model": msg.model,
        "policy": msg.policy,
        "cadence": msg.cadence,
        "unit_s": dict(msg.unit_s),
        "task_units": dict(msg.task_units),
        "durable_every": dict(msg.durable_every),
        "decode_tokens": msg.decode_tokens,
        "overhead_s": msg.overhead_s,
        "setup_s": msg.setup_s,
    }


class ForecastUnavailable(Exception):
    """Why no forecast can be made (said to the operator, never replaced by a guess)."""


def _history(basis: dict) -> tuple[list[tuple[float, float]], float, float | None]:
    """((length, gap) pairs, start of the newest window, its length if it has ended)."""
    wh = basis.get("windows")
    if not wh or not wh.get("starts"):
        raise ForecastUnavailable("no window history from the payload yet (it is sent at each power-on)")
    starts = [float(s) for s in wh["starts"]]
    lengths = [float(x) for x in wh.get("lengths", [])]
    # lengths are of the windows that ended, oldest first; the newest start is the current window's
    # unless the payload reported its length too.
    ended = lengths[-len(starts) :] if len(lengths) >= len(starts) else lengths
    pairs = []
    for i in range(min(len(ended), len(starts) - 1)):
        gap = starts[i + 1] - (starts[i] + ended[i])
        pairs.append((ended[i], max(0.0, gap)))
    last_len = ended[len(starts) - 1] if len(ended) >= len(starts) else None
    return pairs, starts[-1], last_len


def _unit_list(
    profile: dict, phase: str | None, done: int, total: int | None, max_new_tokens: int | None
) -> list[tuple[float, int]]:
    """The task's work still to do as durable units: (seconds, PROGRESS steps in it), the first
    its setup (steps 0)."""
    rates = profile.get("unit_s") or {}
    units_of = profile.get("task_units") or {}
    out: list[tuple[float, int]] = []
    started = phase is None
    for name in PHASES:
        rate = rates.get(name)
        n = units_of.get(name)
        if name == "decode" and max_new_tokens and profile.get("decode_tokens"):
            # decode units scale with the answer length asked for
            n = math.ceil((n or 0) * max_new_tokens / profile["decode_tokens"]) if n else None
        if not started:
            if name != phase:
                continue
            started = True
            n, first = (total if total is not None else n), done
        else:
            first = 0
        if rate is None or rate <= 0 or n is None:
            raise ForecastUnavailable(f"the payload's profile has no measured {name} rate or size yet")
        every = max(1, int((profile.get("durable_every") or {}).get(name, 1)))
        if profile.get("cadence") == "adaptive":
            every = 1  # the adaptive cadence adds early records before a likely cut
        left = max(0, n - first)
        while left > 0:
            k = min(every, left)
            out.append((k * float(rate), k))
            left -= k
    # The payload measures a task's setup from its start to the end of its first unit
    # (flight/runtime/profile.py), so that unit is in the setup already; a task under way has
    # had its setup (a restart's is in the power-up overhead).
    setup = 0.0
    if phase is None:
        first_rate = next((float(rates[p]) for p in PHASES if (units_of.get(p) or 0) > 0 and rates.get(p)), 0.0)
        setup = max(0.0, float(profile.get("setup_s", 0.0)) - first_rate)
    out.insert(0, (setup, 0))
    return out


def _typical_unit(profile: dict) -> float:
    """Seconds of a typical unit: the median over a task's units (each phase's rate, weighted
    by its units)."""
    rates = profile.get("unit_s") or {}
    units_of = profile.get("task_units") or {}
    weighted = sorted((float(rates[p]), int(units_of.get(p) or 0)) for p in PHASES if rates.get(p))
    total = sum(n for _, n in weighted)
    if not weighted or total <= 0:
        return 0.0
    seen = 0
    for rate, n in weighted:
        seen += n
        if seen >= total / 2:
            return rate
    return weighted[-1][0]


def power_up_overhead(profile: dict) -> float:
    """A power-up's cost before the walk's next unit: the payload measures its overhead from
    the process start to the end of the first unit of work (boot work, restore and that unit),
    so a typical unit comes off it."""
    return max(0.0, float(profile.get("overhead_s", 0.0)) - _typical_unit(profile))


def _windows(
    rng: random.Random,
    pairs: Sequence[tuple[float, float]],
    t_heard: float,
    current_start: float,
    current_len: float | None,
    plan: Sequence[tuple[float, ...]] | None,
    plan_scale: float,
) -> Iterator[tuple[float, float]]:
    if plan is not None:
        for window in plan:  # (start, end) or (start, end, the cut announced)
            start, end = window[0] * plan_scale, window[1] * plan_scale
            if end > t_heard:
                yield (max(start, t_heard), end, *window[2:])  # type: ignore[misc]
        return
    n = len(pairs)
    lengths = [a for a, _ in pairs]
    longest = max(max(a, b) for a, b in pairs)
    sigma = max(SIGMA_FLOOR, SIGMA_SHORT / math.sqrt(n))
    p_long = PRIOR_LONG_GAP / (n + 1)

    def jitter(x: float) -> float:
        return x * math.exp(rng.gauss(0.0, sigma))

    age = t_heard - current_start
    if current_len is None:
        older = [w for w in lengths if w > age]
        if older:
            length = rng.choice(older)
        else:  # outlived every window seen: memoryless, at the mean window
            length = age + rng.expovariate(1.0 / max(1e-6, statistics.fmean(lengths)))
        end = current_start + max(length, age)
        yield t_heard, end
    else:
        end = current_start + current_len
    while True:
        i = rng.randrange(n)
        for j in range(BLOCK_PAIRS):
            on, off = pairs[(i + j) % n]
            gap = jitter(off)
            if rng.random() < p_long:
                gap = max(gap, longest * rng.uniform(*LONG_GAP_FACTOR_RANGE))
            start = end + gap
            end = start + jitter(on)
            yield start, end


def _on_periods(basis: dict, t_end: float) -> list[tuple[float, float]]:
    """The history's power windows as (start, end), the current one open until `t_end`."""
    wh = basis.get("windows") or {}
    starts = [float(s) for s in wh.get("starts") or []]
    lengths = [float(x) for x in wh.get("lengths") or []]
    ended = lengths[-len(starts) :] if len(lengths) >= len(starts) else lengths
    out = []
    for i, start in enumerate(starts):
        end = start + ended[i] if i < len(ended) else max(start, t_end)
        out.append((start, min(end, t_end)))
    return out


def _duty_series(on: Sequence[tuple[float, float]], t0: float, step: float, bins: int) -> list[float]:
    """The share of each `step`-second bin from `t0` the payload was on (`on` sorted)."""
    out = [0.0] * bins
    for a, b in on:
        k = max(0, int((a - t0) // step))
        while k < bins and t0 + k * step < b:
            lo, hi = max(a, t0 + k * step), min(b, t0 + (k + 1) * step)
            if hi > lo:
                out[k] += (hi - lo) / step
            k += 1
    return out


def _correlation(xs: Sequence[float], lag: int) -> float:
    """Pearson correlation of the series with itself `lag` bins later (over their overlap)."""
    a, b = xs[: len(xs) - lag], xs[lag:]
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((x - mb) ** 2 for x in b)
    if va <= 0 or vb <= 0:
        return 0.0
    return sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / math.sqrt(va * vb)


def orbit_period(
    on: Sequence[tuple[float, float]], t_end: float, given: float | None = None
) -> tuple[float | None, str]:
    """(the orbit's period in seconds, how it was found) from the power windows the payload lived
    through up to `t_end`, or (None, why not). The power state is averaged over PERIOD_SMOOTH_S
    (an orbit's pattern is one of minutes: eclipse, a structure warming; a thermal cycle of a
    minute or two and FDIR resets are not) and the period is the lag in PERIOD_RANGE_S where that
    duty cycle is most like itself (Pearson correlation over the overlap, a parabola through the
    best step's neighbours), taken where the history spans PERIOD_MIN_ORBITS such lags and the
    correlation is unlikely by chance (PERIOD_MIN_CORRELATION, PERIOD_Z). `given`: the period is
    known (an orbit determination); only whether the history repeats at it is checked, by the
    same rule (a history that does not, FDIR alone, is better resampled whole)."""
    if not on:
        return None, "no window history"
    t0, t1 = on[0][0], max(t_end, on[-1][1])
    span = t1 - t0
    low, high = PERIOD_RANGE_S if given is None else (given, given)
    high = min(high, span / PERIOD_MIN_ORBITS)
    if high < low:
        return None, (
            f"the window history spans {span / 60:.0f} min; an orbital pattern takes "
            f"{PERIOD_MIN_ORBITS:g} orbits ({PERIOD_MIN_ORBITS * low / 60:.0f} min or more) to show"
        )
    step = PERIOD_STEP_S if given is None else given / max(1, round(given / PERIOD_STEP_S))
    raw = _duty_series(on, t0, step, int(span // step))
    width = max(1, round(PERIOD_SMOOTH_S / step))
    sums = [0.0, *itertools.accumulate(raw)]
    smooth = [(sums[k + width] - sums[k]) / width for k in range(len(raw) - width + 1)]
    lags = range(int(math.ceil(low / step - 1e-9)), int(high / step + 1e-9) + 1)
    scores = {lag: _correlation(smooth, lag) for lag in lags if lag < len(smooth) - 1}
    if not scores:
        return None, "the window history is too short to show an orbital pattern"
    best = max(scores, key=lambda lag: scores[lag])
    score = scores[best]
    # a correlation over few independent stretches (overlap / smoothing span) is likely by chance
    independent = (span - best * step) / PERIOD_SMOOTH_S
    needed = max(PERIOD_MIN_CORRELATION, PERIOD_Z / math.sqrt(max(1.0, independent)))
    where = f"{low / 60:.0f}-{high / 60:.0f} min" if given is None else f"the given {given / 60:.1f} min"
    if score < needed:
        return None, (
            f"no orbital pattern in the window history (its duty cycle's correlation with itself one period "
            f"later at most {score:.2f} for periods of {where}; {needed:.2f} needed)"
        )
    if given is not None:
        return given, f"the window history repeats at it (correlation {score:.2f})"
    left, right = scores.get(best - 1), scores.get(best + 1)
    shift = 0.0
    if left is not None and right is not None and left + right - 2 * score < 0:
        shift = 0.5 * (left - right) / (left + right - 2 * score)
    return (best + shift) * step, f"found in the window history (correlation {score:.2f})"


def _phase_distance(a: float, b: float, period: float) -> float:
    d = (a - b) % period
    return min(d, period - d)


def _same_phase(times: Sequence[float], period: float, at: float) -> list[int]:
    """Indices of `times` at the orbital phase of `at`: within PHASE_BAND of the period, or the
    PHASE_MIN_CHOICES nearest."""
    order = sorted(range(len(times)), key=lambda i: _phase_distance(times[i], at, period))
    near = [i for i in order if _phase_distance(times[i], at, period) <= PHASE_BAND * period]
    return near if len(near) >= PHASE_MIN_CHOICES else order[:PHASE_MIN_CHOICES]


def _phase_choices(
    pairs: Sequence[tuple[float, float]],
    starts: Sequence[float],
    period: float,
    t_heard: float,
    current_start: float,
) -> tuple[list[list[int]], list[float]]:
    """What `_phase_windows` draws from, computed once per forecast: for each phase bin the
    history's cuts at that phase (each followed by a window the history knows), and the lengths
    of the windows that started at the current window's phase and outlasted its age."""
    n = len(pairs)
    follow = list(range(n - 1)) or [0]
    ends = [starts[i] + pairs[i][0] for i in follow]
    by_bin = [
        [follow[k] for k in _same_phase(ends, period, (b + 0.5) * period / PHASE_BINS)] for b in range(PHASE_BINS)
    ]
    age = t_heard - current_start
    older = [i for i in range(n) if pairs[i][0] > age]
    current = [pairs[older[k]][0] for k in _same_phase([starts[i] for i in older], period, current_start)]
    return by_bin, current


def _phase_windows(
    rng: random.Random,
    pairs: Sequence[tuple[float, float]],
    period: float,
    choices: tuple[list[list[int]], list[float]],
    t_heard: float,
    current_start: float,
    current_len: float | None,
) -> Iterator[tuple[float, float]]:
    """Windows to come, drawn from the history at the same orbital phase: the current window's
    length from those that started at its phase and outlasted its age; then, at each drawn cut,
    a history cut at the same phase is picked and the gap after it and the windows and gaps that
    followed it are taken (BLOCK_PAIRS of them, then a new pick at the phase reached). The
    prior long gap as in `_windows`; the jitter's rule too, but counting the history cuts at the
    phase the pick chose among (those are what the draw learns from: a few orbits of history
    give a few per phase, and a wide band)."""
    n = len(pairs)
    by_bin, current = choices
    longest = max(max(a, b) for a, b in pairs)
    sigmas = [max(SIGMA_FLOOR, SIGMA_SHORT / math.sqrt(len(near))) for near in by_bin]
    p_long = PRIOR_LONG_GAP / (n + 1)

    age = t_heard - current_start
    if current_len is None:
        if current:
            length = rng.choice(current)
        else:  # outlived every window seen: memoryless, at the mean window
            length = age + rng.expovariate(1.0 / max(1e-6, statistics.fmean(on for on, _ in pairs)))
        end = current_start + max(length, age)
        yield t_heard, end
    else:
        end = current_start + current_len
    while True:
        at = int((end % period) / period * PHASE_BINS) % PHASE_BINS
        i, sigma = rng.choice(by_bin[at]), sigmas[at]
        for j in range(BLOCK_PAIRS):
            if j and i + j + 1 >= n:
                break  # the history ends here: pick again at the phase reached
            gap = pairs[i + j][1] * math.exp(rng.gauss(0.0, sigma))
            if rng.random() < p_long:
                gap = max(gap, longest * rng.uniform(*LONG_GAP_FACTOR_RANGE))
            start = end + gap
            end = start + pairs[min(i + j + 1, n - 1)][0] * math.exp(rng.gauss(0.0, sigma))
            yield start, end


def _outside(
    windows: Iterator[tuple[float, float]], off: Sequence[tuple[float, float]]
) -> Iterator[tuple[float, float]]:
    """The drawn windows with the periods the payload is known to be off taken out (a window
    that meets one ends at its start; what is left after it is a new power-up)."""
    off = sorted(off)
    for start, end in windows:
        for a, b in off:
            if b <= start or a >= end:
                continue
            if a > start:
                yield start, a
            start = b
            if start >= end:
                break
        if start < end:
            yield start, end


def _covered(a: float, b: float, off: Sequence[tuple[float, float]]) -> float:
    """Seconds of [a, b] inside the union of the `off` periods."""
    total, reach = 0.0, a
    for x, y in sorted(off):
        lo, hi = max(x, reach), min(y, b)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def _unexplained(
    pairs: list[tuple[float, float]], starts: Sequence[float], off: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The history with each gap that known off periods explain replaced by the median of the
    others: those come again where the plan says, not as random gaps. A gap is explained where
    the known off periods cover at least EXPLAINED_SHARE of it; one they only overlap (a pass
    inside an eclipse) had another cause, which comes again, and is kept."""
    explained = []
    for i, (on, gap) in enumerate(pairs):
        a, b = starts[i] + on, starts[i] + on + gap
        explained.append(gap > 0 and _covered(a, b, off) >= EXPLAINED_SHARE * gap)
    free = [gap for (_, gap), e in zip(pairs, explained, strict=True) if not e]
    if not free or not any(explained):
        return pairs
    typical = statistics.median(free)
    return [(on, typical if e else gap) for (on, gap), e in zip(pairs, explained, strict=True)]


def _warned_share(basis: dict) -> float:
    """The share of the cuts heard that the bus announced (SHUTDOWN_WARNING before the cut)."""
    cuts = basis.get("cuts") or {}
    heard = int(cuts.get("heard") or 0)
    return min(1.0, int(cuts.get("warned") or 0) / heard) if heard > 0 else 0.0


def _announced(
    rng: random.Random, windows: Iterator[tuple[float, float]], share: float
) -> Iterator[tuple[float, float, bool]]:
    """Each drawn window's cut announced with the chance the history shows."""
    for start, end in windows:
        yield start, end, rng.random() < share


def _order(tasks: Sequence[dict], current: str | None) -> list[dict]:
    """Open tasks in the order the payload serves them: the running one, then by priority
    (higher first), ties by arrival."""
    open_tasks = [t for t in tasks if t.get("state") not in FINAL_STATES]
    open_tasks.sort(key=lambda t: (t.get("task_id") != current, -int(t.get("priority", 0) or 0), t.get("created", "")))
    return open_tasks


def _window_model(
    basis: dict, window_model: str, orbit_period_s: float | None, t_heard: float
) -> tuple[dict[str, Any], float | None]:
    """({"kind", and "period_s", "period_from" or "why"}, the period to resample at or None)."""
    if window_model == "history":
        return {"kind": "history", "why": "asked for"}, None
    if orbit_period_s is not None:
        period, how = orbit_period(_on_periods(basis, t_heard), t_heard, given=orbit_period_s)
        if period is None:
            return {"kind": "history", "why": how}, None
        return {"kind": "phase", "period_s": orbit_period_s, "period_from": f"given; {how}"}, orbit_period_s
    period, how = orbit_period(_on_periods(basis, t_heard), t_heard)
    if period is None:
        return {"kind": "history", "why": how}, None
    return {"kind": "phase", "period_s": period, "period_from": how}, period


def forecast_tasks(
    tasks: Sequence[dict],
    basis: dict,
    *,
    plan: Sequence[tuple[float, ...]] | None = None,
    plan_scale: float = 1.0,
    known_off: Sequence[tuple[float, float]] = (),
    now_wall: float | None = None,
    draws: int = 400,
    seed: int = 0,
    window_model: str = "phase",
    orbit_period_s: float | None = None,
    unit_sigma: float = UNIT_SIGMA,
    band_widen: float = BAND_WIDEN,
) -> dict[str, Any]:
    """{"made_at", "tasks": {task_id: forecast}} or {"unavailable": reason}.

    A task's forecast: "expected" (median completion, Unix seconds), "p10"/"p90" (the widened band),
    "windows" (median power-ups still to come before it completes), "remaining_s", "position".
    `plan`: (start, end) windows in plan seconds (a trace's windows) times `plan_scale` giving Unix
    seconds, used instead of the history's resampling (the band then only holds what the plan
    leaves uncertain: none).
    `window_model`: "phase" resamples the history at the orbital phase of each drawn moment, the
    period `orbit_period_s` where given (an orbit determination), else found in the history
    (`orbit_period`); where neither gives one it resamples without phase and says why under
    "window_model". "history": without phase (the model before orbital phase was an input).
    `unit_sigma`: the log-normal spread of the profile's pace (units and power-up overhead), drawn
    once per draw (not with a plan); 0 gives the forecast before that spread was an input.
    `band_widen`: the factor the draws' 10-90 band is widened by around the median (`widen_band`);
    1.0 gives the draws' own percentiles (the benchmark's refit of BAND_WIDEN starts from those)."""
    if window_model not in WINDOW_MODELS:
        raise ValueError(f"window_model must be one of {', '.join(WINDOW_MODELS)}, not {window_model!r}")
    if not (math.isfinite(band_widen) and band_widen > 0):
        raise ValueError(f"band_widen must be a number above 0, not {band_widen!r}")
    if orbit_period_s is not None and not (math.isfinite(orbit_period_s) and orbit_period_s > 0):
        raise ValueError(f"orbit_period_s must be a number of seconds above 0, not {orbit_period_s!r}")
    now = time.time() if now_wall is None else now_wall
    try:
        profile = basis.get("profile")
        if not profile:
            raise ForecastUnavailable("no payload profile yet (it is sent at each power-on and after each task)")
        if not profile.get("model"):
            raise ForecastUnavailable("the payload's profile names no model")
        if plan is None:
            pairs, current_start, current_len = _history(basis)
            if not pairs:
                raise ForecastUnavailable("the window history holds no ended window yet")
            if known_off:
                pairs = _unexplained(pairs, [float(x) for x in basis["windows"]["starts"]], known_off)
        else:
            pairs, current_start, current_len = [], now, None
        progress = basis.get("progress") or {}
        current = progress.get("task_id")
        queue = _order(tasks, current)
        assumed_done: list[str] = []
        depth = progress.get("queue_depth")
        if isinstance(depth, int) and len(queue) > depth:
            # More open tasks in this station's list than live on board: the oldest ones finished
            # while no ground of this state directory listened (their COMPLETED unheard). Said in
            # the result ("assumed_done"), not hidden.
            running = [t for t in queue if t.get("task_id") == current]
            others = [t for t in queue if t.get("task_id") != current]
            keep = max(0, depth - len(running))
            by_age = sorted(others, key=lambda t: t.get("created", ""))
            assumed_done = [t["task_id"] for t in by_age[: len(by_age) - keep]]
            queue = [t for t in queue if t["task_id"] not in assumed_done]
        if not queue:
            return {"made_at": now, "tasks": {}, "assumed_done": assumed_done}
        units: list[tuple[float, int]] = []
        marks: list[int] = []
        for task in queue:
            if task.get("task_id") == current and "units_done" in progress:
                # progress counted in durable units of the whole task (the benchmark's form)
                mine = _unit_list(profile, None, 0, None, task.get("max_new_tokens"))[1 + int(progress["units_done"]) :]
            elif task.get("task_id") == current and progress.get("phase") in PHASES:
                mine = _unit_list(
                    profile,
                    progress["phase"],
                    int(progress.get("done", 0)),
                    progress.get("total"),
                    task.get("max_new_tokens"),
                )
            else:
                mine = _unit_list(profile, None, 0, None, task.get("max_new_tokens"))
            units += mine
            marks.append(len(units))
    except ForecastUnavailable as exc:
        return {"made_at": now, "unavailable": str(exc)}
    t_heard = float(progress.get("heard_at", now)) if plan is None else now
    overhead = power_up_overhead(profile)
    if plan is not None:
        # a plan window that began before now: the payload has been up since its start
        up_since = next((w[0] * plan_scale for w in plan if w[0] * plan_scale <= now < w[1] * plan_scale), None)
        first_overhead = overhead if up_since is None else max(0.0, overhead - (now - up_since))
    elif current_len is not None:
        first_overhead = overhead  # the walk starts at the next power-up
    else:  # heard inside a window: what is left of its power-up overhead
        first_overhead = max(0.0, overhead - (t_heard - current_start))
    seconds = [u for u, _ in units]
    steps = [max(1, k) for _, k in units]
    warned = _warned_share(basis) if plan is None else 0.0
    model: dict[str, Any] = {"kind": "plan"}
    period: float | None = None
    if plan is None:
        model, period = _window_model(basis, window_model, orbit_period_s, t_heard)
    if period is not None:
        starts = [float(x) for x in basis["windows"]["starts"]][: len(pairs)]
        choices = _phase_choices(pairs, starts, period, t_heard, current_start)
    rng = random.Random(seed)
    # the unit model's own spread, drawn apart so the windows drawn do not depend on it
    unit_rng = random.Random(seed + 1)
    spread = unit_sigma if plan is None else 0.0
    results: list[list[tuple[float, int] | None]] = []
    for _ in range(draws if plan is None else 1):
        wins: Iterator[Any]
        if period is not None:
            wins = _phase_windows(rng, pairs, period, choices, t_heard, current_start, current_len)
        else:
            wins = _windows(rng, pairs, t_heard, current_start, current_len, plan, plan_scale)
        if known_off and plan is None:
            wins = _outside(wins, known_off)
        if warned > 0:
            wins = _announced(rng, wins, warned)
        pace = math.exp(unit_rng.gauss(0.0, spread)) if spread > 0 else 1.0
        results.append(
            finish_times(
                [u * pace for u in seconds] if pace != 1.0 else seconds,
                marks,
                wins,
                overhead_s=overhead * pace,
                first_overhead_s=first_overhead * pace,
                parts=steps,
            )
        )
    out: dict[str, Any] = {}
    for k, task in enumerate(queue):
        got = [hit for hit in (r[k] for r in results) if hit is not None]
        if len(got) < 0.5 * len(results):
            out[task["task_id"]] = {
                "unavailable": "it does not complete in most drawn futures (a unit longer than the windows)"
            }
            continue
        times = sorted(max(now, t) for t, _ in got)
        # a draw that never completes counts as later than all the others
        times += [math.inf] * (len(results) - len(got))
        med = _pct(times, 0.5)
        lo, hi = _pct(times, 0.1), _pct(times, 0.9)
        lo, hi = widen_band(med, lo, hi, now, band_widen)
        out[task["task_id"]] = {
            "position": k,
            "expected": med,
            "p10": lo,
            "p90": hi,
            "remaining_s": med - now,
            "windows": int(statistics.median(n for _, n in got)),
        }
    return {
        "made_at": now,
        "draws": len(results),
        "history_windows": len(pairs),
        "window_model": model,
        "tasks": out,
        "assumed_done": assumed_done,
    }


def widen_band(median: float, low: float, high: float, now: float, factor: float) -> tuple[float, float]:
    """The band (low, high) around `median` widened by `factor`, never before `now`."""
    return max(now, median - factor * (median - low)), median + factor * (high - median)


def _pct(sorted_values: Sequence[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]


def forecast_lines(forecast: dict, now_wall: float | None = None) -> list[str]:
    """Human lines: one per task, or the reason there is none."""
    now = time.time() if now_wall is None else now_wall
    if "unavailable" in forecast:
        return [f"forecast: none ({forecast['unavailable']})"]
    lines = []
    for task_id, f in forecast.get("tasks", {}).items():
        if "unavailable" in f:
            lines.append(f"forecast {task_id}: none ({f['unavailable']})")
            continue
        when = time.strftime("%H:%M:%S", time.gmtime(f["expected"]))
        lines.append(
            f"forecast {task_id}: done ~{when} UTC (in {_dur(f['expected'] - now)}; 10-90 %: "
            f"{_dur(f['p10'] - now)} - {_dur(f['p90'] - now)}), inside {f['windows']} more window(s)"
        )
    model = forecast.get("window_model") or {}
    if lines and model.get("kind") == "phase":
        lines.append(
            f"forecast: windows drawn at the orbit's phase (period {model['period_s'] / 60:.1f} min, "
            f"{model['period_from']})"
        )
    elif lines and model.get("kind") == "history" and model.get("why") != "asked for":
        lines.append(f"forecast: windows drawn without orbital phase ({model['why']})")
    if forecast.get("assumed_done"):
        lines.append(
            f"forecast: taken as done on board (more open tasks here than the payload holds; fetch them with "
            f"results): {', '.join(forecast['assumed_done'])}"
        )
    if not lines:
        lines.append("forecast: no open task")
    return lines


def _dur(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
