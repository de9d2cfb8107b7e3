"""Relay: ground telecommands reach the payload in order (stored while it is off), reports come
back to the station that sent the command, bad packets are rejected by the bus with their code,
and only the right keys may speak on each link."""

from __future__ import annotations

import shutil

import msgpack
import pytest
import zmq
from bus_testkit import (
    HANG_S,
    bus_config,
    drain,
    drain_until,
    ground_station,
    read_record,
    telemetry_subscriber,
    wait_for,
    window,
    write_trace,
)

from common.wire import AckFlags, Apid, NodeId, ResponseCode, decode, encode
from common.wire import messages as m
from common.wire.link import LinkAuthError, LinkTimeout, client_socket, init_keys, recv_packet, send_packet
from common.wire.packet import PacketType, frame
from hil.bus import BusThread
from hil.bus import buslog as bl

NOTHING_WAIT_S = 1.5


def accepted(record, boot=None):
    return [r for r in read_record(record) if r["ev"] == "accepted" and (boot is None or r["boot"] == boot)]


def reports_for(inbox, seq, cls):
    return [msg for _, msg in inbox if isinstance(msg, cls) and msg.tc_seq == seq]


@pytest.fixture
def always_on_trace(tmp_path):
    return write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)


def wait_connected(bus: BusThread, timeout_s: float = HANG_S) -> None:
    wait_for(
        lambda: bl.read_log(bus.log_path) and any(e.kind == bl.PAYLOAD_CONNECTED for e in bl.read_log(bus.log_path)),
        timeout_s,
        what="payload connected",
    )


def test_commands_sent_while_the_payload_is_off_arrive_in_order_after_power_up(tmp_path, keys, context):
    scale = 0.5
    # Off until trace second 10 (5 s wall), then on. The trace alone decides when the power comes
    # on (the bus has no gate a test could hold), so the off span is what the commands below must
    # arrive within: seconds, many times what connecting and sending takes even on a loaded machine.
    trace = write_trace(tmp_path / "late.jsonl", 1000, [window(10, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    with BusThread(bus_config(tmp_path, keys, trace, record, time_scale=scale)) as bus:
        ground = ground_station(context, keys, bus.endpoints.commands)
        sent = []
        for i in range(8):
            message = (
                m.Ping(key=100 + i)
                if i % 3
                else m.UplinkTask(
                    task_id=f"task-{i}", prompt="count the ships", images=(), max_new_tokens=4, priority=1
                )
            )
            sent.append((ground.send(message)[1], message))
        ground.wait(lambda inbox: len([x for x in inbox if isinstance(x[1], m.Completed)]) == len(sent), HANG_S)
    got = accepted(record)
    assert [r["seq"] for r in got] == [seq for seq, _ in sent], "in order, each exactly once"
    assert [r["task_id"] for r in got] == [getattr(msg, "task_id", None) for _, msg in sent]
    for seq, _message in sent:
        assert len(reports_for(ground.inbox, seq, m.Accepted)) == 1
        assert len(reports_for(ground.inbox, seq, m.Completed)) == 1
    pongs = sorted(msg.key for _, msg in ground.inbox if isinstance(msg, m.Pong))
    assert pongs == sorted(msg.key for _, msg in sent if isinstance(msg, m.Ping))
    log = bl.read_log(bus.log_path)
    received = [e for e in log if e.kind == bl.COMMAND_RECEIVED]
    assert [e["request"]["seq"] for e in received] == [seq for seq, _ in sent]
    assert all(e["payload_on"] is False for e in received)
    # Nothing reached the unpowered payload: the first forward and every execution came after the
    # power-up (the bus's and the payload's own account, not a look at a moment in between).
    first_forward = next(e for e in log if e.kind == bl.COMMAND_FORWARDED)
    power_on = next(e for e in log if e.kind == bl.POWER_ON)
    assert first_forward.wall_s > power_on.wall_s
    assert all(r["boot"] == 1 and r["t"] >= power_on.utc for r in got)
    assert power_on.clock_s is not None and power_on.clock_s >= 10 * scale - 1e-3, "never powered early"
    assert {e["how"] for e in log if e.kind == bl.COMMAND_CONFIRMED} == {"accepted"}


def test_reports_go_back_to_the_station_that_sent_the_command(tmp_path, keys, context, always_on_trace):
    record = tmp_path / "payload.jsonl"
    with BusThread(bus_config(tmp_path, keys, always_on_trace, record)) as bus:
        wait_connected(bus)
        ground = ground_station(context, keys, bus.endpoints.commands)
        station2 = ground_station(context, keys, bus.endpoints.commands, name="station2", source_id=0x0010)
        sub = telemetry_subscriber(context, keys, bus.endpoints.telemetry)
        # The subscription is live once the payload's heartbeats come through it.
        published = drain_until(sub, lambda got: any(isinstance(msg, m.Heartbeat) for _, msg in got), "a heartbeat")
        for i in range(3):
            ground.send(m.Ping(key=1000 + i))
            station2.send(m.Ping(key=2000 + i))
        for station in (ground, station2):
            station.wait(lambda inbox: len([x for x in inbox if isinstance(x[1], m.Completed)]) == 3, HANG_S)
        # Anything that would go astray (another station's reports) has had time to arrive.
        ground.collect(0.3)
        station2.collect(0.3)
        published += drain(sub, 0.5)
    for station, source, keys_expected in ((ground, 1, {1000, 1001, 1002}), (station2, 0x0010, {2000, 2001, 2002})):
        verifications = [msg for _, msg in station.inbox if isinstance(msg, m.Verification)]
        assert {msg.tc_source for msg in verifications} == {source}, "no other station's reports"
        assert {msg.key for _, msg in station.inbox if isinstance(msg, m.Pong)} == keys_expected
        assert not [msg for _, msg in station.inbox if isinstance(msg, m.Heartbeat)], "telemetry goes to the PUB"
    # Everything the payload said is on the telemetry PUB too, whoever asked.
    published_pongs = {msg.key for _, msg in published if isinstance(msg, m.Pong)}
    assert published_pongs <= {1000, 1001, 1002, 2000, 2001, 2002}
    assert any(isinstance(msg, m.Heartbeat) for _, msg in published)


def test_malformed_and_misaddressed_packets_are_rejected_by_the_bus_with_their_code(
    tmp_path, keys, context, always_on_trace
):
    record = tmp_path / "payload.jsonl"
    with BusThread(bus_config(tmp_path, keys, always_on_trace, record)) as bus:
        wait_connected(bus)
        ground = ground_station(context, keys, bus.endpoints.commands)
        good = encode(m.Ping(key=1), Apid.PAYLOAD, 10, source_id=NodeId.GROUND)
        cases = [
            ("bad crc", good[:-1] + bytes([good[-1] ^ 0x01]), ResponseCode.BAD_CRC, 10),
            ("three bytes", b"\x18\x20\x00", ResponseCode.MALFORMED_PACKET, 0),
            (
                "telemetry on the command link",
                encode(m.Heartbeat(boot_count=1, uptime_s=1.0), Apid.PAYLOAD, 11, source_id=NodeId.GROUND),
                ResponseCode.WRONG_PACKET_TYPE,
                11,
            ),
            (
                "addressed to the bus",
                encode(m.Ping(key=1), Apid.BUS, 12, source_id=NodeId.GROUND),
                ResponseCode.WRONG_APID,
                12,
            ),
            (
                "unknown opcode",
                frame(PacketType.TC, Apid.PAYLOAD, 13, 0x01FF, msgpack.packb({}), source_id=1),
                ResponseCode.UNKNOWN_COMMAND,
                13,
            ),
            (
                "missing field",
                frame(PacketType.TC, Apid.PAYLOAD, 14, 0x0101, msgpack.packb({}), source_id=1),
                ResponseCode.MISSING_FIELD,
                14,
            ),
            (
                "posing as the payload",
                encode(m.Ping(key=1), Apid.PAYLOAD, 15, source_id=NodeId.PAYLOAD),
                ResponseCode.NOT_AUTHORIZED,
                15,
            ),
        ]
        for _, packet, _, _ in cases:
            ground.send_raw(packet)
        ground.wait(lambda inbox: len([x for x in inbox if isinstance(x[1], m.Rejected)]) == len(cases), HANG_S)
        header_by_code = {msg.code: (header, msg) for header, msg in ground.inbox if isinstance(msg, m.Rejected)}
        for name, _, code, seq in cases:
            assert code in header_by_code, name
            header, report = header_by_code[code]
            assert header.source_id == NodeId.BUS and header.apid == Apid.BUS, "the bus answers for itself"
            assert report.tc_seq == seq, name
        # The payload got none of them; a good command still goes through afterwards.
        ground.send(m.Ping(key=77))
        ground.wait(lambda inbox: any(isinstance(x[1], m.Pong) and x[1].key == 77 for x in inbox), HANG_S)
    assert [r["type"] for r in accepted(record)] == ["PING"]
    log = bl.read_log(bus.log_path)
    assert sorted(e["code"] for e in log if e.kind == bl.COMMAND_REJECTED) == sorted(c[2].name for c in cases)


def test_clients_without_the_right_key_cannot_command(tmp_path, keys, context, always_on_trace):
    record = tmp_path / "payload.jsonl"
    rogue = init_keys(tmp_path / "rogue", clients=("ground",))
    shutil.copyfile(keys.server_public, rogue.server_public)  # knows the bus, is not known by it
    with BusThread(bus_config(tmp_path, keys, always_on_trace, record)) as bus:
        wait_connected(bus)
        with pytest.raises((LinkAuthError, LinkTimeout)):
            client_socket(context, zmq.DEALER, rogue, "ground", bus.endpoints.commands, handshake_timeout_s=2)
        # Without waiting for the handshake: whatever it sends goes nowhere and nothing comes back.
        intruder = client_socket(context, zmq.DEALER, rogue, "ground", bus.endpoints.commands)
        intruder.send(encode(m.Ping(key=666), Apid.PAYLOAD, 500, source_id=NodeId.GROUND), flags=zmq.NOBLOCK)
        assert recv_packet(intruder, timeout_s=NOTHING_WAIT_S) is None

        # The payload's own key is authorized, but not for commanding.
        impostor = ground_station(context, keys, bus.endpoints.commands, name="payload")
        impostor.send(m.Ping(key=667))
        impostor.wait(lambda inbox: any(isinstance(x[1], m.Rejected) for x in inbox), HANG_S)
        ((_, report),) = [x for x in impostor.inbox if isinstance(x[1], m.Rejected)]
        assert report.code == ResponseCode.NOT_AUTHORIZED

        # A ground key on the payload link is refused too, and cannot pose as the payload.
        sub = telemetry_subscriber(context, keys, bus.endpoints.telemetry)
        # Listening for real (the payload's heartbeats come through) before the fake one is sent.
        drain_until(sub, lambda got: any(isinstance(msg, m.Heartbeat) for _, msg in got), "a heartbeat")
        fake = client_socket(context, zmq.DEALER, keys, "ground", bus.endpoints.payload, handshake_timeout_s=HANG_S)
        send_packet(fake, encode(m.Heartbeat(boot_count=99, uptime_s=1.0), Apid.PAYLOAD, 0, source_id=NodeId.PAYLOAD))
        answer = recv_packet(fake, timeout_s=HANG_S)
        assert answer is not None
        assert decode(answer.packet)[1].code == ResponseCode.NOT_AUTHORIZED
        published = drain(sub, 0.5)
        assert not [msg for _, msg in published if isinstance(msg, m.Heartbeat) and msg.boot_count == 99]
    assert not accepted(record), "neither the rogue nor the impostor got a command through"
    kinds = [(e["link"], e["client"]) for e in bl.read_log(bus.log_path) if e.kind == bl.LINK_REFUSED]
    assert ("commands", "payload") in kinds and ("payload", "ground") in kinds


def test_a_replayed_command_is_rejected(tmp_path, keys, context, always_on_trace):
    record = tmp_path / "payload.jsonl"
    # The payload connects only when the test opens the gate: until then the first copy waits in
    # the bus's store, however long a loaded machine takes between the two sends.
    gate = tmp_path / "connect"
    config = bus_config(
        tmp_path, keys, always_on_trace, record, boot_timeout_s=HANG_S, payload_args=("--connect-after", str(gate))
    )
    with BusThread(config) as bus:
        ground = ground_station(context, keys, bus.endpoints.commands)
        packet, seq = ground.send(m.Ping(key=5))
        ground.send_raw(packet)  # while the first copy waits in the bus's store
        ground.wait(lambda inbox: any(isinstance(x[1], m.Rejected) for x in inbox), HANG_S)
        ((header, early),) = [x for x in ground.inbox if isinstance(x[1], m.Rejected)]
        assert early.code == ResponseCode.REPLAYED_SEQUENCE and header.source_id == NodeId.BUS
        gate.touch()
        ground.wait(lambda inbox: any(isinstance(x[1], m.Completed) for x in inbox), HANG_S)
        ground.send_raw(packet)  # after the payload executed it: the payload's replay guard answers
        ground.wait(lambda inbox: len([x for x in inbox if isinstance(x[1], m.Rejected)]) == 2, HANG_S)
        header, late = [x for x in ground.inbox if isinstance(x[1], m.Rejected)][1]
        assert late.code == ResponseCode.REPLAYED_SEQUENCE and header.source_id == NodeId.PAYLOAD
        assert late.tc_seq == seq
    assert len(accepted(record)) == 1


def test_command_without_acceptance_report_is_confirmed_after_the_payload_lived_on(
    tmp_path, keys, context, always_on_trace
):
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path, keys, always_on_trace, record, confirm_after_s=0.5, payload_args=("--honour-ack-flags",)
    )
    with BusThread(config) as bus:
        wait_connected(bus)
        ground = ground_station(context, keys, bus.endpoints.commands)
        ground.send(m.Ping(key=9), ack=AckFlags.NONE)
        ground.wait(lambda inbox: any(isinstance(x[1], m.Pong) for x in inbox), HANG_S)
        confirmed = wait_for(
            lambda: [e for e in bl.read_log(bus.log_path) if e.kind == bl.COMMAND_CONFIRMED],
            HANG_S,
            what="confirmation",
        )
        forwarded = next(e for e in bl.read_log(bus.log_path) if e.kind == bl.COMMAND_FORWARDED)
    assert not [x for x in ground.inbox if isinstance(x[1], m.Accepted)]
    assert confirmed[0]["how"] == "assumed"
    assert confirmed[0].wall_s - forwarded.wall_s >= 0.5
    assert len(accepted(record)) == 1
