"""Typed trace API: windows, cuts, statistics, time scaling, concatenation, lookups."""

from __future__ import annotations

import math

import pytest

from traces import CutCause, EventKind, PowerWindow, TelemetrySample, Trace
from traces.format import parse_lines, trace_problems, trace_to_lines, validate_lines


def flat_telemetry(duration_s: int) -> list[TelemetrySample]:
    return [TelemetrySample(float(t), 16.0, 0.9, 30.0 + t / 4, 0.0) for t in range(duration_s + 1)]


@pytest.fixture
def hand_made() -> Trace:
    # Windows of 20, 40, 60 and (open) 30 s in a 200 s trace, reference request 50 s.
    windows = [
        PowerWindow(10.0, 30.0, CutCause.THERMAL, 5.0),
        PowerWindow(40.0, 80.0, CutCause.FDIR, 0.0),
        PowerWindow(100.0, 160.0, CutCause.POWER, 15.0),
        PowerWindow(170.0, 200.0, None),
    ]
    return Trace.from_windows(
        "hand-made", 200.0, windows, telemetry=flat_telemetry(200), telemetry_period_s=1.0, reference_request_s=50.0
    )


def test_hand_made_trace_is_valid(hand_made: Trace):
    assert trace_problems(hand_made) == []


def test_windows_and_cuts(hand_made: Trace):
    windows = hand_made.windows()
    assert [(w.start_s, w.end_s, w.cut_cause) for w in windows] == [
        (10.0, 30.0, CutCause.THERMAL),
        (40.0, 80.0, CutCause.FDIR),
        (100.0, 160.0, CutCause.POWER),
        (170.0, 200.0, None),
    ]
    assert windows[0].warning_at_s == 25.0 and windows[1].warning_at_s is None
    assert windows[-1].is_open
    cuts = hand_made.cuts()
    assert [(c.t_s, c.cause, c.warning_lead_s) for c in cuts] == [
        (30.0, CutCause.THERMAL, 5.0),
        (80.0, CutCause.FDIR, 0.0),
        (160.0, CutCause.POWER, 15.0),
    ]
    assert [(w.t_s, w.lead_s) for w in hand_made.warnings()] == [(25.0, 5.0), (145.0, 15.0)]


def test_stats_on_hand_made_trace(hand_made: Trace):
    s = hand_made.stats()
    assert s.windows == 4 and s.open_final_window
    assert s.cuts == 3
    assert dict(s.cuts_by_cause) == {"power": 1, "thermal": 1, "fdir": 1, "contention": 0}
    assert s.window_mean_s == pytest.approx((20 + 40 + 60 + 30) / 4)
    assert s.window_median_s == pytest.approx(35.0)
    assert (s.window_min_s, s.window_max_s) == (20.0, 60.0)
    assert s.windows_shorter_than_request == 3  # 20, 40, 30 < 50
    assert s.off_mean_s == pytest.approx((10 + 20 + 10) / 3)
    assert s.warned_cuts == 2
    assert s.warning_lead_mean_s == pytest.approx(10.0)
    assert (s.warning_lead_min_s, s.warning_lead_max_s) == (5.0, 15.0)
    assert s.on_time_s == pytest.approx(150.0)
    assert s.duty_cycle == pytest.approx(150.0 / 200.0)


def test_stats_of_a_trace_without_windows():
    s = Trace("off", 10.0, ()).stats()
    assert (s.windows, s.cuts, s.duty_cycle, s.window_mean_s, s.warning_lead_mean_s) == (0, 0, 0.0, None, None)


def test_events_in_time_order_with_warning_before_cut(hand_made: Trace):
    kinds = [(e.kind, e.t_s) for e in hand_made.events]
    assert kinds[:4] == [
        (EventKind.POWER_ON, 10.0),
        (EventKind.WARNING, 25.0),
        (EventKind.CUT, 30.0),
        (EventKind.POWER_ON, 40.0),
    ]


@pytest.mark.parametrize("factor", [0.01, 0.37, 1.0, 3.0])
def test_scaled_multiplies_every_time(hand_made: Trace, factor: float):
    scaled = hand_made.scaled(factor)
    assert trace_problems(scaled) == []
    assert scaled.duration_s == pytest.approx(200.0 * factor)
    assert scaled.telemetry_period_s == pytest.approx(factor)
    assert scaled.reference_request_s == pytest.approx(50.0 * factor)
    assert scaled.time_scale == pytest.approx(factor)
    for before, after in zip(hand_made.windows(), scaled.windows(), strict=True):
        assert after.start_s == pytest.approx(before.start_s * factor)
        assert after.end_s == pytest.approx(before.end_s * factor)
        assert after.warning_lead_s == pytest.approx(before.warning_lead_s * factor)
        assert after.cut_cause == before.cut_cause
    a, b = hand_made.stats(), scaled.stats()
    assert b.duty_cycle == pytest.approx(a.duty_cycle)
    assert b.windows_shorter_than_request == a.windows_shorter_than_request
    assert b.window_mean_s == pytest.approx(a.window_mean_s * factor)
    # Telemetry values are untouched, only their times move.
    assert [s.payload_temp_c for s in scaled.telemetry] == [s.payload_temp_c for s in hand_made.telemetry]


def test_scaling_back_and_forth_round_trips_through_text(hand_made: Trace):
    again = hand_made.scaled(1 / 3).scaled(3)
    assert validate_lines(trace_to_lines(again)) == []
    assert parse_lines(trace_to_lines(again)) == again


@pytest.mark.parametrize("factor", [0, -1, math.inf, math.nan])
def test_scaled_rejects_bad_factors(hand_made: Trace, factor):
    with pytest.raises(ValueError):
        hand_made.scaled(factor)


def test_is_on_at_and_telemetry_at(hand_made: Trace):
    assert not hand_made.is_on_at(5.0)
    assert hand_made.is_on_at(10.0) and hand_made.is_on_at(29.999)
    assert not hand_made.is_on_at(30.0)  # a window is [start, end)
    assert hand_made.is_on_at(199.0)
    sample = hand_made.telemetry_at(42.7)
    assert sample is not None and sample.t_s == 42.0 and sample.payload_temp_c == 40.5
    assert hand_made.telemetry_at(1e9).t_s == 200.0
    assert Trace("bare", 5.0, ()).telemetry_at(1.0) is None


def test_concat_merges_a_window_open_at_the_seam():
    first = Trace.from_windows(
        "a", 10.0, [PowerWindow(2.0, 10.0, None)], telemetry=flat_telemetry(10), telemetry_period_s=1.0
    )
    second = Trace.from_windows(
        "b",
        10.0,
        [PowerWindow(0.0, 4.0, CutCause.CONTENTION, 1.0)],
        telemetry=flat_telemetry(10),
        telemetry_period_s=1.0,
    )
    joined = first.concat(second, name="ab")
    assert trace_problems(joined) == []
    assert joined.duration_s == 20.0
    assert [(w.start_s, w.end_s, w.cut_cause) for w in joined.windows()] == [(2.0, 14.0, CutCause.CONTENTION)]
    assert len(joined.telemetry) == 21


def test_concat_refuses_an_inconsistent_seam():
    ends_on = Trace.from_windows("a", 10.0, [PowerWindow(2.0, 10.0, None)])
    starts_off = Trace.from_windows("b", 10.0, [PowerWindow(3.0, 4.0, CutCause.FDIR)])
    with pytest.raises(ValueError, match="ends with the payload on"):
        ends_on.concat(starts_off)
    other_request = Trace.from_windows("c", 10.0, [], reference_request_s=60.0)
    with pytest.raises(ValueError, match="reference_request_s differs"):
        starts_off.concat(other_request)


def test_repeated_builds_a_longer_valid_trace():
    one = Trace.from_windows(
        "r",
        100.0,
        [PowerWindow(10.0, 40.0, CutCause.THERMAL, 5.0)],
        telemetry=flat_telemetry(100),
        telemetry_period_s=1.0,
    )
    many = one.repeated(5)
    assert trace_problems(many) == []
    assert many.duration_s == 500.0
    assert many.stats().cuts == 5
    assert [w.start_s for w in many.windows()] == [10.0, 110.0, 210.0, 310.0, 410.0]


def test_trace_is_immutable(hand_made: Trace):
    with pytest.raises(AttributeError):
        hand_made.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        hand_made.source["kind"] = "import"  # type: ignore[index]


def test_problems_sees_events_out_of_order(hand_made: Trace):
    from dataclasses import replace

    shuffled = replace(hand_made, events=hand_made.events[3:] + hand_made.events[:3])
    problems = trace_problems(shuffled)
    assert any("time goes backwards" in p.message for p in problems)
