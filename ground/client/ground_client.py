"""`GroundClient`: the parts put together, with the simple commands and the telemetry stream."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from common.wire import Apid
from common.wire import messages as m
from ground.client.results import ResultStore
from ground.errors import NoAnswer
from ground.link import Telemetry


class GroundClient(ResultStore):
    """One ground station's session with the bus and, through it, the payload.

    keys_dir      keys directory (clients/<station>.key_secret, server/bus.key, state/)
    station       client key name; source_id: the secondary-header source id (own replay window;
                  default: the one the bus binds to the station's key, docs/ground.md "Stations")
    timeout_s     how long to wait for an answer before calling it "no answer"
    retries       unanswered rounds an uplink tolerates (re-asking each time) before giving up
    window        IMAGE_CHUNKs in flight at once
    notify        where operator notices go (default: structlog warnings)
    progress      tqdm bar on stderr during uploads: True, False, or None (only on a terminal)
    origin        who sends, in the station's command log (`ow ground uplink`, ...)
    upload_progress  called with (image name, bytes on board, image size) as an upload advances
    """

    def ping(self) -> float:
        """PING -> PONG; the round-trip time in seconds."""
        key = random.getrandbits(32)
        started = time.time()
        self._transact(m.Ping(key=key), "PING", reply=lambda mark: self._after(self._pongs.get(key), mark))
        return self._pongs[key][1] - started

    def status(self) -> m.Housekeeping:
        """STATUS -> the next HOUSEKEEPING report (any report after the request is current)."""
        _, hk = self._transact(m.Status(), "STATUS", reply=lambda mark: self._after(self._housekeeping, mark))
        return hk

    # --- health and safety ---------------------------------------------------------------------
    def quarantine(self) -> m.QuarantineList:
        """LIST_QUARANTINE -> the items the payload holds back after repeated abnormal exits."""
        _, listing = self._transact(
            m.ListQuarantine(), "LIST_QUARANTINE", reply=lambda mark: self._after(self._quarantine, mark)
        )
        return listing

    def release(self, item: str) -> None:
        """RELEASE_QUARANTINE: the payload handles `item` again (a task is queued again)."""
        self._transact(m.ReleaseQuarantine(item=item), f"RELEASE_QUARANTINE {item}", completion=True)

    def lost_tasks(self) -> m.LostTasks:
        """LIST_LOST_TASKS -> the tasks the payload lost to storage damage."""
        _, lost = self._transact(m.ListLostTasks(), "LIST_LOST_TASKS", reply=lambda mark: self._after(self._lost, mark))
        return lost

    # --- the bus's boot-loop guard ----------------------------------------------------------------
    def payload_retry(self) -> None:
        """PAYLOAD_RETRY, to the bus (APID BUS): power the payload again now that the bus holds it
        off after a boot loop. CommandRejected NOT_HELD (by the bus) when nothing is held."""
        try:
            self._transact(m.PayloadRetry(), "PAYLOAD_RETRY", completion=True, apid=Apid.BUS)
        except NoAnswer:
            # The bus answers this itself (the payload may well be off): silence is the bus's.
            raise NoAnswer(f"PAYLOAD_RETRY: no answer from the bus within {self.timeout_s:g} s") from None

    # --- telemetry ----------------------------------------------------------------------------
    def telemetry(self, duration_s: float | None = None) -> Iterator[Telemetry]:
        """Every packet received, as it arrives, for `duration_s` (None: until the caller stops)."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while True:
            remaining = 0.5 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            for packet in self.link.receive(min(remaining, 0.5)):
                self._note(packet)
                yield packet
