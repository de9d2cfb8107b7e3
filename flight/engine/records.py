"""Where a request's records go: the checkpoint store, through the checkpoint writer.

Every phase hands its records to one `RecordSink`, which knows whether checkpoints are on at
all (the policy writes some, and the MANIFEST fitted on the disk), times the writes a phase's
cadence learns from, and keeps the peak of tensor bytes that checkpointing holds alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from common.durable import is_storage_fault
from flight.checkpoint.cadence import Cadence
from flight.checkpoint.store import CheckpointStore
from flight.checkpoint.writer import CheckpointWriter
from flight.events import EngineEvent, Events


class RecordSink:
    def __init__(
        self,
        store: CheckpointStore,
        writer: CheckpointWriter,
        events: Events,
        cadence: Cadence,
        *,
        enabled: bool,
        adaptive: bool,
    ):
        self.store = store
        self.writer = writer
        self.events = events
        self.cadence = cadence
        # False when the policy writes no checkpoints or not even the MANIFEST fitted on the disk.
        self.enabled = enabled
        self.adaptive = adaptive  # adaptive cadence: early records when a cut is likely
        # Most tensor bytes the writer held at once, credited to the phase that ended next.
        self.held_peaks: dict[str, int] = {}

    def submit(
        self,
        what: str,
        write: Callable[..., int],
        *args: Any,
        optional: bool = False,
        make_args: Callable[[], tuple] | None = None,
        phase: str | None = None,
    ) -> bool:
        """Hand a record to the writer; False if it was an optional one the writer dropped.
        `phase`: time the write for the cadence (what a record of this phase costs)."""
        if not self.enabled:
            return False
        if phase is not None:
            write = self._timed(phase, write)
        return self.writer.submit(what, write, *args, optional=optional, make_args=make_args)

    def _timed(self, phase: str, write: Callable[..., int]) -> Callable[..., int]:
        cadence = self.cadence

        def timed_write(*args: Any) -> int:
            start = time.perf_counter()
            nbytes = write(*args)
            cadence.observe_write(phase, time.perf_counter() - start, nbytes)
            return nbytes

        return timed_write

    def early(self, phase: str, since: int, every: int) -> bool:
        """An adaptive-cadence record before the fixed cadence's next one (cadence.py), announced
        as an `early_record` event so that a run's log says how many the cadence asked for."""
        asked = self.adaptive and self.enabled and self.cadence.early_record(phase, since, every)
        if asked:
            self.events(EngineEvent.EARLY_RECORD, phase=phase, since=since)
        return asked

    def skips_vision_state(self, block: int, since: int, blocks_left: int, nbytes: int) -> bool:
        """Whether the adaptive cadence skips the vision state the fixed cadence schedules after
        `block` (Cadence.skip_vision_state, weighed against the background writer's backlog),
        announced as a `vision_state_skipped` event. Never with a synchronous writer."""
        if not (self.adaptive and self.enabled and self.writer.async_writes):
            return False  # a synchronous writer writes on the compute path: nothing queues behind it
        skip = self.cadence.skip_vision_state(since, blocks_left, nbytes, *self.writer.backlog())
        if skip:
            self.events(EngineEvent.VISION_STATE_SKIPPED, block=block, since=since)
        return skip

    def note_held_peak(self, phase: str) -> None:
        self.held_peaks[phase] = max(self.held_peaks.get(phase, 0), self.writer.take_peak())

    def commit_result(self, tokens: list[int], logits: torch.Tensor, text: str, finish: str) -> None:
        """The RESULT record (and the garbage collection it allows), or a counted skip on a full disk."""
        if self.store.salt == 0:
            return  # no MANIFEST could be written: nothing on disk belongs to this request
        try:
            self.store.put_result(tokens, logits.detach().to("cpu"), text, finish)
            self.store.gc()
        except OSError as exc:
            if not is_storage_fault(exc):
                raise
            self.writer.records_skipped += 1
            self.events(EngineEvent.CHECKPOINT_WRITE_FAILED, record="RESULT", errno=exc.errno, reason=str(exc.strerror))
        self.events(EngineEvent.REQUEST_COMPLETED, tokens=len(tokens), finish_reason=finish)


def tensor_bytes(record: Any) -> int:
    """Bytes of a read record's tensors (0 for no record)."""
    return sum(t.numel() * t.element_size() for t in record.tensors.values()) if record is not None else 0
