"""Physical generator: determinism and physics sanity (orbit, thermal, battery, FDIR, contention)."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traces import CutCause, EventKind, Trace
from traces.format import dumps, trace_problems
from traces.generator import (
    BUPT1_PACK_OCV,
    SAT1_TAU_S,
    FdirParams,
    OrbitParams,
    PowerParams,
    SatelliteConfig,
    ThermalParams,
    _contention_windows,
    pack_voltage,
    simulate,
    soc_from_voltage,
    tau_for_heating,
)
from traces.presets import PRESETS, SHIPPED_SEEDS, generate

AMPLE_POWER = PowerParams(solar_current_a=4.0, soc_initial=1.0)  # power never binds
COOL_PAYLOAD = ThermalParams(loaded_steady_c=45.0, tau_s=47.4)  # thermal never binds


def quiet_config(**changes) -> SatelliteConfig:
    """A satellite on which nothing interrupts the payload unless a test turns it on."""
    base = SatelliteConfig(kind="test", description="test", duration_s=5700, power=AMPLE_POWER, thermal=COOL_PAYLOAD)
    return replace(base, **changes)


# ------------------------------------------------------------------------------ orbit


def test_leo_orbit_period_and_eclipse():
    orbit = OrbitParams()  # 520 km, beta 0
    assert orbit.period_s / 60 == pytest.approx(95.0, abs=0.5)
    assert orbit.eclipse_s / 60 == pytest.approx(35.0, abs=1.0)
    assert orbit.eclipse_s / orbit.period_s == pytest.approx(35 / 95, abs=0.01)
    sunlit = sum(orbit.sunlit(t) for t in range(int(orbit.period_s)))
    assert 1 - sunlit / int(orbit.period_s) == pytest.approx(orbit.eclipse_s / orbit.period_s, abs=1e-3)


def test_eclipse_shrinks_with_beta_angle_and_vanishes_past_the_shadow():
    eclipses = [OrbitParams(beta_deg=b).eclipse_s for b in (0, 30, 60, 70, 80)]
    assert eclipses == sorted(eclipses, reverse=True)
    assert eclipses[-1] == 0.0  # beta* = asin(R / (R + h)) = 67.6 deg at 520 km
    assert OrbitParams(altitude_km=400).period_s < OrbitParams(altitude_km=520).period_s


# ------------------------------------------------------------------------------ battery


def test_pack_curve_is_monotonic_and_inverts():
    volts = [v for _, v in BUPT1_PACK_OCV]
    assert volts == sorted(volts)
    for soc in (0.0, 0.05, 0.33, 0.5, 0.77, 0.99, 1.0):
        assert soc_from_voltage(pack_voltage(soc)) == pytest.approx(soc, abs=1e-9)
    assert soc_from_voltage(20.0) == 1.0 and soc_from_voltage(5.0) == 0.0


def eclipse_intervals(trace: Trace, orbit: OrbitParams) -> list[tuple[int, int]]:
    out, start = [], None
    for t in range(int(trace.duration_s) + 1):
        dark = not orbit.sunlit(t)
        if dark and start is None:
            start = t
        if not dark and start is not None:
            out.append((start, t))
            start = None
    if start is not None:  # an eclipse still going on at the end of the trace
        out.append((start, int(trace.duration_s) + 1))
    return out


def test_battery_drains_in_eclipse_and_brown_out_thresholds_hold():
    config = PRESETS["sat2-like"]
    trace = generate("sat2-like")
    soc = [s.battery_soc for s in trace.telemetry]
    intervals = eclipse_intervals(trace, config.orbit)
    assert len(intervals) == 3
    for start, end in intervals:
        # No harvest in eclipse: the state of charge can only fall (allow equal rounded values).
        assert all(b <= a for a, b in pairwise(soc[start + 1 : end]))
        assert soc[end - 1] < soc[start]
    power_cuts = [c for c in trace.cuts() if c.cause is CutCause.POWER]
    assert len(power_cuts) >= 3
    for cut in power_cuts:
        at_cut = soc[int(cut.t_s)]
        assert config.power.soc_off - 0.01 <= at_cut <= config.power.soc_off + 0.005
        assert cut.warning_lead_s == config.power.warning_lead_s
    windows = trace.windows()
    for before, after in pairwise(windows):
        if before.cut_cause is CutCause.POWER:  # back on only once recharged to soc_on
            assert soc[int(after.start_s)] >= config.power.soc_on - 0.0005


# ------------------------------------------------------------------------------ thermal


def test_tau_from_the_sat1_heating_report():
    assert SAT1_TAU_S == pytest.approx(48 / math.log(30 / 20))
    assert tau_for_heating(45, 55, 48, 75) == SAT1_TAU_S
    with pytest.raises(ValueError):
        tau_for_heating(45, 55, 48, 50)


def test_payload_heats_from_45_to_55_in_48_s_and_is_cut_there():
    config = quiet_config(thermal=ThermalParams())  # Sat-1 thermal, structure at 25 C
    trace = simulate(config, seed=0)
    temps = [s.payload_temp_c for s in trace.telemetry]
    windows = [w for w in trace.windows() if w.cut_cause is CutCause.THERMAL]
    assert len(windows) > 50
    assert {w.cut_cause for w in trace.windows()[:-1]} == {CutCause.THERMAL}
    heating_times = []
    for window in windows[1:]:  # the first window may start from the warm-up's state
        start, end = int(window.start_s), int(window.end_s)
        assert temps[start] <= 45.0
        crossed_45 = next(t for t in range(start, end + 1) if temps[t] >= 45.0)
        heating_times.append(end - crossed_45)
        assert 55.0 <= temps[end] <= 55.3  # cut as the limit is reached
    assert min(heating_times) >= 47 and max(heating_times) <= 49
    # Each window matches the first-order model from its start temperature, to the 1 s step.
    for window in windows[1:]:
        start = temps[int(window.start_s)]
        expected = SAT1_TAU_S * math.log((75 - start) / (75 - 55))
        assert abs(window.length_s - expected) <= 1.2
    # Off, the payload cools towards the 25 C structure and restarts at 45 C.
    for before, after in pairwise(windows):
        cooling = temps[int(before.end_s) + 1 : int(after.start_s) + 1]
        assert all(b < a for a, b in pairwise(cooling))
        assert cooling[-1] <= 45.0 < cooling[-2]
    # Thermal cut frequency: one heat/cool cycle of 48 s + 48 s (symmetric around 25 / 75 C).
    cycle = (windows[-1].end_s - windows[1].end_s) / (len(windows) - 2)
    assert cycle == pytest.approx(48 + 48, abs=2.5)


def test_thermal_warning_announces_the_cut_at_the_limit():
    trace = generate("sat1-like")
    temps = [s.payload_temp_c for s in trace.telemetry]
    thermal = [c for c in trace.cuts() if c.cause is CutCause.THERMAL]
    assert thermal and all(c.warning_lead_s == 10.0 for c in thermal)
    for cut in thermal:
        assert 54.5 <= temps[int(cut.t_s)] <= 55.5
        assert temps[int(cut.warning_at_s)] < 55.0


# ------------------------------------------------------------------------------ FDIR


def test_fdir_rate_matches_its_parameter_over_a_long_run():
    rate = 1.0 / 120.0
    config = quiet_config(fdir=FdirParams(rate_per_s=rate, off_s=10.0), duration_s=60_000, warmup_s=0)
    trace = simulate(config, seed=11)
    stats = trace.stats()
    assert stats.cuts == stats.cuts_by_cause["fdir"]
    expected = rate * stats.on_time_s
    assert abs(stats.cuts - expected) <= 4 * math.sqrt(expected), (stats.cuts, expected)
    # Windows between resets are exponential with mean 1/rate (plus the 1 s step's rounding).
    lengths = [w.length_s for w in trace.windows() if w.cut_cause is CutCause.FDIR]
    mean = sum(lengths) / len(lengths)
    assert abs(mean - (1 / rate + 0.5)) <= 4 * (1 / rate) / math.sqrt(len(lengths))
    assert all(c.warning_lead_s == 0 for c in trace.cuts())
    gaps = {after.start_s - before.end_s for before, after in pairwise(trace.windows())}
    assert gaps == {10.0}


def test_worst_case_fdir_rate_is_once_a_minute_in_trace_a():
    assert PRESETS["trace-a"].fdir.rate_per_s == pytest.approx(1 / 60)


# ------------------------------------------------------------------------------ contention


def test_contention_cuts_at_scheduled_windows_with_their_lead():
    config = PRESETS["trace-b"]
    trace = generate("trace-b")
    schedule = _contention_windows(config, SHIPPED_SEEDS["trace-b"], -config.warmup_s, int(trace.duration_s) + 6000)
    starts = {begin for begin, _ in schedule}
    cuts = [c for c in trace.cuts() if c.cause is CutCause.CONTENTION]
    assert cuts
    for cut in cuts:
        assert int(cut.t_s) in starts
        assert 0 < cut.warning_lead_s <= config.contention.warning_lead_s
    for window in trace.windows():  # the payload never runs inside a contention window
        for begin, end in schedule:
            assert not (begin <= window.start_s < end)


# ------------------------------------------------------------------------------ determinism, validity


@pytest.mark.parametrize("kind", list(PRESETS))
def test_same_seed_same_trace_other_seed_other_trace(kind: str):
    a = generate(kind, seed=123, duration_s=3000)
    b = generate(kind, seed=123, duration_s=3000)
    assert dumps(a) == dumps(b)
    if PRESETS[kind].fdir.rate_per_s > 0 and kind != "sat1-like":
        assert generate(kind, seed=124, duration_s=3000).events != a.events


@pytest.mark.parametrize("kind", list(PRESETS))
@pytest.mark.parametrize("seed,duration", [(7, 1), (8, 37), (9, 2500)])
def test_generated_traces_are_valid_for_any_seed_and_length(kind: str, seed: int, duration: int):
    trace = generate(kind, seed=seed, duration_s=duration)
    assert trace_problems(trace) == []
    assert trace.duration_s == duration and len(trace.telemetry) == duration + 1


# Issue 27, finding 8: `trace-generate --kind trace-a --seed 777` wrote an invalid trace (a cut at
# t=0 while the payload was off: it had been on through the warm-up and was cut at t=0 itself).
# The state at t=0 comes from the warm-up, so the property varies the warm-up's length and the
# FDIR rate as well as the seed: a short warm-up makes an example cheap (a few ms instead of the
# presets' 3 orbits), and frequent resets make a cut at any given second, t=0 included, likely.
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(list(PRESETS)),
    seed=st.integers(min_value=-(2**63), max_value=2**64),
    warmup_s=st.integers(min_value=0, max_value=1200),
    duration=st.integers(min_value=1, max_value=240),
    fdir_rate=st.sampled_from([None, 0.2]),
)
def test_the_generator_writes_a_valid_trace_for_every_seed(kind, seed, warmup_s, duration, fdir_rate):
    config = replace(PRESETS[kind], warmup_s=warmup_s)
    if fdir_rate is not None:
        config = replace(config, fdir=replace(config.fdir, rate_per_s=fdir_rate))
    trace = simulate(config, seed, duration, name=kind)
    assert trace_problems(trace) == []


def test_trace_a_seed_777_is_valid():
    """The seed of the report, with the shipped preset as `trace-generate` runs it."""
    trace = generate("trace-a", seed=777)
    assert trace_problems(trace) == []
    assert trace.events[0].kind is EventKind.POWER_ON


def test_generated_header_records_seed_and_every_parameter():
    trace = generate("trace-b", seed=42, duration_s=100)
    assert trace.source["kind"] == "generator" and trace.source["seed"] == 42
    parameters = trace.source["parameters"]
    assert parameters["fdir"]["rate_per_s"] == pytest.approx(1 / 900)
    assert parameters["orbit"]["derived_eclipse_s"] == pytest.approx(OrbitParams().eclipse_s, abs=0.1)
    assert len(trace.assumptions) >= 10
    # Telemetry payload power follows the power state.
    for sample in trace.telemetry:
        assert (sample.payload_power_w > 0) == trace.is_on_at(sample.t_s)


def test_unknown_kind_is_rejected():
    with pytest.raises(KeyError, match="unknown trace kind"):
        generate("sat3-like")
