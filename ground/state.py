"""The ground station's durable state, in one directory (default `<keys>/state/`):

    tc-sequence.bin     telecommand sequence counter (DurableSequenceCounter format, wire §6.2)
    tasks.json          tasks this station uplinked: id, prompt, images, request ids, last state
    results/<task>.json TASK_RESULTs downlinked so far
    telemetry.jsonl     packets archived by `ow ground events` (numbered lines; rotated at 64 MiB)
    forecast-basis.json the newest PAYLOAD_PROFILE, WINDOW_HISTORY and running task's progress
                        (the completion forecast's inputs, docs/ground.md)
    ground.lock         advisory lock serialising updates by concurrent `ow ground` processes

Several `ow ground` processes may run at once (an `events --follow` recorder, an uplink, a
status check). They must never issue the same sequence number, or the payload rejects the
second as a replay, so counter blocks are claimed under the lock with the file re-read first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.durable import DurableFS
from common.wire.seq import DurableSequenceCounter, SequenceCounter, SequenceStateError, serial_distance
from ground.errors import LocalInputError

#: Numbers reserved per durable write. Small, because a block held by one process while another
#: moves the payload's highest accepted number on may age out of the payload's 64-number replay
#: window (the ground then resynchronises, but rarely is better).
COUNTER_RESERVE = 16
ARCHIVE_ROTATE_BYTES = 64 * 1024 * 1024


@contextlib.contextmanager
def file_lock(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive advisory lock (flock) on `path`; yields False if `blocking` is off and
    another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class SharedSequenceCounter(DurableSequenceCounter):
    """A DurableSequenceCounter that several processes can share.

    Every block claim happens under `lock_path` and first adopts whatever other processes have
    already claimed (the file), so two processes never hand out the same number."""

    def __init__(self, path: Path, lock_path: Path, reserve: int = COUNTER_RESERVE, fs: DurableFS | None = None):
        self.lock_path = lock_path
        with file_lock(lock_path):
            super().__init__(path, reserve=reserve, fs=fs)

    def next(self, apid: int) -> int:
        seq = self.peek(apid)
        limit = self._reserved_until.get(apid)
        if limit is not None and serial_distance(seq, limit) > 0:
            return SequenceCounter.next(self, apid)
        with file_lock(self.lock_path):
            if self._fs.exists(self.path):
                on_disk = SequenceCounter.from_bytes(bytes(self._fs.read(self.path)))
                for other_apid, claimed in on_disk._next.items():
                    mine = self._reserved_until.get(other_apid)
                    if mine is None or serial_distance(mine, claimed) > 0:
                        self._reserved_until[other_apid] = claimed
                theirs = on_disk._next.get(apid)
                if theirs is not None and serial_distance(seq, theirs) > 0:
                    self._next[apid] = theirs
            return super().next(apid)

    def rebase(self, apid: int, seq: int) -> None:
        with file_lock(self.lock_path):
            super().rebase(apid, seq)


def _now_iso() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"


class GroundState:
    """Local state of one ground station."""

    def __init__(self, directory: str | os.PathLike, fs: DurableFS | None = None):
        self.dir = Path(directory)
        self.fs = fs or DurableFS()
        self._counter: SharedSequenceCounter | None = None

    # --- layout -------------------------------------------------------------------------------
    @property
    def counter_path(self) -> Path:
        return self.dir / "tc-sequence.bin"

    @property
    def tasks_path(self) -> Path:
        return self.dir / "tasks.json"

    @property
    def results_dir(self) -> Path:
        return self.dir / "results"

    @property
    def archive_path(self) -> Path:
        return self.dir / "telemetry.jsonl"

    @property
    def lock_path(self) -> Path:
        return self.dir / "ground.lock"

    @property
    def recorder_lock_path(self) -> Path:
        return self.dir / "telemetry.lock"

    def ensure(self) -> None:
        try:
            self.fs.makedirs(str(self.dir))
        except OSError as exc:
            raise LocalInputError(f"cannot create the ground state directory {self.dir}: {exc.strerror}") from None

    # --- sequence counter ---------------------------------------------------------------------
    @property
    def counter(self) -> SharedSequenceCounter:
        if self._counter is None:
            self.ensure()
            try:
                self._counter = SharedSequenceCounter(self.counter_path, self.lock_path, fs=self.fs)
            except SequenceStateError as exc:
                raise LocalInputError(
                    f"ground sequence counter {self.counter_path} is damaged ({exc}); restore it from a backup, or "
                    "remove it: the payload then rejects the first command as REPLAYED_SEQUENCE and the ground "
                    "resynchronises its counter"
                ) from None
        return self._counter

    # --- tasks --------------------------------------------------------------------------------
    def _read_tasks(self) -> dict[str, dict]:
        if not self.tasks_path.exists():
            return {}
        try:
            data = json.loads(self.tasks_path.read_text("utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
                raise ValueError("no 'tasks' map")
        except (ValueError, OSError) as exc:
            raise LocalInputError(f"ground task list {self.tasks_path} is unreadable: {exc}") from None
        return data["tasks"]

    def _write_tasks(self, tasks: dict[str, dict]) -> None:
        blob = json.dumps({"format": 1, "tasks": tasks}, indent=1, sort_keys=True).encode()
        self.fs.write_atomic(str(self.tasks_path), [blob])

    def tasks(self) -> list[dict]:
        """Every task this station uplinked, oldest first."""
        with self._locked():
            tasks = self._read_tasks()
        return sorted(tasks.values(), key=lambda t: (t.get("created", ""), t["task_id"]))

    def task(self, task_id: str) -> dict | None:
        with self._locked():
            return self._read_tasks().get(task_id)

    def find_same_task(self, content: dict) -> dict | None:
        """An earlier task with exactly this content (prompt, images, max tokens, priority)."""
        for task in reversed(self.tasks()):
            if all(task.get(k) == v for k, v in content.items()) and task.get("state") not in ("rejected",):
                return task
        return None

    def update_task(self, task_id: str, **fields: Any) -> dict:
        """Create or update a task record (read-modify-write under the lock)."""
        with self._locked():
            tasks = self._read_tasks()
            task = tasks.get(task_id) or {"task_id": task_id, "created": _now_iso(), "requests": []}
            new_requests = fields.pop("add_request", None)
            task.update(fields)
            if new_requests is not None and new_requests not in task["requests"]:
                task["requests"].append(new_requests)
            task["updated"] = _now_iso()
            tasks[task_id] = task
            self._write_tasks(tasks)
            return task

    # --- results ------------------------------------------------------------------------------
    def save_result(self, task_id: str, result: dict) -> Path:
        self.fs.makedirs(str(self.results_dir))
        path = self.results_dir / f"{task_id}.json"
        self.fs.write_atomic(str(path), [json.dumps(result, indent=1, sort_keys=True).encode()])
        return path

    def load_result(self, task_id: str) -> dict | None:
        path = self.results_dir / f"{task_id}.json"
        try:
            return json.loads(path.read_text("utf-8"))
        except (OSError, ValueError):
            return None

    # --- completion forecast's inputs ---------------------------------------------------------
    @property
    def forecast_basis_path(self) -> Path:
        return self.dir / "forecast-basis.json"

    def forecast_basis(self) -> dict:
        """{"profile", "windows", "progress", "cuts"} as last downlinked or heard ({} before any); a damaged file
        reads as empty (the payload sends both again at its next power-on)."""
        try:
            data = json.loads(self.forecast_basis_path.read_text("utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def note_forecast_basis(self, **parts: dict) -> None:
        """Replace the named parts ("profile", "windows", "progress", "cuts") of the forecast basis."""
        with self._locked():
            basis = self.forecast_basis()
            basis.update(parts)
            basis["format"] = 1
            blob = json.dumps(basis, indent=1, sort_keys=True).encode()
            self.fs.write_atomic(str(self.forecast_basis_path), [blob])

    # --- telemetry archive --------------------------------------------------------------------
    def archived(self, since: int) -> list[dict]:
        """Archived packets numbered above `since`, oldest first (the rotated file included)."""
        entries = []
        for path in (self.archive_path.with_suffix(".jsonl.1"), self.archive_path):
            try:
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        try:
                            entry = json.loads(line)
                        except ValueError:
                            continue  # a torn last line from a recorder that was killed
                        if isinstance(entry, dict) and isinstance(entry.get("n"), int) and entry["n"] > since:
                            entries.append(entry)
            except FileNotFoundError:
                continue
        return entries

    def last_archived_number(self) -> int:
        for path in (self.archive_path, self.archive_path.with_suffix(".jsonl.1")):
            try:
                with open(path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - 65536))
                    lines = f.read().splitlines()
            except FileNotFoundError:
                continue
            for line in reversed(lines):
                try:
                    return int(json.loads(line)["n"])
                except (ValueError, KeyError, TypeError):
                    continue
        return 0

    def append_archive(self, line: str) -> None:
        """Append one line (no fsync: a recorder killed mid-line loses that line only)."""
        with open(self.archive_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            size = f.tell()
        if size > ARCHIVE_ROTATE_BYTES:
            os.replace(self.archive_path, self.archive_path.with_suffix(".jsonl.1"))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.ensure()
        with file_lock(self.lock_path):
            yield
