"""OrbitWeaver wire protocol: CCSDS Space Packets carrying msgpack messages (docs/wire-protocol.md).

from common.wire import encode, decode, WireError, messages as m
packet = encode(m.Ping(key=7), Apid.PAYLOAD, counter.next(Apid.PAYLOAD), source_id=NodeId.GROUND)
header, message = decode(packet)
"""

from common.wire.errors import ReplayError, RequestRef, WireError
from common.wire.ids import (
    AckFlags,
    Apid,
    EventId,
    FdirMode,
    MessageType,
    NodeId,
    PowerCause,
    ResponseCode,
    Severity,
    StorageState,
    TaskPhase,
    TlmChannel,
)
from common.wire.packet import PacketHeader, decode, decode_header, encode
from common.wire.seq import DurableSequenceCounter, ReplayGuard, SequenceAheadError, SequenceCounter, SequenceStateError
from common.wire.text import clip_utf8

__all__ = [
    "AckFlags",
    "Apid",
    "DurableSequenceCounter",
    "EventId",
    "FdirMode",
    "MessageType",
    "NodeId",
    "PacketHeader",
    "PowerCause",
    "ReplayError",
    "ReplayGuard",
    "RequestRef",
    "ResponseCode",
    "SequenceAheadError",
    "SequenceCounter",
    "SequenceStateError",
    "Severity",
    "StorageState",
    "TaskPhase",
    "TlmChannel",
    "WireError",
    "clip_utf8",
    "decode",
    "decode_header",
    "encode",
]
