"""The payload's outgoing messages: every thread queues its telemetry here, the main thread
sends it (app.py, `FlightApp.run`). A packet is numbered as it is queued, from the telemetry
sequence counter that keeps its numbers ahead on disk (state/tm-sequence.bin)."""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from typing import Any

from common.durable import DurableFS
from common.wire import Apid, EventId, NodeId
from common.wire import encode as encode_packet
from common.wire import messages as m
from common.wire.ids import MAX_EVENT_TEXT_BYTES
from common.wire.seq import AheadSequenceCounter
from common.wire.text import clip_utf8

#: What the main thread takes from the outbox: an encoded packet, and what to run once it has
#: left for the bus (or None).
Outgoing = tuple[bytes, Callable[[], Any] | None]


def telemetry_counter(state_dir: str, fs: DurableFS, log: Any) -> AheadSequenceCounter:
    counter = AheadSequenceCounter(os.path.join(state_dir, "tm-sequence.bin"), fs=fs)
    if counter.reset_reason is not None:
        log.warning("telemetry_counter_reset", error=counter.reset_reason)
    return counter


class Outbox:
    """Telemetry to the bus, in the order it was queued (thread-safe)."""

    def __init__(self, tm_counter: AheadSequenceCounter, log: Any):
        self.tm_counter = tm_counter
        self.log = log
        self._queue: queue.Queue[Outgoing] = queue.Queue()

    def send(self, message: m.Message, on_sent: Callable[[], Any] | None = None) -> None:
        """Queue a telemetry packet (thread-safe; the main thread sends). `on_sent` runs once the
        packet has left for the bus."""
        packet = encode_packet(message, Apid.PAYLOAD, self.tm_counter.next(Apid.PAYLOAD), source_id=NodeId.PAYLOAD)
        self._queue.put((packet, on_sent))

    def event(self, event_id: EventId, text: str, task_id: str | None = None) -> None:
        text = clip_utf8(text, MAX_EVENT_TEXT_BYTES)
        self.log.info("event", event_id=event_id.name, text=text, task_id=task_id)
        self.send(m.Event(event_id=event_id, text=text, task_id=task_id))

    def empty(self) -> bool:
        return self._queue.empty()

    def get_nowait(self) -> Outgoing:
        """The oldest packet queued (queue.Empty if none)."""
        return self._queue.get_nowait()


__all__ = ["Outbox", "Outgoing", "telemetry_counter"]
