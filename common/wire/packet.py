"""Packet framing: CCSDS Space Packet + OrbitWeaver secondary header + msgpack body + CRC-16.

    encode(message, apid, seq) -> bytes
    decode(data) -> (PacketHeader, Message)      raises WireError, and only WireError

Layout and the order of checks are specified in docs/wire-protocol.md §2-§4. The CCSDS primary
header is built and parsed by `spacepackets`; the CRC is CRC-16/CCITT-FALSE from `crcmod`, the
same polynomial, seed and bit order as the PUS packet error control field.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import crcmod.predefined
import msgpack
from spacepackets.ccsds.spacepacket import (
    PacketType,
    SequenceFlags,
    SpacePacket,
    SpacePacketHeader,
)

from common.wire.errors import WireError
from common.wire.header import PacketHeader, RequestRef
from common.wire.ids import (
    CRC_BYTES,
    MAX_BODY_BYTES,
    MAX_PACKET_BYTES,
    MIN_PACKET_BYTES,
    PRIMARY_HEADER_BYTES,
    SECONDARY_HEADER_BYTES,
    SEQ_COUNT_BITS,
    SEQ_MAX,
    WIRE_VERSION,
    AckFlags,
    MessageType,
    ResponseCode,
)
from common.wire.messages import Message, message_class

__all__ = [
    "PacketHeader",
    "PacketType",
    "crc16",
    "decode",
    "decode_header",
    "encode",
    "frame",
]

#: CRC-16/CCITT-FALSE: poly 0x1021, init 0xFFFF, no reflection, no final xor (check 0x29B1).
crc16 = crcmod.predefined.mkCrcFun("crc-ccitt-false")

# Secondary header: wire version, ack flags, message type, source id, sequence epoch, time (us).
_SECONDARY = struct.Struct(">BBHHHQ")
assert _SECONDARY.size == SECONDARY_HEADER_BYTES
_SEQ_COUNT_MASK = (1 << SEQ_COUNT_BITS) - 1


def now_us() -> int:
    return time.time_ns() // 1000


def frame(
    packet_type: PacketType,
    apid: int,
    seq: int,
    message_type: int,
    body: bytes,
    *,
    source_id: int = 0,
    time_us: int | None = None,
    ack_flags: int = 0,
    wire_version: int = WIRE_VERSION,
) -> bytes:
    """Wrap an already-encoded body. `encode` is the normal entry point; this one takes raw
    values (tests use it to build packets that a Message could never produce)."""
    if not 0 <= seq <= SEQ_MAX:
        raise ValueError(f"sequence number {seq} outside 0..{SEQ_MAX}")
    if len(body) > MAX_BODY_BYTES:
        raise WireError(ResponseCode.OVERSIZED_PACKET, f"body of {len(body)} bytes > {MAX_BODY_BYTES}")
    secondary = _SECONDARY.pack(
        wire_version,
        ack_flags,
        message_type,
        source_id,
        seq >> SEQ_COUNT_BITS,
        now_us() if time_us is None else time_us,
    )
    primary = SpacePacketHeader(
        packet_type=packet_type,
        apid=apid,
        seq_count=seq & _SEQ_COUNT_MASK,
        data_len=SECONDARY_HEADER_BYTES + len(body) + CRC_BYTES - 1,
        sec_header_flag=True,
        seq_flags=SequenceFlags.UNSEGMENTED,
    )
    packet = SpacePacket(primary, sec_header=secondary, user_data=body).pack()
    packet += crc16(bytes(packet)).to_bytes(CRC_BYTES, "big")
    return bytes(packet)


def encode(
    message: Message,
    apid: int,
    seq: int,
    *,
    source_id: int = 0,
    time_us: int | None = None,
    ack_flags: AckFlags = AckFlags.ALL,
) -> bytes:
    """One packet carrying `message`. `seq` is the sender's 30-bit sequence number for `apid`
    (see common.wire.seq). `ack_flags` only matter for telecommands; telemetry carries 0.

    Raises WireError(OVERSIZED_PACKET) if the body does not fit; ValueError for an APID or
    sequence number out of range."""
    body = msgpack.packb(message.pack(), use_bin_type=True)
    is_command = message.is_command()
    return frame(
        PacketType.TC if is_command else PacketType.TM,
        apid,
        seq,
        message.TYPE,
        body,
        source_id=source_id,
        time_us=time_us,
        ack_flags=int(ack_flags) if is_command else 0,
    )


def _peek_request(data: bytes) -> RequestRef | None:
    """What the bytes claim to be, before they are trusted (for the REJECTED report)."""
    if len(data) < PRIMARY_HEADER_BYTES:
        return None
    apid = (data[0] & 0x07) << 8 | data[1]
    seq = (data[2] << 8 | data[3]) & _SEQ_COUNT_MASK
    source_id = message_type = 0
    if len(data) >= PRIMARY_HEADER_BYTES + SECONDARY_HEADER_BYTES:
        _, _, message_type, source_id, epoch, _ = _SECONDARY.unpack_from(data, PRIMARY_HEADER_BYTES)
        seq |= epoch << SEQ_COUNT_BITS
    return RequestRef(apid=apid, source_id=source_id, seq=seq, message_type=message_type)


def _check_header(data: Any) -> tuple[bytes, PacketHeader]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(ResponseCode.MALFORMED_PACKET, f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    request = _peek_request(data)

    def fail(code: ResponseCode, reason: str) -> WireError:
        return WireError(code, reason, request=request)

    if len(data) > MAX_PACKET_BYTES:
        raise fail(ResponseCode.OVERSIZED_PACKET, f"{len(data)} bytes > {MAX_PACKET_BYTES}")
    if len(data) < PRIMARY_HEADER_BYTES:
        raise fail(ResponseCode.MALFORMED_PACKET, f"{len(data)} bytes: too short for a CCSDS primary header")
    primary = SpacePacketHeader.unpack(data[:PRIMARY_HEADER_BYTES])
    if primary.packet_len != len(data):
        raise fail(ResponseCode.BAD_LENGTH, f"length field says {primary.packet_len} bytes, received {len(data)}")
    if len(data) < MIN_PACKET_BYTES:
        raise fail(ResponseCode.MALFORMED_PACKET, f"{len(data)} bytes: too short for headers, body and CRC")
    # A CRC over the whole packet including its own field leaves a zero residue.
    if crc16(data) != 0:
        received = int.from_bytes(data[-CRC_BYTES:], "big")
        raise fail(ResponseCode.BAD_CRC, f"crc {received:#06x}, computed {crc16(data[:-CRC_BYTES]):#06x}")
    if primary.ccsds_version != 0:
        raise fail(ResponseCode.BAD_VERSION, f"CCSDS packet version {primary.ccsds_version}, expected 0")
    if not primary.sec_header_flag:
        raise fail(ResponseCode.MALFORMED_PACKET, "secondary header flag clear")
    if primary.seq_flags != SequenceFlags.UNSEGMENTED:
        raise fail(ResponseCode.MALFORMED_PACKET, f"sequence flags {primary.seq_flags.name}: segmentation not used")
    version, ack_flags, message_type, source_id, epoch, time_us = _SECONDARY.unpack_from(data, PRIMARY_HEADER_BYTES)
    if version != WIRE_VERSION:
        raise fail(ResponseCode.BAD_VERSION, f"wire version {version}, expected {WIRE_VERSION}")
    if ack_flags & ~int(AckFlags.ALL) or (primary.packet_type == PacketType.TM and ack_flags):
        raise fail(ResponseCode.MALFORMED_PACKET, f"reserved acknowledgement bits set: {ack_flags:#04x}")
    header = PacketHeader(
        packet_type=primary.packet_type,
        apid=primary.apid,
        seq=epoch << SEQ_COUNT_BITS | primary.seq_count,
        message_type=message_type,
        source_id=source_id,
        time_us=time_us,
        ack_flags=AckFlags(ack_flags),
        length=len(data),
    )
    return data, header


def decode_header(data: bytes) -> PacketHeader:
    """Check framing, CRC and headers without decoding the body (for relays)."""
    return _check_header(data)[1]


def decode(data: bytes) -> tuple[PacketHeader, Message]:
    """Parse and validate one packet. Raises WireError with the code of the first failed check
    (docs/wire-protocol.md §4); never any other exception, whatever the input."""
    try:
        return _decode(data)
    except WireError:
        raise
    except Exception as exc:  # a decoder bug must not take the payload process down
        raise WireError(ResponseCode.INTERNAL_ERROR, f"decoder fault: {type(exc).__name__}: {exc}") from exc


def _decode(data: bytes) -> tuple[PacketHeader, Message]:
    data, header = _check_header(data)
    request = header.request

    def fail(code: ResponseCode, reason: str) -> WireError:
        return WireError(code, reason, request=request, header=header)

    cls = message_class(header.message_type)
    is_tc = header.packet_type == PacketType.TC
    if cls is None:
        if is_tc:
            raise fail(ResponseCode.UNKNOWN_COMMAND, f"unknown command opcode {header.message_type:#06x}")
        raise fail(ResponseCode.UNKNOWN_MESSAGE_TYPE, f"unknown message type {header.message_type:#06x}")
    if cls.is_command() != is_tc:
        raise fail(
            ResponseCode.WRONG_PACKET_TYPE,
            f"{MessageType(header.message_type).name} in a {'TC' if is_tc else 'TM'} packet",
        )
    body_bytes = data[PRIMARY_HEADER_BYTES + SECONDARY_HEADER_BYTES : -CRC_BYTES]
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=True, unicode_errors="strict")
    except UnicodeDecodeError as exc:
        raise fail(ResponseCode.INVALID_UTF8, f"string is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise fail(ResponseCode.BODY_UNDECODABLE, f"msgpack: {type(exc).__name__}: {exc}") from None
    try:
        message = cls.unpack(body)
    except WireError as exc:
        exc.request, exc.header = request, header
        raise
    return header, message
