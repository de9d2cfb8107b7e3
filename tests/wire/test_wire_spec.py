"""The implementation matches docs/wire-protocol.md, CCSDS and the PUS CRC as implemented
independently by `spacepackets`."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

import pytest
from fastcrc import crc16 as fast_crc16
from spacepackets.ccsds.spacepacket import PacketId, PacketType, SpacePacketHeader, parse_space_packets
from spacepackets.ecss.tc import generate_crc

from common.wire import ids
from common.wire import messages as m
from common.wire.ids import Apid, EventId, MessageType, ResponseCode, TlmChannel
from common.wire.packet import crc16, decode, encode

DOC = (Path(__file__).resolve().parents[2] / "docs" / "wire-protocol.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = DOC.index(title)
    level = title.split(" ")[0]
    nxt = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(DOC, start + len(title))
    return DOC[start : nxt.start() if nxt else len(DOC)]


def test_crc_is_ccitt_false():
    assert crc16(b"123456789") == 0x29B1


def test_crc_matches_spacepackets(all_samples):
    for i, sample in enumerate(all_samples):
        packet = encode(sample, Apid.PAYLOAD, i)
        assert generate_crc(bytearray(packet[:-2])) == packet
        assert fast_crc16.ibm_3740(packet) == 0


def test_golden_packet_built_by_hand():
    """PING key=42, APID 0x020, seq 1 in epoch 0, source 1, time 0, all acks."""
    body = bytes.fromhex("81a36b65792a")  # msgpack {"key": 42}
    secondary = bytes.fromhex("010f0101000100000000000000000000")
    data_len = len(secondary) + len(body) + 2 - 1
    primary = bytes([0b000_1_1_000, 0x20, 0b11_000000, 0x01]) + data_len.to_bytes(2, "big")
    unsigned = primary + secondary + body
    expected = unsigned + fast_crc16.ibm_3740(unsigned).to_bytes(2, "big")
    assert encode(m.Ping(key=42), Apid.PAYLOAD, 1, source_id=1, time_us=0) == expected


def test_spacepackets_parses_our_packets(all_samples):
    packets = [encode(s, Apid.PAYLOAD, 100 + i) for i, s in enumerate(all_samples)]
    for i, packet in enumerate(packets):
        header = SpacePacketHeader.unpack(packet)
        assert header.apid == Apid.PAYLOAD and header.seq_count == 100 + i
        assert header.sec_header_flag and header.packet_len == len(packet)
    stream = b"".join(packets)
    ids_ = [PacketId(PacketType.TC, True, Apid.PAYLOAD), PacketId(PacketType.TM, True, Apid.PAYLOAD)]
    found = parse_space_packets(stream, ids_).tm_list
    assert [bytes(p) for p in found] == packets
    assert [decode(bytes(p))[1] for p in found] == all_samples


@pytest.mark.parametrize("enum_type", [Apid, MessageType, ResponseCode, EventId, TlmChannel, ids.Severity, ids.NodeId])
def test_numbers_are_unique(enum_type):
    """IntEnum silently turns a duplicated number into an alias; forbid that."""
    assert len(enum_type.__members__) == len(list(enum_type))


def test_doc_message_type_table():
    rows = re.findall(r"^\| `(0x[0-9a-f]{4})` \| (\w+) \| (TC|TM) \| `(\w+)` \|$", section("## 3. Message types"), re.M)
    expected = [
        (f"{c.TYPE:#06x}", c.TYPE.name, "TC" if c.TYPE.is_command else "TM", c.__name__)
        for c in m.all_message_classes()
    ]
    assert rows == expected


def test_doc_field_tables():
    headings = list(re.finditer(r"^#### `(0x[0-9a-f]{4})` (\w+) \((TC|TM), `(\w+)`\)$", DOC, re.M))
    assert len(headings) == len(MessageType)
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else DOC.index("## 4.")
        block = DOC[heading.end() : end]
        end_of_section = re.search(r"^#{1,3} ", block, re.M)
        block = block[: end_of_section.start()] if end_of_section else block
        cls = m.message_class(int(heading.group(1), 16))
        assert cls is not None and cls.__name__ == heading.group(4)
        documented = re.findall(r"^\| `(\w+)` \|", block, re.M)
        assert documented == [f.name for f in dataclasses.fields(cls)], cls.__name__


def test_doc_response_codes():
    rows = re.findall(r"^\| (\d+) \| (\w+) \| (.+) \|$", section("### 5.2 Response codes"), re.M)
    assert rows == [(str(c.value), c.name, c.description) for c in ResponseCode]


def test_doc_events():
    rows = re.findall(r"^\| `(0x[0-9a-f]{4})` \| (\w+) \| (\w+) \|$", section("### 5.3 Events"), re.M)
    assert rows == [(f"{e.value:#06x}", e.name, e.severity.name) for e in EventId]


def test_doc_channels():
    rows = re.findall(r"^\| `(0x[0-9a-f]{4})` \| (\w+) \| (\w+) \|$", section("### 5.4 Telemetry channels"), re.M)
    assert rows == [(f"{c.value:#06x}", c.name, c.unit) for c in TlmChannel]


def test_doc_enumerated_strings():
    text = section("### 5.5 Enumerated strings")
    for enum_type in (ids.TaskPhase, ids.PowerCause, ids.FdirMode):
        line = re.search(rf"- {enum_type.__name__}: (.+?)\.\n", text, re.S).group(1)
        assert re.findall(r"`(\w+)`", line) == [e.value for e in enum_type]


def test_doc_limits():
    assert f"{ids.MAX_PACKET_BYTES}" in DOC and f"{ids.MAX_BODY_BYTES}" in DOC
    assert ids.MIN_PACKET_BYTES == 25 and "at least 25 bytes" in DOC
    assert issubclass(ids.TaskPhase, enum.StrEnum)
