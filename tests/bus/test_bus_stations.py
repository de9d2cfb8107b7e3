"""Ground stations at the bus: a key is bound to its source id (finding 7b), a revoked key's open
connections are refused and closed (finding 7a), and one station's flood neither fills the bus
nor delays another station's command (finding 6)."""

from __future__ import annotations

import pytest
import zmq
from bus_testkit import HANG_S, bus_config, ground_station, read_record, wait_for, window, write_trace

from common.wire import Apid, EventId, NodeId, ResponseCode, SequenceCounter, decode
from common.wire import messages as m
from common.wire.link import LinkTimeout, client_socket, init_keys, monitor_socket, recv_packet
from hil.bus import BusThread
from hil.bus import buslog as bl

NOTHING_WAIT_S = 1.5


@pytest.fixture
def always_on_trace(tmp_path):
    return write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)


def wait_connected(bus: BusThread, timeout_s: float = HANG_S) -> None:
    wait_for(lambda: bus.bus.payload_rid is not None, timeout_s, what="payload connected")


def rejected(inbox, seq=None):
    return [msg for _, msg in inbox if isinstance(msg, m.Rejected) and (seq is None or msg.tc_seq == seq)]


def disconnected(monitor: zmq.Socket) -> bool:
    from zmq.utils.monitor import recv_monitor_message

    while monitor.poll(50):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def test_source_binding_and_key_revocation(tmp_path, context, always_on_trace):
    keys = init_keys(tmp_path / "keys", clients=("ground", "station2", "station3", "payload"))
    keys.binding_path("station3").unlink()  # authorized, but bound to no source id
    record = tmp_path / "payload.jsonl"
    with BusThread(bus_config(tmp_path, keys, always_on_trace, record)) as bus:
        wait_connected(bus)
        ground = ground_station(context, keys, bus.endpoints.commands)
        station2 = ground_station(context, keys, bus.endpoints.commands, name="station2", source_id=0x0010)
        station3 = ground_station(context, keys, bus.endpoints.commands, name="station3", source_id=0x0012)

        # (b) The source id must be the sender key's binding.
        posing = ground_station(context, keys, bus.endpoints.commands, name="station2", source_id=NodeId.GROUND)
        posing.counter = SequenceCounter({int(Apid.PAYLOAD): 500})  # apart from ground's own numbers
        _, posed = posing.send(m.Ping(key=1))
        _, unbound = station3.send(m.Ping(key=2))
        posing.wait(lambda inbox: rejected(inbox, posed), HANG_S)
        station3.wait(lambda inbox: rejected(inbox, unbound), HANG_S)
        (refusal,) = rejected(posing.inbox, posed)
        assert refusal.code == ResponseCode.SOURCE_NOT_BOUND and "bound to 0x0010" in refusal.reason
        (refusal,) = rejected(station3.inbox, unbound)
        assert refusal.code == ResponseCode.SOURCE_NOT_BOUND and "ow ground keys authorize station3" in refusal.reason
        station2.send(m.Ping(key=3))
        station2.wait(lambda inbox: any(isinstance(x[1], m.Pong) and x[1].key == 3 for x in inbox), HANG_S)

        # (a) Revocation: station2's connections -- one that has spoken, one that has not, a
        # telemetry subscription -- and an observer with another key.
        idle = ground_station(context, keys, bus.endpoints.commands, name="station2", source_id=0x0010)
        idle.counter = station2.counter  # one station, one sequence counter
        listener = client_socket(
            context, zmq.SUB, keys, "station2", bus.endpoints.telemetry, handshake_timeout_s=HANG_S
        )
        observer = client_socket(context, zmq.SUB, keys, "ground", bus.endpoints.telemetry, handshake_timeout_s=HANG_S)
        monitors = {
            name: monitor_socket(sock, zmq.EVENT_DISCONNECTED)
            for name, sock in (("spoke", station2.sock), ("subscribed", listener))
        }
        wait_for(lambda: len(bus.bus.connections["telemetry"]) >= 2, HANG_S, what="both subscriptions seen")
        keys.authorized_dir.joinpath("station2.key").unlink()

        def revoked_event():
            received = recv_packet(observer, timeout_s=0.1)
            if received is None:
                return False
            message = decode(received.packet)[1]
            return (
                isinstance(message, m.Event) and message.event_id == EventId.KEY_REVOKED and "station2" in message.text
            )

        wait_for(revoked_event, HANG_S, interval_s=0, what="KEY_REVOKED")
        for name, monitor in monitors.items():
            wait_for(lambda monitor=monitor: disconnected(monitor), HANG_S, interval_s=0, what=f"{name} closed")

        # The connection the bus had not heard from: its next command is refused, then closed.
        _, late = idle.send(m.Ping(key=4))
        idle.wait(lambda inbox: rejected(inbox, late), HANG_S)
        assert rejected(idle.inbox, late)[0].code == ResponseCode.NOT_AUTHORIZED
        # The closed one reaches nothing any more (its reconnection fails the handshake).
        try:
            _, after = station2.send(m.Ping(key=5))
        except LinkTimeout:  # no connection left to send on at all
            after = None
        assert not [x for x in station2.collect(NOTHING_WAIT_S) if isinstance(x[1], m.Pong)]
        # Others carry on.
        ground.send(m.Ping(key=6))
        ground.wait(lambda inbox: any(isinstance(x[1], m.Pong) and x[1].key == 6 for x in inbox), HANG_S)
    executed = {(r["source"], r["seq"]) for r in read_record(record) if r["ev"] == "accepted"}
    assert (0x0010, late) not in executed and (0x0010, after) not in executed
    assert (NodeId.GROUND, posed) not in executed and (0x0012, unbound) not in executed
    log = bl.read_log(bus.log_path)
    closed = [e for e in log if e.kind == bl.LINK_CLOSED and e["client"] == "station2"]
    assert {e["link"] for e in closed} == {"commands", "telemetry"}
    assert len([e for e in log if e.kind == bl.BUS_EVENT and e["event"] == "KEY_REVOKED"]) == 1


def test_a_flood_from_one_station_is_bounded_and_another_station_goes_next(tmp_path, keys, context, always_on_trace):
    """Finding 6: a station flooding PINGs as fast as it can is refused past its rate and its
    quota; the store, the run log and the refusals' log lines stay bounded; the other station's
    PING is the next command the bus forwards, ahead of the flooder's backlog."""
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path,
        keys,
        always_on_trace,
        record,
        payload_args=("--work-s", "0.02"),  # a payload that answers some 50 commands a second
        max_in_flight=8,
        station_rate=100.0,
        station_burst=1000,
        station_quota=600,
        throttle_event_s=600.0,
        log_segment_bytes=128 << 10,
        log_segments=8,
    )
    flood = 3000
    with BusThread(config) as bus:
        wait_connected(bus)
        flooder = ground_station(context, keys, bus.endpoints.commands, name="station2", source_id=0x0010)
        other = ground_station(context, keys, bus.endpoints.commands)
        for key in range(flood):
            flooder.send(m.Ping(key=key))

        def taken_in() -> bool:  # every packet of the flood stored or refused (read from another thread)
            try:
                refused = sum(n for (who, _), n in list(bus.bus.refusals.items()) if who == "station2")
            except RuntimeError:  # the counter grew while we read it
                return False
            return refused + bus.bus.store.next_id - 1 >= flood

        wait_for(taken_in, HANG_S, what="the flood taken in (stored or refused)")
        assert bus.bus.store.count_for("station2") <= config.station_quota
        other.send(m.Ping(key=99_999))
        other.wait(lambda inbox: any(isinstance(x[1], m.Pong) and x[1].key == 99_999 for x in inbox), HANG_S)
        flooder.collect(0.2)
    log = bl.read_log(bus.log_path)
    # Bounded: the flooder was refused, and its refusals were counted, not logged one by one.
    codes = {msg.code for msg in rejected(flooder.inbox)}
    assert codes <= {ResponseCode.RATE_LIMITED, ResponseCode.STATION_QUOTA} and codes
    refused = sum(n for (who, _), n in bus.bus.refusals.items() if who == "station2")
    assert refused >= flood - config.station_burst - config.station_quota
    in_full = [e for e in log if e.kind == bl.COMMAND_REJECTED and e["sender"] == "station2"]
    counted = sum(e["count"] for e in log if e.kind == bl.REJECTIONS_SUPPRESSED and e["sender"] == "station2")
    assert len(in_full) <= 40 and len(in_full) + counted == refused
    throttled = [e for e in log if e.kind == bl.BUS_EVENT and e["event"] == "STATION_THROTTLED"]
    assert len(throttled) == 1 and throttled[0]["station"] == "station2"
    segments = [bl.segment_path(bus.log_path, i) for i in range(config.log_segments + 2)]
    kept = [p for p in segments if p.exists()]
    assert len(kept) <= config.log_segments and bus.bus.buslog.rotations > 0
    assert all(p.stat().st_size <= config.log_segment_bytes + 4096 for p in kept)
    # Fair: between the other station's PING arriving and going out, the flooder's backlog
    # (hundreds stored) got at most what was already in flight.
    arrived = next(
        i for i, e in enumerate(log) if e.kind == bl.COMMAND_RECEIVED and e["request"]["source"] == NodeId.GROUND
    )
    sent = next(
        i for i, e in enumerate(log) if e.kind == bl.COMMAND_FORWARDED and e["request"]["source"] == NodeId.GROUND
    )
    overtaking = [e for e in log[arrived:sent] if e.kind == bl.COMMAND_FORWARDED]
    backlog = log[arrived]["queued"]
    assert backlog > 3 * config.max_in_flight, "the flooder had a backlog to overtake"
    assert len(overtaking) <= config.max_in_flight
    # The window's last slot stays free for a station with nothing in flight: the flooder alone
    # never has the whole window, so the other station's PING never waits for it to drain.
    flood_in_flight, most = 0, 0
    for e in log:
        if e.kind in (bl.COMMAND_FORWARDED, bl.COMMAND_CONFIRMED) and e["request"]["source"] == 0x0010:
            flood_in_flight += 1 if e.kind == bl.COMMAND_FORWARDED else -1
            most = max(most, flood_in_flight)
    assert 0 < most <= config.max_in_flight - 1
