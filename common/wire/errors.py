"""The one exception the wire layer raises for bad input."""

from __future__ import annotations

from common.wire.header import PacketHeader, RequestRef
from common.wire.ids import MAX_REASON_BYTES, ResponseCode
from common.wire.text import clip_utf8

# RequestRef is named here too: every WireError carries one, and its users import both from here.
__all__ = ["ReplayError", "RequestRef", "WireError", "clip_reason"]


def clip_reason(text: str) -> str:
    """Reasons travel in REJECTED/FAILED reports: keep them printable ASCII and bounded, whatever
    bytes the offending input contained."""
    safe = text.encode("ascii", "backslashreplace").decode("ascii")
    safe = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in safe)
    return clip_utf8(safe, MAX_REASON_BYTES)


class WireError(Exception):
    """Bad input on the wire, with the response code that the receiver reports.

    `request` is filled by `decode` as far as the bytes allowed: from a packet whose CRC failed it
    is a best guess (untrusted), otherwise it names the offending telecommand. `header` is set
    once the packet's headers were parsed and its CRC checked.
    """

    def __init__(
        self,
        code: ResponseCode,
        reason: str,
        *,
        field: str | None = None,
        request: RequestRef | None = None,
        header: PacketHeader | None = None,
    ):
        self.code = ResponseCode(code)
        self.reason = clip_reason(reason)
        self.field = field
        self.request = request
        self.header = header
        super().__init__(f"{self.code.name}: {self.reason}")


class ReplayError(WireError):
    """A telecommand's sequence number was already accepted or is older than the replay window.

    `highest` is the highest sequence number accepted from that (APID, source); the ground may
    advance its counter past it (docs/wire-protocol.md §6.4)."""

    def __init__(self, reason: str, *, highest: int, code: ResponseCode = ResponseCode.REPLAYED_SEQUENCE):
        super().__init__(code, reason)
        self.highest = highest
