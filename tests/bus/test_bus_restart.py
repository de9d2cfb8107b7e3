"""The bus as a real process (`ow bus run`, via BusProcess): stored commands survive a SIGKILLed
bus, an uplink survives payload cuts and a bus restart in its middle, and nothing is delivered
(executed) twice — including commands the payload ran just before a cut took their reports."""

from __future__ import annotations

import os
import time

import psutil
from bus_testkit import (
    bus_config,
    drain,
    ground_station,
    read_record,
    telemetry_subscriber,
    wait_for,
    window,
    write_trace,
)

from common.wire import messages as m
from hil.bus import buslog as bl
from traces import CutCause

#: How long a wait may last before the test calls it a hang: waits end on events, and a loaded
#: machine may take many times the usual seconds to reach them.
HANG_S = 300.0


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def accepted(record):
    return [r for r in read_record(record) if r["ev"] == "accepted"]


def log_entries(config, kind=None, run=None):
    path = config.data_dir / bl.LOG_FILE
    if not path.exists():
        return []
    return [e for e in bl.read_log(path) if (kind is None or e.kind == kind) and (run is None or e.run == run)]


def confirmed_seqs(config) -> set[int]:
    return {e["request"]["seq"] for e in log_entries(config, bl.COMMAND_CONFIRMED)}


def test_stored_commands_survive_a_killed_bus_and_are_delivered_once(tmp_path, keys, context, bus_processes):
    # Off until trace second 100: the first bus only stores.
    trace = write_trace(tmp_path / "late.jsonl", 1000, [window(100, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    config = bus_config(tmp_path, keys, trace, record, time_scale=0.2)

    first = bus_processes(config)
    ground = ground_station(context, keys, first.endpoints.commands)
    sent = [ground.send(m.Ping(key=i))[1] for i in range(5)]
    wait_for(lambda: len(log_entries(config, bl.COMMAND_RECEIVED)) == 5, HANG_S, what="commands stored")
    first.kill()
    assert not accepted(record)

    # Restarted 1 s of wall time before the power-up (trace 95 at scale 0.2): a new ground
    # connection sends one more command, which also tells the bus where that station is now.
    second = bus_processes(bus_config(tmp_path, keys, trace, record, time_scale=0.2, start_at_s=95))
    ground2 = ground_station(context, keys, second.endpoints.commands)
    ground2.counter = ground.counter
    sent.append(ground2.send(m.Ping(key=5))[1])
    ground2.wait(lambda inbox: len([x for x in inbox if isinstance(x[1], m.Completed)]) == 6, HANG_S)
    assert [r["seq"] for r in accepted(record)] == sent, "in order, once each, the stored ones first"
    assert sorted(msg.key for _, msg in ground2.inbox if isinstance(msg, m.Pong)) == list(range(6))
    payload_pid = log_entries(config, bl.POWER_ON)[-1]["pid"]
    assert second.stop() == 0  # SIGTERM: cut the payload, flush, exit
    assert dead(payload_pid)
    stop = log_entries(config, bl.RUN_STOP)
    assert stop[-1]["reason"] == "SIGTERM" and stop[-1]["stored_commands"] == 0

    third = bus_processes(bus_config(tmp_path, keys, trace, record, time_scale=0.2, start_at_s=100))
    run3 = third.info["run"]
    wait_for(lambda: log_entries(config, bl.PAYLOAD_CONNECTED, run3), HANG_S, what="payload up under the third bus")
    time.sleep(0.5)
    third.stop()
    assert len(accepted(record)) == 6 and not [r for r in read_record(record) if r["ev"] == "replayed"]
    assert not log_entries(config, bl.COMMAND_FORWARDED, run3), "nothing is sent again"
    assert len(bl.runs(bl.read_log(config.data_dir / bl.LOG_FILE))) == 3


def test_uplink_survives_payload_cuts_and_a_bus_restart_in_its_middle(tmp_path, keys, context, bus_processes):
    scale = 0.25
    # On 3 s, off 1 s, repeatedly (0.75 s on, 0.25 s off on the wall clock).
    windows = [window(4 * k, 4 * k + 3, CutCause.THERMAL if k % 2 else CutCause.FDIR) for k in range(50)]
    trace = write_trace(tmp_path / "choppy.jsonl", 200, windows, telemetry=False)
    record = tmp_path / "payload.jsonl"
    # Each command takes the payload 30 ms while the ground sends one every 20 ms: commands are
    # in flight (sent, not yet executed or not yet reported) whenever a cut lands. Trace time
    # waits at each power-up until the payload has connected: a loaded machine may take longer
    # than a window to start a process, and the uplink must still get its 0.75 s per window.
    config = bus_config(
        tmp_path, keys, trace, record, time_scale=scale, payload_args=("--work-s", "0.03"), hold_for_connect=True
    )
    image = os.urandom(80 * 1024)
    chunks = m.ImageChunk.split("frame-0001.png", image, chunk_bytes=1024)

    first = bus_processes(config)
    ground = ground_station(context, keys, first.endpoints.commands)
    sent = []
    for chunk in chunks[:40]:
        sent.append(ground.send(chunk)[1])
        time.sleep(0.02)
    # The waits below bound a hang, not the expected time (seconds).
    wait_for(lambda: len(log_entries(config, bl.COMMAND_RECEIVED)) == 40, HANG_S, what="first half stored")
    run1 = first.info["run"]
    wait_for(lambda: log_entries(config, bl.POWER_OFF, run1), HANG_S, what="a cut in the first half")
    payload_pid = log_entries(config, bl.POWER_ON, run1)[-1]["pid"]
    first.kill()
    killed_at = time.time()
    wait_for(lambda: dead(payload_pid), HANG_S, what="the payload to die with the bus")

    second = bus_processes(config)
    ground2 = ground_station(context, keys, second.endpoints.commands)
    ground2.counter = ground.counter
    for chunk in chunks[40:]:
        sent.append(ground2.send(chunk)[1])
        time.sleep(0.02)
    wait_for(lambda: len(accepted(record)) >= len(chunks), HANG_S, what="every chunk executed")
    # Once the bus holds every chunk as delivered it sends none again: anything executed twice
    # has shown up by then.
    wait_for(lambda: confirmed_seqs(config) >= set(sent), HANG_S, what="every chunk confirmed")
    second.stop()

    got = [(r["source"], r["seq"]) for r in accepted(record)]
    assert len(got) == len(set(got)), "no chunk executed twice"
    assert sorted(seq for _, seq in got) == sorted(sent), "no chunk lost"
    redelivered = [e for e in log_entries(config, bl.COMMAND_FORWARDED) if e["redelivery"]]
    assert redelivered, "cuts caught commands in flight, and they were sent again"
    boots = {r["boot"] for r in read_record(record) if r["ev"] == "boot"}
    assert len(boots) >= 3
    seen = read_record(record)
    boot_at_kill = max(r["boot"] for r in seen if r["ev"] == "boot" and r["t"] < killed_at)
    last_tick = max(r["t"] for r in seen if r["boot"] == boot_at_kill)
    assert last_tick <= killed_at + 0.3, "the payload died with the bus"


def test_commands_executed_just_before_a_cut_are_not_run_again_and_not_reported_as_replays(
    tmp_path, keys, context, bus_processes
):
    trace = write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    # First boot: from 1 s after boot the payload executes commands but its reports never leave.
    config = bus_config(
        tmp_path, keys, trace, record, time_scale=1.0, heartbeat_timeout_s=60, payload_args=("--mute-after", "1.0")
    )
    first = bus_processes(config)
    ground = ground_station(context, keys, first.endpoints.commands)
    # The payload notes when it goes mute: commands sent after that are executed unreported,
    # however late a loaded machine gets it there.
    wait_for(lambda: [r for r in read_record(record) if r["ev"] == "muted"], HANG_S, what="payload mute")
    sent = [ground.send(m.Ping(key=i))[1] for i in range(3)]
    wait_for(lambda: len(accepted(record)) == 3, HANG_S, what="executed without a report")
    assert not [x for x in ground.collect(0.3) if isinstance(x[1], m.Accepted)]
    first.kill()

    second = bus_processes(config)
    published = telemetry_subscriber(context, keys, second.endpoints.telemetry)
    ground2 = ground_station(context, keys, second.endpoints.commands)
    ground2.counter = ground.counter
    sent.append(ground2.send(m.Ping(key=3))[1])
    ground2.wait(lambda inbox: any(isinstance(x[1], m.Pong) and x[1].key == 3 for x in inbox), HANG_S)
    run2 = second.info["run"]
    wait_for(lambda: len(log_entries(config, bl.COMMAND_CONFIRMED, run2)) == 4, HANG_S, what="all confirmed")
    ground2.collect(0.3)
    second.stop()

    assert [r["seq"] for r in accepted(record)] == sent, "each executed exactly once"
    assert len([r for r in read_record(record) if r["ev"] == "replayed"]) == 3, "the redeliveries were refused"
    hows = sorted(e["how"] for e in log_entries(config, bl.COMMAND_CONFIRMED, run2))
    assert hows == ["accepted"] + ["redelivery_duplicate"] * 3
    assert sum(e["redelivery"] for e in log_entries(config, bl.COMMAND_FORWARDED, run2)) == 3
    assert not [msg for _, msg in ground2.inbox if isinstance(msg, m.Rejected)], (
        "the ground is not told its executed commands were replays"
    )
    # Nor on the telemetry link, where a ground also listens (the chunks of an uplink cut after
    # they were stored and before their ACCEPTED left came back there as refusals: the uplink
    # gave up after three).
    seen = [msg for _, msg in drain(published, 0.5)]
    published.close(linger=0)
    assert any(isinstance(msg, m.Pong) and msg.key == 3 for msg in seen), "the subscriber heard the payload"
    assert not [msg for msg in seen if isinstance(msg, m.Rejected)], "redelivery duplicates stay in the bus"
