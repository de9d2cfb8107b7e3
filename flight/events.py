"""The events the engine reports while it runs a request, declared in one place.

The engine, and the checkpoint store and writer under it, report what happens through one
callback, `events(event, **fields)`, where `event` is an `EngineEvent` and `fields` are those
listed here. Whoever listens (the onboard process, `ow infer`, the testbench, tests) matches on
the members, never on free strings: a misspelt member is an error where it is written, not an
event dropped in silence. The members are `str`s with the values the logs have always carried,
so a run's log reads as before.

    member                       fields
    REQUEST_OPENED               status, phase, position, [blocks_total], prompt_tokens, chunks, groups
    MANIFEST_MISMATCH            status, differences
    RECORD_REJECTED              file, reason, [offset]
    RECOVERY_PLAN                phase, block, reads, first_computes, ... (the plan's summary)
    PREFILL_RESTORED             bytes_read, read_s, stall_s
    VISION_RESTORED              block
    DECODE_RESTORED              step
    VISION_BLOCK_DONE            block, of          a unit of work done (UNIT_DONE)
    PREFILL_BLOCK_DONE           group, chunk, done, of
    DECODE_STEP_DONE             step, of
    EARLY_RECORD                 phase, since       the adaptive cadence asked for a record early
    CHECKPOINT_COMMITTED         record, bytes
    CHECKPOINT_DEFERRED          record, reason     an optional record dropped: the writer was busy
    VISION_STATE_SKIPPED         block, since       the adaptive cadence skipped a scheduled vision state
    CHECKPOINT_WRITE_FAILED      record, errno, reason
    BLOCK_SHAPE_ESTIMATE_FAILED  reason
    REQUEST_COMPLETED            tokens, finish_reason

How a run ends is declared here too. A run that is asked to end early (the payload's CANCEL_TASK
or its own stop) is asked through a `StopToken`, set from any thread; the engine looks at it at
every unit boundary -- right after the unit's UNIT_DONE event, before what the policy keeps of
that unit is handed to the writer -- and returns a `RunStatus` instead of a result:

    FINISHED   the request produced its answer (RESULT committed)
    PAUSED     it stopped at a unit boundary; its records stay as they were at the previous
               boundary and a later run resumes from them, as after a cut
    CANCELLED  as PAUSED on disk; the caller drops the request (the engine removes nothing)
    AWAITING_INPUTS
               the inputs' owner could not give what the run needed next (the pixel patches of
               a resumed request whose stored ones are damaged, and one of its images with
               them: `RequestInputs.pixels()` answered None); as PAUSED on disk, before the
               vision block that needed them; the caller runs the request again once it can

A power cut is not a stop: nothing after it runs (tests simulate one by raising from a callback).

Pure: the standard library only (the onboard process's command thread imports it without torch).
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol


class EngineEvent(enum.StrEnum):
    REQUEST_OPENED = "request_opened"
    MANIFEST_MISMATCH = "manifest_mismatch"
    RECORD_REJECTED = "record_rejected"
    RECOVERY_PLAN = "recovery_plan"
    PREFILL_RESTORED = "prefill_restored"
    VISION_RESTORED = "vision_restored"
    DECODE_RESTORED = "decode_restored"
    VISION_BLOCK_DONE = "vision_block_done"
    PREFILL_BLOCK_DONE = "prefill_block_done"
    DECODE_STEP_DONE = "decode_step_done"
    EARLY_RECORD = "early_record"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_DEFERRED = "checkpoint_deferred"
    VISION_STATE_SKIPPED = "vision_state_skipped"
    CHECKPOINT_WRITE_FAILED = "checkpoint_write_failed"
    BLOCK_SHAPE_ESTIMATE_FAILED = "block_shape_estimate_failed"
    REQUEST_COMPLETED = "request_completed"


#: The events that end a unit of work (a vision block, a prefill block, a decode step): where a
#: listener may count progress, and where a stop takes effect.
UNIT_DONE = frozenset({EngineEvent.VISION_BLOCK_DONE, EngineEvent.PREFILL_BLOCK_DONE, EngineEvent.DECODE_STEP_DONE})


class Events(Protocol):
    """The engine's event callback."""

    def __call__(self, event: EngineEvent, **fields: Any) -> None: ...


def no_events(event: EngineEvent, **fields: Any) -> None:
    """The callback of an engine nobody listens to."""


class RunStatus(enum.StrEnum):
    """How one run of a request ended (the engine's `RunOutcome.status`)."""

    FINISHED = "finished"
    PAUSED = "paused"
    CANCELLED = "cancelled"
    AWAITING_INPUTS = "awaiting_inputs"


class StopToken:
    """Asks a running request to end at its next unit boundary. Set from any thread (`pause`,
    `cancel`), read by the engine between units (`requested`); a cancel outranks a pause.

    `paused_by`: an event whose setting pauses the run too (the payload's process-wide stop),
    so that whoever stops the process need not know which request runs; the token only reads it."""

    def __init__(self, paused_by: threading.Event | None = None) -> None:
        self._paused = threading.Event()
        self._paused_by = paused_by
        self._cancelled = threading.Event()

    def pause(self) -> None:
        self._paused.set()

    def cancel(self) -> None:
        self._cancelled.set()

    def requested(self) -> RunStatus | None:
        """CANCELLED or PAUSED once asked (a cancel first), else None: run on."""
        if self._cancelled.is_set():
            return RunStatus.CANCELLED
        if self._paused.is_set() or (self._paused_by is not None and self._paused_by.is_set()):
            return RunStatus.PAUSED
        return None


__all__ = ["UNIT_DONE", "EngineEvent", "Events", "RunStatus", "StopToken", "no_events"]
