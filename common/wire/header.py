"""What identifies a packet once its headers are parsed: the header fields and the request
they name. Below both the errors (a WireError carries them) and the packet codec (which makes
them), so that neither imports the other's module for them."""

from __future__ import annotations

from dataclasses import dataclass

from spacepackets.ccsds.spacepacket import PacketType

from common.wire.ids import SEQ_COUNT_BITS, AckFlags

_SEQ_COUNT_MASK = (1 << SEQ_COUNT_BITS) - 1


@dataclass(frozen=True)
class RequestRef:
    """Identifies a telecommand in its verification reports (PUS request id, extended with the
    source id and the 30-bit sequence number)."""

    apid: int
    source_id: int
    seq: int
    message_type: int


@dataclass(frozen=True)
class PacketHeader:
    """Primary and secondary header fields of one decoded packet."""

    packet_type: PacketType
    apid: int
    #: 30-bit sequence number: epoch << 14 | CCSDS sequence count.
    seq: int
    message_type: int
    source_id: int
    time_us: int
    ack_flags: AckFlags
    length: int

    @property
    def seq_count(self) -> int:
        """The 14-bit CCSDS sequence count as carried in the primary header."""
        return self.seq & _SEQ_COUNT_MASK

    @property
    def epoch(self) -> int:
        return self.seq >> SEQ_COUNT_BITS

    @property
    def request(self) -> RequestRef:
        return RequestRef(apid=self.apid, source_id=self.source_id, seq=self.seq, message_type=self.message_type)

    def wants(self, flag: AckFlags) -> bool:
        """Whether the sender asked for this successful verification report."""
        return bool(self.ack_flags & flag)
