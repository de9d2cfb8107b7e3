"""Ground stations at the bus (docs/bus.md §5 "Stations"): whose key is still authorized (a revoked
key's connections are closed), which source id each key is bound to, how fast a station may send
(a token bucket each) and how much it may keep stored, and how a flood of refusals is logged
(counted, not written line by line).

libzmq's ROUTER cannot drop one peer, so the bus closes a connection itself: every packet names
the TCP connection it came on (ZMQ_SRCFD); the bus remembers each connection's descriptor with
its two addresses, and shuts that socket down (shutdown(2)) -- libzmq then sees the connection
end and cleans up as for any peer that went away. A descriptor whose addresses no longer match
(the connection ended and the number was reused) is left alone.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from common import log
from common.wire import EventId
from common.wire.link import Received
from hil.bus import buslog as bl
from hil.bus.base import BusIO
from hil.bus.config import BusConfig
from hil.bus.routing import Routing

_log = log.get("hil.bus")

#: How often the bus reads authorized/ again to notice a revoked key (wall seconds).
KEYS_CHECK_S = 0.5
#: A key the bus has not seen yet (authorized since the last check) makes it read authorized/
#: again at once, but not more often than this.
KEYS_FORCED_CHECK_S = 0.1
#: Connections remembered per link (the oldest forgotten first; ground tools connect per command).
CONNECTIONS_KEPT = 4096
#: Rejections of one station logged in full per window; the rest of the window's are counted
#: and logged as one `rejections_suppressed` line when it ends.
REJECT_LOG_BURST = 20
REJECT_LOG_WINDOW_S = 10.0
#: A revoked key's connection that just sent a packet is closed this long after its REJECTED.
CLOSE_DELAY_S = 0.2


@dataclass
class Connection:
    """One TCP connection of an authenticated client, as the bus may close it."""

    name: str
    key: str | None
    fd: int
    peer: tuple
    local: tuple


@dataclass
class TokenBucket:
    """`rate` tokens a second, at most `burst` banked; starts full. rate 0: no limit."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float) -> bool:
        if self.rate <= 0:
            return True
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class RejectWindow:
    """One station's rejections in the current logging window."""

    start: float
    logged: int = 0
    suppressed: Counter = field(default_factory=Counter)


def _addresses(fd: int) -> tuple[tuple, tuple] | None:
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as sock:
            return sock.getpeername(), sock.getsockname()
    except OSError:
        return None


def shut_down(conn: Connection) -> bool:
    """Shut the connection's socket down if the descriptor still holds that connection."""
    try:
        dup = os.dup(conn.fd)
    except OSError:
        return False
    try:
        with socket.socket(fileno=dup) as sock:
            if (sock.getpeername(), sock.getsockname()) != (conn.peer, conn.local):
                return False  # that connection ended; the number now belongs to another
            sock.shutdown(socket.SHUT_RDWR)
            return True
    except OSError:
        return False


class Stations:
    """Keys, bindings, rate limits, quotas and refusal logging for the ground stations."""

    def __init__(self, config: BusConfig, io: BusIO, routing: Routing):
        self.config = config
        self.io = io
        self.routing = routing
        #: link -> connection key (routing id, or fd on the telemetry link) -> Connection
        self.connections: dict[str, OrderedDict] = {
            "commands": OrderedDict(),
            "payload": OrderedDict(),
            "telemetry": OrderedDict(),
        }
        self.key_snapshot: dict[str, bytes] = {}
        self._keys_known = False
        #: connections of revoked keys to shut down once their last REJECTED has left
        self._closing: list[tuple[float, str, Connection]] = []
        self._keys_checked = 0.0
        self._keys_forced = 0.0
        self.buckets: dict[str, TokenBucket] = {}
        self.reject_windows: dict[str, RejectWindow] = {}
        self.throttled_at: dict[str, float] = {}
        #: refusals per station and code since the bus started (tests, telemetry of floods)
        self.refusals: Counter = Counter()

    # ---- keys ----------------------------------------------------------------------------------
    def binding(self, name: str) -> int | None:
        """The source id key `name` is bound to (authorized/NAME.station), or None."""
        return self.io.keys.binding(name)

    def key_current(self, name: str | None, key: str | None) -> bool:
        """Whether this (name, key) is authorized now (as of the last look at authorized/)."""
        if name is None:
            return False
        if key is None:  # no key in the User-Id: by name only
            return name in self.key_snapshot
        if self.key_snapshot.get(name) == key.encode("ascii"):
            return True
        now = time.monotonic()
        if now - self._keys_forced >= KEYS_FORCED_CHECK_S:
            # Perhaps authorized since the last look (its handshake just passed): look again.
            self._keys_forced = now
            self.check_keys(now)
            return self.key_snapshot.get(name) == key.encode("ascii")
        return False

    def check_keys(self, now: float) -> None:
        """Read authorized/ again; close the connections of every key that is gone or replaced."""
        self._keys_checked = now
        keys = self.io.keys
        keys.refresh()
        before, after = self.key_snapshot, keys.snapshot()
        self.key_snapshot = after
        if not self._keys_known:
            # The first look (at start): commands stored by a key revoked while the bus was
            # down do not go out either.
            self._keys_known = True
            for name in sorted({e.sender for e in self.io.store.pending()} - set(after)):
                dropped = self._drop_stored_of(name)
                if dropped:
                    self.io.bus_event(
                        EventId.KEY_REVOKED,
                        f"key {name} no longer in authorized/: {dropped} stored command(s) dropped",
                        key_name=name,
                        connections_closed=0,
                        commands_dropped=dropped,
                    )
        for name, key in before.items():
            if after.get(name) == key:
                continue
            closed = self._close_connections(lambda c, name=name, key=key: c.name == name and c.key == key.decode())
            removed = name not in after
            dropped = self._drop_stored_of(name) if removed else 0
            how = "removed from authorized/" if removed else "replaced in authorized/"
            self.io.bus_event(
                EventId.KEY_REVOKED,
                f"key {name} {how}: {closed} open connection(s) closed"
                + (f", {dropped} stored command(s) dropped" if dropped else ""),
                key_name=name,
                connections_closed=closed,
                commands_dropped=dropped,
            )

    def _drop_stored_of(self, name: str) -> int:
        """Commands a revoked key stored that have not gone to the payload do not go out now."""
        dropped = 0
        for entry in self.io.store.pending():
            if entry.sender == name and entry.sent_link is None and entry.forwards == 0:
                self.routing.confirm_stored(entry, "revoked")
                dropped += 1
        return dropped

    def note_connection(self, link: str, conn_id: bytes | int | None, received: Received) -> None:
        if conn_id is None or received.fd is None or received.user_id is None:
            return
        conns = self.connections[link]
        known = conns.get(conn_id)
        if known is not None and known.fd == received.fd:
            return
        addresses = _addresses(received.fd)
        if addresses is None:
            return
        conns[conn_id] = Connection(received.user_id, received.key, received.fd, *addresses)
        while len(conns) > CONNECTIONS_KEPT:
            conns.popitem(last=False)

    def _close_connections(self, which) -> int:
        closed = 0
        for link, conns in self.connections.items():
            for conn_id, conn in list(conns.items()):
                if not which(conn):
                    continue
                del conns[conn_id]
                if shut_down(conn):
                    closed += 1
                    self.io.buslog.write(
                        bl.LINK_CLOSED, **self.io.stamp(), link=link, client=conn.name, reason="key revoked"
                    )
                    _log.warning("bus_connection_closed", link=link, client=conn.name, reason="key revoked")
        return closed

    def close_revoked(self, link: str, conn_id: bytes | int | None, received: Received) -> None:
        """A packet from a key that is no longer authorized: close the connection it came on, a
        moment later, so that the REJECTED just sent on it leaves libzmq's queue first."""
        self.note_connection(link, conn_id, received)
        conn = self.connections[link].pop(conn_id, None) if conn_id is not None else None
        if conn is not None:
            self._closing.append((time.monotonic() + CLOSE_DELAY_S, link, conn))

    def _close_due(self, now: float, final: bool = False) -> None:
        due = [c for c in self._closing if final or c[0] <= now]
        if not due:
            return
        self._closing = [c for c in self._closing if c not in due]
        for _, link, conn in due:
            if shut_down(conn):
                self.io.buslog.write(
                    bl.LINK_CLOSED, **self.io.stamp(), link=link, client=conn.name, reason="key revoked"
                )
                _log.warning("bus_connection_closed", link=link, client=conn.name, reason="key revoked")

    def on_subscription(self, received: Received) -> None:
        """A telemetry subscription (XPUB): remember its connection; refuse a revoked key's."""
        if received.fd is None:
            return
        if not self.key_current(received.user_id, received.key):
            self.close_revoked("telemetry", received.fd, received)
            return
        self.note_connection("telemetry", received.fd, received)

    # ---- rates, quotas, refusal logging ----------------------------------------------------------
    def rate_ok(self, name: str, now: float) -> bool:
        bucket = self.buckets.get(name)
        if bucket is None:
            cfg = self.config
            bucket = self.buckets[name] = TokenBucket(cfg.station_rate, float(cfg.station_burst), stamp=now)
        return bucket.take(now)

    def throttled(self, name: str, source_id: int | None, why: str, now: float) -> None:
        """STATION_THROTTLED, at most once per station per `throttle_event_s`."""
        last = self.throttled_at.get(name)
        if last is not None and now - last < self.config.throttle_event_s:
            return
        self.throttled_at[name] = now
        source = f" (source {source_id:#06x})" if source_id is not None else ""
        self.io.bus_event(EventId.STATION_THROTTLED, f"station {name}{source} throttled: {why}", station=name)

    def log_rejection(self, sender: str, code_name: str, now: float) -> bool:
        """Whether this rejection is logged in full (True) or only counted (False)."""
        self.refusals[(sender, code_name)] += 1
        window = self.reject_windows.get(sender)
        if window is not None and now - window.start >= REJECT_LOG_WINDOW_S:
            self._end_reject_window(sender, window, now)
            window = None
        if window is None:
            window = self.reject_windows[sender] = RejectWindow(start=now)
        if window.logged < REJECT_LOG_BURST:
            window.logged += 1
            return True
        window.suppressed[code_name] += 1
        return False

    def _end_reject_window(self, sender: str, window: RejectWindow, now: float) -> None:
        self.reject_windows.pop(sender, None)
        count = sum(window.suppressed.values())
        if not count:
            return
        self.io.buslog.write(
            bl.REJECTIONS_SUPPRESSED,
            **self.io.stamp(now),
            sender=sender,
            count=count,
            codes=dict(window.suppressed),
            window_s=round(now - window.start, 3),
        )
        _log.warning("bus_rejections_suppressed", sender=sender, count=count, codes=dict(window.suppressed))

    def housekeep(self, now: float, final: bool = False) -> None:
        """Authorized keys looked at again, revoked connections closed when due, refusal windows
        that ended logged (all of them, and every pending close, when `final`)."""
        if now - self._keys_checked >= KEYS_CHECK_S and not final:
            self.check_keys(now)
        self._close_due(now, final)
        for sender, window in list(self.reject_windows.items()):
            if final or now - window.start >= REJECT_LOG_WINDOW_S:
                self._end_reject_window(sender, window, now)
