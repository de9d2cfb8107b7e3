"""The bus replays a trace against a real payload process: power-ups, warnings and SIGKILL cuts at
the trace's scaled times, telemetry on the PUB, FDIR power cycles of a silent or dead payload.

Times are checked two ways: against the bus's own run log, and against what the scripted test
payload itself saw (its ticks stop when it is killed; it records each warning it received)."""

from __future__ import annotations

import psutil
from bus_testkit import (
    bus_config,
    drain_until,
    read_record,
    scripted_payload_command,
    telemetry_subscriber,
    wait_for,
    window,
    write_trace,
)

from common.wire import FdirMode, PowerCause
from common.wire import messages as m
from hil.bus import BusThread, TraceClock, trace_actions
from hil.bus import buslog as bl
from traces import CutCause

#: How late the bus may act is the machine's business, not the test's (a loaded machine runs late):
#: the tests check that every action is due at the trace's scaled time, never early and in the
#: trace's order. How late the bus runs is measured by bench/bus_timing.py.
NEVER_EARLY_S = 1e-3
#: How long a wait may last before the test calls it a hang: waits end on events (the bus
#: stopping at the trace end), and a loaded machine may take many times the usual seconds.
HANG_S = 300.0


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def bus_clock(entry: bl.BusLogEntry) -> float:
    """The bus clock (trace time x scale) at a run-log entry."""
    assert entry.clock_s is not None
    return entry.clock_s


def by_kind(entries, kind):
    return [e for e in entries if e.kind == kind]


def assert_on_schedule(entries, due_clock_s: list[float]) -> None:
    """Each entry acted at or after its due bus-clock time, and in the schedule's order."""
    assert len(entries) == len(due_clock_s), (entries, due_clock_s)
    for entry, due in zip(entries, due_clock_s, strict=True):
        assert bus_clock(entry) >= due - NEVER_EARLY_S, ("acted early", entry, due)
    assert [e.n for e in entries] == sorted(e.n for e in entries)


def test_cuts_warnings_and_power_ups_land_at_the_scaled_trace_times(tmp_path, keys):
    scale = 0.1
    # 0-10 s on (thermal cut announced 2 s ahead), 12-19 s on (unannounced FDIR reset), 21-28 s on.
    trace = write_trace(
        tmp_path / "three.jsonl",
        28,
        [window(0, 10, CutCause.THERMAL, 2.0), window(12, 19, CutCause.FDIR), window(21, 28, None)],
    )
    record = tmp_path / "payload.jsonl"
    # Trace time waits at each power-up until the payload has connected (a loaded machine may
    # take longer than a window to start a process): each window is the payload's to live in.
    config = bus_config(tmp_path, keys, trace, record, time_scale=scale, stop_at_end=True, hold_for_connect=True)
    bus = BusThread(config).start()
    try:
        wait_for(lambda: not bus.is_alive(), HANG_S, what="bus to stop at the trace end")
    finally:
        bus.stop()

    log = bl.read_log(bus.log_path)
    ons, offs, warnings = by_kind(log, bl.POWER_ON), by_kind(log, bl.POWER_OFF), by_kind(log, bl.WARNING)
    assert [e["cause"] for e in offs] == ["thermal", "fdir", "trace"]
    assert [e["origin"] for e in offs] == ["trace", "trace", "end"]
    # On the bus clock (trace time x scale, which stands still only while a boot is held).
    assert_on_schedule(ons, [t * scale for t in (0, 12, 21)])
    assert_on_schedule(offs, [t * scale for t in (10, 19, 28)])
    # Power alternates: each window's power-on comes before its cut, and the cut before the next on.
    assert [e.kind for e in log if e.kind in (bl.POWER_ON, bl.POWER_OFF)] == [bl.POWER_ON, bl.POWER_OFF] * 3
    # The clock stood still through each boot: from the payload's connection to its cut the bus
    # clock never ran ahead of the wall clock (utc).
    connects = by_kind(log, bl.PAYLOAD_CONNECTED)
    assert len(connects) == len(ons)
    for on, connected, off in zip(ons, connects, offs, strict=True):
        assert abs(bus_clock(connected) - bus_clock(on)) < 1e-6, (on, connected)
        assert off.utc - connected.utc >= bus_clock(off) - bus_clock(connected) - NEVER_EARLY_S, (connected, off)
    # One warning from the trace; a payload that connects during the lead gets it again then.
    warning, *repeats = warnings
    assert not warning["redelivered"] and all(w["redelivered"] for w in repeats)
    assert warning["cause"] == "thermal" and warning["lead_trace_s"] == 2.0
    assert_on_schedule([warning, offs[0]], [8 * scale, 10 * scale])

    # The payload's own account: a fresh process per window, each killed where the trace cuts it.
    seen = read_record(record)
    boot_of_pid = {r["pid"]: r["boot"] for r in seen if r["ev"] == "boot"}
    assert len({e["pid"] for e in ons}) == 3 and set(boot_of_pid) == {e["pid"] for e in ons}
    for cut in offs:
        assert dead(cut["pid"])
        own = [r for r in seen if r["boot"] == boot_of_pid[cut["pid"]]]
        booted_at = next(r["t"] for r in own if r["ev"] == "boot")
        last_tick = max(r["t"] for r in own if r["ev"] == "tick")
        # It lived into its window and nothing of it ran after the cut (the scripted payload never
        # exits on its own, so dead means killed).
        assert booted_at <= last_tick <= cut.utc + 0.05, (cut, cut.utc - last_tick)
    received = [r for r in seen if r["ev"] == "bus_tm" and r["type"] == "SHUTDOWN_WARNING"]
    # The warning reaches the payload of the first window (connected before it); never another boot.
    assert len(received) == 1, received
    for warned in received:
        assert warned["boot"] == 1 and warned["cause"] == "thermal"
        # The lead is in the payload's own (wall) seconds: it is how long it has left.
        assert warned["lead_time_s"] <= 2.0 * scale + 0.01
        assert warned["t"] < offs[0].utc, "warned before the cut"
    # Each boot was told the power is on.
    power_states = [r for r in seen if r["ev"] == "bus_tm" and r["type"] == "POWER_STATE"]
    assert len(power_states) == len(connects) == 3
    assert power_states[0]["boot"] == 1 and all(r["payload_on"] for r in power_states)


def test_telemetry_is_published_at_trace_rate_and_decimated(tmp_path, keys, context):
    scale = 0.01  # 100 trace seconds per wall second: 1 Hz telemetry must be thinned to 10 Hz
    trace = write_trace(tmp_path / "long.jsonl", 400, [window(0, 150, CutCause.POWER, 30.0), window(200, 400, None)])
    # The bus clock waits at each power-up until the payload has connected: the subscription below
    # (one handshake in this process) is then up long before the warning at 1.2 s of bus clock,
    # however slowly a loaded machine starts the payload process.
    config = bus_config(tmp_path, keys, trace, tmp_path / "payload.jsonl", time_scale=scale, hold_for_connect=True)

    def bus_rounds(got, kind):
        return [msg for h, msg in got if h.source_id == 0x0100 and isinstance(msg, kind)]

    with BusThread(config) as bus:
        sub = telemetry_subscriber(context, keys, bus.endpoints.telemetry)
        # Until the bus's clock is past the second window's start (250 trace s = 2.5 s of bus
        # clock) and several rounds of each report have arrived, however long a loaded machine
        # takes to get there (a round missed by a stalled machine is not made up; after the
        # trace's end the last sample is repeated once a second, so the count is always reached).
        packets = drain_until(
            sub,
            lambda got: (
                any(msg.trace_time_s >= 2.5 for msg in bus_rounds(got, m.ThermalReport))
                and all(len(bus_rounds(got, kind)) >= 3 for kind in (m.ThermalReport, m.FdirReport, m.PowerReport))
            ),
            "three rounds of each report and a THERMAL round stamped at or after 2.5 s of bus clock",
        )
    bus_tm = [(h, msg) for h, msg in packets if h.source_id == 0x0100]
    power = [msg for _, msg in bus_tm if isinstance(msg, m.PowerReport)]
    thermal = [msg for _, msg in bus_tm if isinstance(msg, m.ThermalReport)]
    fdir = [msg for _, msg in bus_tm if isinstance(msg, m.FdirReport)]
    times = [msg.trace_time_s for msg in thermal]
    assert times == sorted(times)
    # Bus clock = trace time × scale: consecutive rounds are ≥ 0.1 s of bus clock apart.
    # (Rounds are stamped when sent: a loaded machine delays one and the next comes sooner, so
    # the bound holds over the span, not between each pair.)
    assert len(times) - 1 <= (times[-1] - times[0]) / 0.1 + 1, times
    # Values come from the trace: the payload temperature there is 40 + (t mod 100).
    for msg in thermal:
        trace_s = msg.trace_time_s / scale
        expected = 40 + int(trace_s + 1e-9) % 100
        assert abs(msg.payload_temp_c - expected) <= 2.0 or expected <= 41, (trace_s, msg.payload_temp_c)
    warnings = [msg for _, msg in bus_tm if isinstance(msg, m.ShutdownWarning)]
    states = [msg for _, msg in bus_tm if isinstance(msg, m.PowerStateChange)]
    # The subscription heard the bus before the warning was due (150 - 30 trace s = 1.2 s of bus
    # clock; the clock held at the power-up until the payload connected), so the warning is there.
    assert min(msg.trace_time_s for msg in thermal + power + fdir) < 1.2, "subscribed too late to hear the warning"
    # One warning, for the one cut at 150 trace s (1.5 s of bus clock). A payload that connects
    # after it was issued (a loaded machine starts it late) gets it again at connect, and the
    # telemetry shows that redelivery too: same cut, a shorter lead.
    assert 1 <= len(warnings) <= 2, warnings
    # The lead is what is left when it is sent: the trace's 30 s (0.3 s of bus clock), less
    # however late a loaded machine sends it.
    assert 0 < warnings[0].lead_time_s <= 0.3 + 1e-6
    for warned in warnings:
        assert warned.cause == PowerCause.LOW_BATTERY
        assert abs(warned.trace_time_s + warned.lead_time_s - 150 * scale) < 0.01, warned
    assert [(s.payload_on, s.cause) for s in states][-2:] == [
        (False, PowerCause.LOW_BATTERY),
        (True, PowerCause.RESTORED),
    ]
    assert any(not p.payload_on for p in power) and any(p.payload_on for p in power)


HEARTBEAT_TIMEOUT_S = 3.0


def test_silent_payload_is_power_cycled_by_fdir(tmp_path, keys, context):
    trace = write_trace(tmp_path / "open.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path,
        keys,
        trace,
        record,
        time_scale=1.0,
        payload_args=("--hang-after", "0.5"),
        # silence this long is a hang; a live payload on a stalled machine (heartbeats every
        # 0.2 s) must not look like one, or FDIR counts a second fault
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        heartbeat_gap_log_s=0.5,
        fdir_off_s=0.2,
    )
    with BusThread(config) as bus:
        sub = telemetry_subscriber(context, keys, bus.endpoints.telemetry)
        wait_for(
            lambda: any(r["ev"] == "boot" and r["boot"] == 2 for r in read_record(record)),
            HANG_S,
            what="second boot after the FDIR power cycle",
        )
        wait_for(lambda: by_kind(bl.read_log(bus.log_path), bl.PAYLOAD_CONNECTED)[1:], HANG_S, what="reconnect")
        packets = drain_until(
            sub,
            lambda got: any(
                isinstance(msg, m.FdirReport) and msg.mode == FdirMode.NOMINAL and msg.fault_count == 1
                for _, msg in got
            ),
            "an FDIR report back in NOMINAL after the one fault",
        )
        reports = [msg for _, msg in packets if isinstance(msg, m.FdirReport)]
    log = bl.read_log(bus.log_path)
    gap = by_kind(log, bl.HEARTBEAT_GAP)
    assert gap and gap[0]["action"] == "power_cycle" and gap[0]["gap_s"] >= HEARTBEAT_TIMEOUT_S
    fdir = by_kind(log, bl.FDIR_ACTION)
    assert len(fdir) == 1 and "no heartbeat" in fdir[0]["reason"]
    offs = by_kind(log, bl.POWER_OFF)
    assert offs[0]["cause"] == "fdir" and offs[0]["origin"] == "fdir"
    assert dead(offs[0]["pid"]), "the hung payload was killed, not left running"
    assert reports and reports[-1].fault_count == 1 and "no heartbeat" in reports[-1].last_fault
    assert reports[-1].mode == FdirMode.NOMINAL, "back to nominal once the payload is up again"


def test_payload_that_exits_by_itself_is_power_cycled(tmp_path, keys):
    trace = write_trace(tmp_path / "open.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path, keys, trace, record, time_scale=1.0, payload_args=("--exit-after", "0.3"), fdir_off_s=0.2
    )
    with BusThread(config) as bus:
        wait_for(
            lambda: any(r["ev"] == "boot" and r["boot"] == 2 for r in read_record(record)), HANG_S, what="second boot"
        )
    log = bl.read_log(bus.log_path)
    exited = by_kind(log, bl.PAYLOAD_EXITED)
    assert exited and exited[0]["status"] == 3
    assert by_kind(log, bl.FDIR_ACTION)[0]["reason"].endswith("status 3")


def test_bus_drives_a_payload_through_the_ssh_driver(tmp_path, keys):
    """The ssh driver end to end, with `bash -c` standing in for `ssh HOST` (no ssh server here)."""
    scale = 0.1
    trace = write_trace(tmp_path / "two.jsonl", 18, [window(0, 8, CutCause.THERMAL), window(10, 18, None)])
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path,
        keys,
        trace,
        record,
        time_scale=scale,
        stop_at_end=True,
        power_driver="ssh",
        ssh_transport=["bash", "-c"],
        ssh_pidfile=str(tmp_path / "remote.pid"),
        payload_command=scripted_payload_command(record),
        hold_for_connect=True,  # a shell, then Python: slow to start on a loaded machine
    )
    bus = BusThread(config).start()
    try:
        wait_for(lambda: not bus.is_alive(), HANG_S, what="bus to stop at the trace end")
    finally:
        bus.stop()
    log = bl.read_log(bus.log_path)
    offs = by_kind(log, bl.POWER_OFF)
    assert [e["cause"] for e in offs] == ["thermal", "trace"]
    assert_on_schedule(offs, [8 * scale, 18 * scale])
    assert len(by_kind(log, bl.PAYLOAD_CONNECTED)) == 2, "each power-up's payload connected over the driver"
    assert len(by_kind(log, bl.POWER_ON)) == 2
    seen = read_record(record)
    pids = [r["pid"] for r in seen if r["ev"] == "boot"]
    assert pids and all(dead(p) for p in pids)
    # The kill runs through a shell, which a loaded machine may start a second late: what must hold
    # is that the first payload is gone before the second is powered (never two at once).
    first_boot_end = max(r["t"] for r in seen if r["boot"] == 1)
    assert first_boot_end < by_kind(log, bl.POWER_ON)[1].utc


def test_trace_actions_from_a_start_offset():
    import traces

    trace = traces.Trace.from_windows("t", 30, [window(0, 10, CutCause.THERMAL, 4.0), window(15, 30, None)])
    on, pending, actions = trace_actions(trace, 7.0)
    assert on and pending == (10.0, CutCause.THERMAL, 4.0)
    assert [(a.kind, a.trace_s) for a in actions] == [("cut", 10.0), ("power_on", 15.0), ("end", 30.0)]
    on, pending, actions = trace_actions(trace, 12.0)
    assert not on and pending is None
    clock = TraceClock(0.5, 12.0, t0=100.0)
    assert clock.at(15.0) == 101.5 and clock.trace_s(101.5) == 15.0 and clock.clock_s(101.5) == 7.5


def test_skip_idle_jumps_over_off_and_idle_spans_but_not_past_a_hold(tmp_path, keys):
    """Compressed long runs: a 2-hour trace at real-time scale takes seconds when the payload is
    off or idle, the cut timeline is unchanged, and the clock stops at a hold."""
    trace = write_trace(
        tmp_path / "long.jsonl",
        7200,
        [window(0, 1800, CutCause.POWER), window(3600, 5400, CutCause.THERMAL), window(6000, 7200, None)],
        telemetry=False,
    )
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path,
        keys,
        trace,
        record,
        payload_args=("--idle-housekeeping",),
        time_scale=1.0,
        stop_at_end=True,
        skip_idle=True,
        hold_at_s=(4000.0,),
    )
    bus = BusThread(config).start()
    try:
        wait_for(lambda: not bus.is_alive(), HANG_S, what="a 2-hour trace to finish by skipping idle spans")
    finally:
        bus.stop()
    log = bl.read_log(bus.log_path)
    offs = by_kind(log, bl.POWER_OFF)
    assert [e["cause"] for e in offs] == ["low_battery", "thermal", "trace"]
    assert [round(e.trace_s) for e in by_kind(log, bl.POWER_ON)] == [0, 3600, 6000]
    skips = by_kind(log, bl.CLOCK_SKIP)
    assert skips and {e["reason"] for e in skips} <= {"payload off", "payload idle"}
    assert any(abs(e["to_trace_s"] - 4000.0) < 1e-6 for e in skips)  # held at 4000 s, not jumped past
    assert all(not (e["from_trace_s"] < 4000.0 < e["to_trace_s"]) for e in skips)
