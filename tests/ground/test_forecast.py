"""The completion forecast (ground/forecast.py, docs/ground.md "Completion forecast")."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import time

import pytest
from ground_testkit import link_args

from common.sim.windows import finish_time, finish_times
from common.wire import messages as m
from common.wire.ids import PowerCause
from ground.cli import register
from ground.forecast import forecast_lines, forecast_tasks, orbit_period
from ground.state import GroundState

PROFILE = {
    "model": "qwen3-vl-2b",
    "policy": "orbitweaver",
    "cadence": "fixed",
    "unit_s": {"vision": 2.0, "prefill": 3.0, "decode": 1.0},
    "task_units": {"vision": 4, "prefill": 20, "decode": 32},
    "durable_every": {"vision": 2, "decode": 8},
    "overhead_s": 5.0,
    "setup_s": 1.0,
}
TASKS = [{"task_id": "t1", "state": "accepted", "created": "2026-01-01T00:00:00.000Z"}]


def _basis(pairs, now, progress=None):
    starts, lengths, t = [], [], now - sum(a + b for a, b in pairs)
    for on, off in pairs:
        starts.append(t)
        lengths.append(on)
        t += on + off
    starts.append(now)  # the current window has just started
    return {"profile": PROFILE, "windows": {"starts": starts, "lengths": lengths}, "progress": progress or {}}


def test_the_walk_loses_the_unit_in_flight_at_a_cut():
    # 3 units of 4 s; windows of 10 s with 5 s overhead after the first: 8 s in window 0,
    # the third unit (ends at 12) is cut and runs again in window 1 (start 20 + 5 + 4)
    assert finish_time([4, 4, 4], [(0, 10), (20, 30)], overhead_s=5.0) == (29.0, 1)
    assert finish_time([4, 4, 40], [(0, 10), (20, 30)], overhead_s=5.0, max_windows=10) is None


def test_no_history_says_so():
    out = forecast_tasks(TASKS, {"profile": PROFILE}, now_wall=1000.0)
    assert "window history" in out["unavailable"]
    assert "none (" in forecast_lines(out)[0]
    assert "profile" in forecast_tasks(TASKS, {}, now_wall=1000.0)["unavailable"]


def test_the_band_widens_when_the_history_is_erratic():
    now = 10_000.0
    steady = _basis([(40.0, 20.0)] * 30, now)
    erratic = _basis([(10.0, 20.0), (80.0, 200.0), (30.0, 5.0), (60.0, 60.0), (5.0, 400.0)] * 6, now)
    a = forecast_tasks(TASKS, steady, now_wall=now, draws=200)["tasks"]["t1"]
    b = forecast_tasks(TASKS, erratic, now_wall=now, draws=200)["tasks"]["t1"]
    assert b["p90"] - b["p10"] > 2 * (a["p90"] - a["p10"])


def test_the_band_narrows_as_the_task_advances():
    now = 10_000.0
    pairs = [(40.0, 20.0), (25.0, 60.0), (55.0, 10.0)] * 10
    early = forecast_tasks(
        TASKS,
        _basis(pairs, now, {"task_id": "t1", "phase": "vision", "done": 0, "total": 4, "heard_at": now}),
        now_wall=now,
        draws=200,
    )
    late = forecast_tasks(
        TASKS,
        _basis(pairs, now, {"task_id": "t1", "phase": "decode", "done": 24, "total": 32, "heard_at": now}),
        now_wall=now,
        draws=200,
    )
    e, la = early["tasks"]["t1"], late["tasks"]["t1"]
    assert la["p90"] - la["p10"] < e["p90"] - e["p10"]
    assert la["expected"] < e["expected"]
    assert "inside" in forecast_lines(late, now_wall=now)[0]


def test_status_shows_the_forecast_from_the_payloads_telemetry(ow, keys, peer, pictures):
    result = ow("ground", "uplink", *link_args(keys, peer), "--image", pictures[1], "--prompt", "count the ships")
    task_id = result.out.strip()
    before = ow("ground", "status", *link_args(keys, peer))
    assert before.code == 0 and "forecast: none (no payload profile yet" in before.out
    now = time.time()
    peer.forecast_packets = [
        m.PayloadProfile(
            model="qwen3-vl-2b",
            policy="orbitweaver",
            cadence="fixed",
            decode_tokens=0,
            **{k: PROFILE[k] for k in ("unit_s", "task_units", "durable_every", "overhead_s", "setup_s")},
        ),
        m.WindowHistory(boot_count=3, starts=[now - 300, now - 200, now - 100], lengths=[60.0, 70.0]),
        # one cut announced, one not: the forecast keeps the share of announced cuts it heard
        m.ShutdownWarning(trace_time_s=1.0, lead_time_s=10.0, cause=PowerCause.THERMAL),
        m.PowerStateChange(trace_time_s=2.0, payload_on=False, cause=PowerCause.THERMAL),
        m.PowerStateChange(trace_time_s=3.0, payload_on=True, cause=PowerCause.RESTORED),
        m.PowerStateChange(trace_time_s=4.0, payload_on=False, cause=PowerCause.FDIR),
    ]
    text = ow("ground", "status", *link_args(keys, peer))
    assert text.code == 0, text.err
    assert f"forecast {task_id}: done ~" in text.out and "more window(s)" in text.out
    as_json = json.loads(ow("ground", "status", *link_args(keys, peer), "--json").out)
    mine = as_json["forecast"]["tasks"][task_id]
    assert mine["p10"] <= mine["expected"] <= mine["p90"]
    basis = GroundState(keys.state_dir).forecast_basis()
    assert basis["windows"]["lengths"] == [60.0, 70.0] and basis["progress"]["task_id"] == task_id
    assert basis["cuts"]["heard"] >= 2 and basis["cuts"]["recent"][:2] == [True, False]


def test_a_plan_replaces_the_history():
    # windows of 20 s every 30 s from now: the task needs 1 + 2x2 + 20x3 + 4x8 = 97 s of units
    now = 5_000.0
    plan = [(now / 2 + 15.0 * k, now / 2 + 15.0 * k + 10.0) for k in range(100)]  # plan seconds, scale 2
    out = forecast_tasks(TASKS, {"profile": PROFILE}, plan=plan, plan_scale=2.0, now_wall=now)
    f = out["tasks"]["t1"]
    assert f["p10"] == f["expected"] == f["p90"] and f["windows"] >= 5


def test_tasks_beyond_the_payloads_queue_are_said_to_be_done():
    now = 10_000.0
    tasks = [{"task_id": f"t{k}", "state": "accepted", "created": f"2026-01-01T00:00:0{k}.000Z"} for k in range(3)]
    basis = _basis(
        [(40.0, 20.0)] * 10, now, {"task_id": "t2", "phase": "prefill", "done": 3, "total": 20, "queue_depth": 1}
    )
    out = forecast_tasks(tasks, basis, now_wall=now, draws=50)
    assert out["assumed_done"] == ["t0", "t1"] and list(out["tasks"]) == ["t2"]
    assert any("taken as done on board" in line and "t0, t1" in line for line in forecast_lines(out, now_wall=now))


def test_setup_and_power_up_overhead_already_hold_the_first_unit():
    # The payload measures a task's setup and a power-up's overhead to the END of the first unit
    # (flight/runtime/profile.py): that unit must not be charged twice. Units: vision 4 x 2 s,
    # prefill 20 x 3 s, decode 32 x 1 s = 100 s; setup 1 s < the first (vision) unit: nothing more.
    now = 5_000.0
    up_since = forecast_tasks(TASKS, {"profile": PROFILE}, plan=[(now - 100.0, now + 1e6)], now_wall=now)
    assert up_since["tasks"]["t1"]["expected"] == now + 100.0
    # a window that starts now: the power-up overhead (5 s) less a typical unit (decode's 1 s)
    fresh = forecast_tasks(TASKS, {"profile": PROFILE}, plan=[(now, now + 1e6)], now_wall=now)
    assert fresh["tasks"]["t1"]["expected"] == now + 104.0


def test_a_known_off_period_is_waited_out_and_its_gap_not_drawn_again():
    now = 10_000.0
    steady = _basis([(400.0, 20.0)] * 20, now)
    free = forecast_tasks(TASKS, steady, now_wall=now, draws=100)["tasks"]["t1"]
    off = [(now + 30.0, now + 900.0)]
    planned = forecast_tasks(TASKS, steady, known_off=off, now_wall=now, draws=100)["tasks"]["t1"]
    assert free["expected"] < now + 200.0 < now + 900.0 < planned["p10"] <= planned["expected"]
    # a history whose long gaps a known (past) off period explains: with the plan they are not
    # drawn as random gaps again, so the band is narrower
    pairs = [(60.0, 20.0), (60.0, 20.0), (60.0, 1500.0)] * 6
    basis = _basis(pairs, now)
    starts, lengths = basis["windows"]["starts"], basis["windows"]["lengths"]
    past = [
        (s + on + 1.0, s + on + 1499.0)
        for s, on, (_, gap) in zip(starts[:-1], lengths, pairs, strict=True)
        if gap > 1000
    ]
    blind = forecast_tasks(TASKS, basis, now_wall=now, draws=200)["tasks"]["t1"]
    told = forecast_tasks(TASKS, basis, known_off=past, now_wall=now, draws=200)["tasks"]["t1"]
    assert told["p90"] - told["p10"] < blind["p90"] - blind["p10"]
    assert told["expected"] <= blind["expected"]


def test_a_known_pass_inside_an_eclipse_does_not_erase_the_eclipse():
    # the history's long gaps are eclipses; a contact-plan pass of 100 s falls inside each. The
    # pass did not cause the gap (it covers under half of it), so the eclipses are drawn again:
    # the forecast is the one made without the plan
    now = 10_000.0
    pairs = [(60.0, 20.0), (60.0, 20.0), (60.0, 1500.0)] * 6
    basis = _basis(pairs, now)
    starts, lengths = basis["windows"]["starts"], basis["windows"]["lengths"]
    passes = [
        (s + on + 700.0, s + on + 800.0)
        for s, on, (_, gap) in zip(starts[:-1], lengths, pairs, strict=True)
        if gap > 1000
    ]
    blind = forecast_tasks(TASKS, basis, now_wall=now, draws=100)["tasks"]["t1"]
    told = forecast_tasks(TASKS, basis, known_off=passes, now_wall=now, draws=100)["tasks"]["t1"]
    assert told == blind


def test_the_band_is_the_draws_band_widened_around_the_median():
    now = 10_000.0
    basis = _basis([(40.0, 20.0), (25.0, 60.0), (55.0, 10.0)] * 10, now)
    own = forecast_tasks(TASKS, basis, now_wall=now, draws=100, band_widen=1.0)["tasks"]["t1"]
    wide = forecast_tasks(TASKS, basis, now_wall=now, draws=100, band_widen=2.0)["tasks"]["t1"]
    assert own["expected"] == wide["expected"]
    assert wide["p90"] - wide["expected"] == pytest.approx(2.0 * (own["p90"] - own["expected"]))
    assert wide["p10"] == max(now, wide["expected"] - 2.0 * (own["expected"] - own["p10"]))
    with pytest.raises(ValueError, match="band_widen"):
        forecast_tasks(TASKS, basis, now_wall=now, band_widen=0.0)


def test_an_announced_cut_keeps_the_steps_that_ended():
    # one unit of 4 steps (a decode record every 4 steps, 2 s each) and a window ending at 7 s:
    # unannounced, the unit is lost and runs whole in the next window (10 + 1 + 8); announced,
    # its 3 finished steps are kept and only the 4th runs again (10 + 1 + 2)
    windows = [(0.0, 7.0), (10.0, 100.0)]
    assert finish_time([8.0], windows, overhead_s=1.0, max_windows=5) == (19.0, 1)
    announced = [(0.0, 7.0, True), (10.0, 100.0, False)]
    assert finish_times([8.0], [1], announced, overhead_s=1.0, parts=[4]) == [(13.0, 1)]
    # the forecast draws announced cuts with the share the ground heard: earlier, never later
    now = 10_000.0
    basis = _basis([(45.0, 30.0)] * 20, now)
    quiet = forecast_tasks(TASKS, basis, now_wall=now, draws=100)["tasks"]["t1"]
    warned = forecast_tasks(TASKS, {**basis, "cuts": {"heard": 20, "warned": 20}}, now_wall=now, draws=100)
    assert warned["tasks"]["t1"]["expected"] < quiet["expected"]


ORBIT = 5700.0  # seconds


def _orbits(count: int, end: float, duty_on: float = 0.5, piece: float = 300.0, gap: float = 30.0):
    """A window history of `count` orbits ending at `end`: in the first `duty_on` of each orbit
    windows of `piece` s with `gap` s between them, then off to the next orbit (an eclipse)."""
    starts, lengths = [], []
    t0 = end - count * ORBIT
    for k in range(count):
        t = t0 + k * ORBIT
        while t + piece <= t0 + k * ORBIT + duty_on * ORBIT:
            starts.append(t)
            lengths.append(piece)
            t += piece + gap
    return starts, lengths


def test_the_orbits_period_is_found_in_the_history_or_said_why_not():
    starts, lengths = _orbits(3, 30_000.0)
    on = [(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    period, how = orbit_period(on, 30_000.0)
    assert period is not None and abs(period - ORBIT) < 0.02 * ORBIT and "found" in how
    # one orbit of history: too short, and it says so
    period, how = orbit_period(on[-len(on) // 3 :], 30_000.0)
    assert period is None and "spans" in how
    # windows cut at random (FDIR alone): no orbital pattern
    rng = random.Random(5)
    t, random_on = 0.0, []
    while t < 3 * ORBIT:
        length = rng.expovariate(1 / 200.0)
        random_on.append((t, t + length))
        t += length + rng.expovariate(1 / 150.0)
    period, how = orbit_period(random_on, t)
    assert period is None and "no orbital pattern" in how


def test_the_windows_to_come_are_drawn_at_the_orbits_phase():
    # Windows of 60 s every 90 s through the first half of every orbit, off through the second.
    # Five tasks uplinked at the start of an orbit (about 14 min of work and power-ups) are done
    # well inside its powered half; resampled without phase, the long off period is drawn as
    # likely now as later, and the band reaches past it.
    now = 3 * ORBIT
    starts, lengths = _orbits(3, now, piece=60.0)
    basis = {"profile": PROFILE, "windows": {"starts": [*starts, now], "lengths": lengths}, "progress": {}}
    tasks = [{"task_id": f"t{k}", "state": "accepted", "created": f"2026-01-01T00:00:0{k}.000Z"} for k in range(5)]
    phase = forecast_tasks(tasks, basis, now_wall=now, draws=200)
    flat = forecast_tasks(tasks, basis, now_wall=now, draws=200, window_model="history")
    given = forecast_tasks(tasks, basis, now_wall=now, draws=200, orbit_period_s=ORBIT)
    assert phase["window_model"]["kind"] == "phase" and flat["window_model"]["kind"] == "history"
    assert given["window_model"]["period_s"] == ORBIT and given["window_model"]["period_from"].startswith("given")
    # at phase: done in the powered half, the band too (the off half begins at now + 2850 s)
    assert phase["tasks"]["t4"]["p90"] < now + 1500.0 and given["tasks"]["t4"]["p90"] < now + 1500.0
    assert flat["tasks"]["t4"]["p90"] > now + 2850.0
    assert any("at the orbit's phase" in line for line in forecast_lines(phase, now_wall=now))


def test_too_little_history_for_a_phase_model_falls_back_and_says_why():
    now = 10_000.0
    out = forecast_tasks(TASKS, _basis([(40.0, 20.0)] * 30, now), now_wall=now, draws=50)
    assert out["window_model"]["kind"] == "history" and "spans" in out["window_model"]["why"]
    assert "expected" in out["tasks"]["t1"]
    assert any("without orbital phase (the window history spans" in line for line in forecast_lines(out, now_wall=now))


def test_off_takes_a_negative_start_as_written_or_says_how():
    parser = argparse.ArgumentParser(prog="ow")
    register(parser.add_subparsers())
    args = parser.parse_args(["ground", "status", "--off", "-3000,-2600", "--off", "600,900"])
    assert args.off == [(-3000.0, -2600.0), (600.0, 900.0)]
    assert parser.parse_args(["ground", "results", "t1", "--off=-.5,2.5"]).off == [(-0.5, 2.5)]
    for bad, says in ((["--off", "-3000"], "--off -3000,-2600"), (["--off", "5,1"], "TO must be a number after FROM")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            parser.parse_args(["ground", "status", *bad])
        assert says in err.getvalue()
