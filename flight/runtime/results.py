"""Finished tasks: one record file each, kept under the operator's retention budget.

A task leaves the queue journal when it finishes (docs/flight.md "The queue journal"); its final
state lives here, in `results/<task id>.rec` (record kind FINISHED_TASK): how it ended (completed,
failed, cancelled, with code and reason), its result, the content hash of its uplink and whether
its final report has left for the bus. One file per task means a damaged file costs that task's
result and nothing else, and the journal never grows with the history of the payload.

Retention: the bytes of full result files are kept under `budget_bytes`. When a new result
pushes the total over it, the oldest results whose report has left are *evicted*: the file is
replaced by a tombstone (task id, content hash, how it ended) so that the task is still known --
a DOWNLINK_RESULT answers RESULT_EVICTED and a re-sent UPLINK_TASK is recognised, never run
again. A result whose report has not left is never evicted. At most `max_tombstones`
tombstones are kept (the oldest go first).

A file that does not verify is *damaged*: the task is known to have finished (its name is the
file name) but nothing else about it is; it is reported lost, and its id answers TASK_LOST.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from common.durable import DurableFS, best_effort
from common.record import Kind, RecordError, decode, encode
from common.wire.ids import MAX_RECOVERIES

SUFFIX = ".rec"
DEFAULT_BUDGET_BYTES = 256 << 20
DEFAULT_MAX_TOMBSTONES = 65536
EVICTED, DAMAGED = "evicted", "damaged"


@dataclass
class Finished:
    """What the store knows of one finished task without reading its file again."""

    task_id: str
    state: str  # completed / failed / cancelled
    code: int
    content_hash: str
    reported: bool
    finished_seq: int  # order of finishing (oldest evicted first)
    nbytes: int  # size of the full result file; 0 for a tombstone
    gone: str | None = None  # None: the full record is here; "evicted" or "damaged"


class ResultStore:
    def __init__(
        self,
        directory: str,
        fs: DurableFS | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        max_tombstones: int = DEFAULT_MAX_TOMBSTONES,
        on_evict=None,
    ):
        self.fs = fs or DurableFS()
        self.directory = directory
        self.budget_bytes = int(budget_bytes)
        self.max_tombstones = int(max_tombstones)
        self.on_evict = on_evict or (lambda entry: None)
        self.index: dict[str, Finished] = {}
        self.damaged: list[str] = []
        self._seq = 0
        self._open()

    def _path(self, task_id: str) -> str:
        return os.path.join(self.directory, task_id + SUFFIX)

    def _open(self) -> None:
        best_effort(self.fs.makedirs, self.directory)  # a read-only disk: read what is there
        best_effort(self.fs.remove_stale_temps, self.directory)
        for name in self.fs.listdir(self.directory):
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            task_id = name[: -len(SUFFIX)]
            try:
                rec, _ = decode(self.fs.read(self._path(task_id)), expect_kind=Kind.FINISHED_TASK)
                entry = Finished(**rec.meta["entry"])
                if entry.task_id != task_id:
                    raise RecordError("bad_meta", "task id disagrees with the file name")
            except (RecordError, KeyError, TypeError, ValueError, OSError):
                entry = Finished(task_id, "unknown", 0, "", True, -1, 0, DAMAGED)
                self.damaged.append(task_id)
            self.index[task_id] = entry
            self._seq = max(self._seq, entry.finished_seq + 1)

    # ---- writing --------------------------------------------------------------------------------
    def _write(self, entry: Finished, task: dict | None) -> None:
        meta = {"entry": asdict(entry)}
        if task is not None:
            meta["task"] = task
        self.fs.write_atomic(self._path(entry.task_id), encode(Kind.FINISHED_TASK, meta).chunks)

    def put(self, task: dict, reported: bool = False) -> Finished:
        """Record a finished task (`task`: the queue's Task as a dict, final state included).
        Durable when it returns."""
        entry = Finished(
            task["task_id"], task["state"], int(task.get("code") or 0), task["content_hash"], reported, self._seq, 0
        )
        self._seq += 1
        meta_task = dict(task)
        self._write(entry, meta_task)
        entry.nbytes = self.fs.size(self._path(entry.task_id))
        self.index[entry.task_id] = entry
        best_effort(self._enforce_budget)  # the result is durable; eviction can wait for the disk
        return entry

    def mark_reported(self, task_id: str) -> None:
        entry = self.index.get(task_id)
        if entry is None or entry.reported or entry.gone:
            return
        task = self.load(task_id)
        entry.reported = True
        try:
            self._write(entry, task)
        except BaseException:
            entry.reported = False  # not on disk: the report goes again at the next boot
            raise
        best_effort(self._enforce_budget)

    def _enforce_budget(self) -> None:
        total = sum(e.nbytes for e in self.index.values() if e.gone is None)
        if total <= self.budget_bytes:
            return
        for entry in sorted(
            (e for e in self.index.values() if e.gone is None and e.reported), key=lambda e: e.finished_seq
        ):
            if total <= self.budget_bytes:
                break
            total -= entry.nbytes
            entry.gone, entry.nbytes = EVICTED, 0
            self._write(entry, None)  # the tombstone replaces the file atomically
            self.on_evict(entry)
        tombstones = sorted((e for e in self.index.values() if e.gone == EVICTED), key=lambda e: e.finished_seq)
        for entry in tombstones[: max(0, len(tombstones) - self.max_tombstones)]:
            self.fs.remove(self._path(entry.task_id), sync=False)
            del self.index[entry.task_id]
        if len(tombstones) > self.max_tombstones:
            self.fs.fsync_dir(self.directory)

    # ---- reading ---------------------------------------------------------------------------------
    def get(self, task_id: str) -> Finished | None:
        return self.index.get(task_id)

    def load(self, task_id: str) -> dict | None:
        """The finished task's full record (state, result, ...), or None if evicted or damaged."""
        entry = self.index.get(task_id)
        if entry is None or entry.gone:
            return None
        try:
            rec, _ = decode(self.fs.read(self._path(task_id)), expect_kind=Kind.FINISHED_TASK)
            return {**rec.meta["task"], "reported": entry.reported}
        except (RecordError, KeyError, TypeError, OSError):
            entry.gone = DAMAGED  # damaged since the store opened: known lost from now on
            self.damaged.append(task_id)
            return None

    def unreported(self) -> list[str]:
        return [
            e.task_id
            for e in sorted(self.index.values(), key=lambda e: e.finished_seq)
            if not e.reported and not e.gone
        ]

    def bytes_held(self) -> int:
        return sum(e.nbytes for e in self.index.values() if e.gone is None)


def recovery_fields(result: dict) -> dict:
    """TASK_RESULT's restart and bytes-written fields (docs/wire-protocol.md §3.3) from a stored
    result: each restart's seconds, phase and planner (the latest MAX_RECOVERIES), and the bytes
    of checkpoint records over every boot; nil, not zero, for a result stored without them."""
    recoveries = result.get("recoveries")
    fields: dict = {"written_bytes": result.get("lifetime_bytes_written")}
    if isinstance(recoveries, list):
        latest = recoveries[-MAX_RECOVERIES:]
        fields["recovery_s"] = [float(seconds) for seconds, _, _ in latest]
        fields["recovery_phases"] = [str(phase) for _, phase, _ in latest]
        fields["recovery_planners"] = [str(planner) for _, _, planner in latest]
    return fields
