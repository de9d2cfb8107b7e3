"""docs/wire-protocol.md against real packets.

The independent decoder (wire_decoder.py, written from the document, no project import) decodes
every telecommand of the shipped bus log and every packet a real bus and a real payload publish
on the telemetry link while a ground station works with them, and must agree with
`common.wire` on each; bits flipped in real packets must get the code §4 gives.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from pathlib import Path

import pytest
import zmq
from wire_decoder import APIDS, DOC, FIELDS, MESSAGE_TYPES, Undecodable, decode

import traces
from common.wire import WireError
from common.wire import decode as project_decode
from common.wire.link import Endpoints, KeyLayout, client_socket, init_keys, recv_packet
from ground.client import GroundClient, GroundOptions
from ground.errors import CommandRejected
from hil.bus import BusConfig, BusProcess
from traces.model import CutCause, PowerWindow, TelemetrySample

ROOT = Path(__file__).resolve().parents[2]
BUS_LOGS = sorted((ROOT / "hil" / "replays").glob("*.jsonl"))


def _logged_telecommands(logs: list[Path] = BUS_LOGS) -> list[tuple[dict, bytes]]:
    """(log entry, packet) of every telecommand a bus log kept (`command_received`)."""
    found = []
    for path in logs:
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            if entry.get("kind") == "command_received" and entry.get("packet"):
                found.append((entry, base64.b64decode(entry["packet"])))
    return found


def _same_message(packet, data: bytes) -> None:
    """The independent decoder and common.wire read the same packet the same way."""
    header, message = project_decode(data)
    assert packet.type_number == int(header.message_type) and packet.apid == header.apid
    assert packet.seq == header.seq and packet.source_id == header.source_id
    assert packet.telecommand == message.is_command()
    wire_form = message.pack()
    assert set(packet.body) <= set(wire_form)
    for key, value in packet.body.items():
        expected = wire_form[key]
        assert value == (list(expected) if isinstance(expected, tuple) else expected), (packet.type_name, key)


def _flip_code(data: bytes, position: int) -> str:
    """§4: the length check comes before the CRC; everything else is the CRC's."""
    return "BAD_LENGTH" if position in (4, 5) else "BAD_CRC"


def _check_flips(data: bytes, positions) -> int:
    count = 0
    for position in positions:
        for bit in range(8):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            expected = _flip_code(data, position)
            with pytest.raises(Undecodable) as ours:
                decode(bytes(damaged))
            with pytest.raises(WireError) as theirs:
                project_decode(bytes(damaged))
            where = f"{MESSAGE_TYPES[int.from_bytes(data[8:10], 'big')][0]} byte {position} bit {bit}"
            assert ours.value.code == expected == theirs.value.code.name, where
            count += 1
    return count


def _positions(data: bytes) -> list[int]:
    """Every byte of a small packet; the headers, the CRC and a spread of the body of a big one."""
    if len(data) <= 256:
        return list(range(len(data)))
    body = range(22, len(data) - 2)
    return list(range(22)) + list(body[:: len(body) // 64]) + [len(data) - 2, len(data) - 1]


def test_the_documents_tables_are_read():
    assert len(MESSAGE_TYPES) >= 30 and all(FIELDS[t] or MESSAGE_TYPES[t][0] in _EMPTY for t in MESSAGE_TYPES)
    assert "bool" in DOC and "`bool` a msgpack boolean" in DOC


_EMPTY = {"STATUS", "LIST_QUARANTINE", "LIST_LOST_TASKS", "PAYLOAD_RETRY"}


def test_the_shipped_bus_logs_telecommands_decode_as_documented():
    commands = _logged_telecommands()
    assert len(commands) >= 16, "the shipped bus log lost its telecommands"
    flips = 0
    for entry, data in commands:
        packet = decode(data)
        assert packet.telecommand and packet.type_name == entry["type"]
        request = entry["request"]
        assert (packet.apid, packet.source_id, packet.seq) == (request["apid"], request["source"], request["seq"])
        _same_message(packet, data)
        flips += _check_flips(data, _positions(data))
    assert {decode(d).type_name for _, d in commands} >= {"IMAGE_QUERY", "IMAGE_CHUNK", "UPLINK_TASK"}
    assert flips > 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trace(path: Path) -> str:
    """On for 3 s, a thermal cut announced 1 s ahead, off 2 s, then on: the bus publishes its
    warning and both power state changes while the payload boots and works."""
    windows = [PowerWindow(0.0, 3.0, CutCause.THERMAL, 1.0), PowerWindow(5.0, 600.0, None, 0.0)]
    telemetry = [TelemetrySample(float(t), 28.0, 0.8, 40.0 + t / 60, 12.0) for t in range(601)]
    trace = traces.Trace.from_windows(
        "formats",
        600.0,
        windows,
        telemetry=telemetry,
        telemetry_period_s=1.0,
        reference_request_s=10.0,
        description="wire format test: one warned cut",
        source={"kind": "manual"},
        assumptions=["test"],
    )
    traces.dump(trace, path)
    return str(path)


@pytest.mark.slow
def test_real_telemetry_decodes_as_documented(model_dirs, tmp_path):
    """A real bus (`ow bus run`) powering a real payload (`ow flight run`), a ground station
    working with them, and every packet published on the telemetry link decoded from the
    document: bus telemetry, the payload's reports, replies and its unprompted TASK_RESULT."""
    keys = str(tmp_path / "keys")
    init_keys(keys)
    endpoints = Endpoints(*(f"tcp://127.0.0.1:{_free_port()}" for _ in range(3)))
    config = BusConfig(
        trace=_trace(tmp_path / "trace.jsonl"),
        data_dir=str(tmp_path / "bus"),
        keys_dir=keys,
        endpoints=endpoints,
        model=model_dirs["qwen3-vl"],
        flight_args=["--chunk", "16", "--group", "2", "--decode-every", "2", "--threads", "1", "--device", "cpu"],
        fdir_off_s=0.5,
        heartbeat_timeout_s=60.0,
    )
    context = zmq.Context()
    captured: list[bytes] = []
    bus = BusProcess(config).start()
    try:
        sub = client_socket(context, zmq.SUB, KeyLayout(Path(keys)), "ground", endpoints.telemetry)

        def drain(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                received = recv_packet(sub, timeout_s=0.05)
                if received is not None:
                    captured.append(received.packet)

        image = sorted((ROOT / "hil" / "samples").glob("*.png"))[0]
        with GroundClient(
            keys, GroundOptions(endpoints=endpoints, timeout_s=20.0, retries=20, notify=lambda s: None)
        ) as ground:
            drain(0.5)
            ground.ping()
            up = ground.uplink([str(image)], "count the ships", max_new_tokens=3, task_id="fmt1")
            ground.result(up.task_id, wait=True, max_wait_s=240, poll_s=5)
            ground.status()
            ground.query_image(up.images[0].name)
            ground.quarantine()
            ground.lost_tasks()
            with pytest.raises(CommandRejected, match="UNKNOWN_TASK"):
                ground.cancel("no-such-task")
            drain(1.5)
    finally:
        bus.stop()
        context.destroy(linger=0)

    seen: dict[str, int] = {}
    unprompted_result = False
    for data in captured:
        packet = decode(data)
        assert not packet.telecommand
        _same_message(packet, data)
        # §3, §5.1: payload telemetry on APID PAYLOAD from the payload, bus telemetry on APID BUS
        if packet.type_number >> 8 == 0x03:
            assert (APIDS[packet.apid], packet.source_id) == ("PAYLOAD", 0x0200), packet.type_name
        if packet.type_number >> 8 == 0x04:
            assert (APIDS[packet.apid], packet.source_id) == ("BUS", 0x0100), packet.type_name
        seen[packet.type_name] = seen.get(packet.type_name, 0) + 1
        if packet.type_name == "TASK_RESULT" and seen.get("COMPLETED") and seen["TASK_RESULT"] == 1:
            unprompted_result = True
    wanted = {
        "ACCEPTED",
        "REJECTED",
        "STARTED",
        "PROGRESS",
        "COMPLETED",
        "HOUSEKEEPING",
        "EVENT",
        "TASK_RESULT",
        "HEARTBEAT",
        "PONG",
        "IMAGE_STATUS",
        "QUARANTINE_LIST",
        "LOST_TASKS",
        "POWER",
        "THERMAL",
        "FDIR",
        "SHUTDOWN_WARNING",
        "POWER_STATE",
    }
    assert wanted <= set(seen), f"never captured: {sorted(wanted - set(seen))}"
    assert seen["TASK_RESULT"] >= 2 and unprompted_result, "TASK_RESULT on completion and on DOWNLINK_RESULT"
    # the ground's telecommands, as the bus kept them in its log
    commands = _logged_telecommands([tmp_path / "bus" / "bus-log.jsonl"])
    sent = {decode(data).type_name for _, data in commands}
    for entry, data in commands:
        packet = decode(data)
        assert packet.telecommand and packet.type_name == entry["type"]
        _same_message(packet, data)
    assert {"PING", "STATUS", "UPLINK_TASK", "DOWNLINK_RESULT", "LIST_QUARANTINE", "LIST_LOST_TASKS"} <= sent
    # flipped bits in one real packet of each type
    by_type = {}
    for data in captured + [data for _, data in commands]:
        by_type.setdefault(decode(data).type_name, data)
    assert sum(_check_flips(data, _positions(data)) for data in by_type.values()) > 1000
