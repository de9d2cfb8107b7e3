"""Storage as an environment condition (issue: reliability, second round, findings 1, 2 and 4),
against the real payload process under the scripted bus (hil/scripted_bus.py).

A full, read-only, failing or stalled data disk is never charged to a task, never quarantines it
and never stops the payload: PING, STATUS and heartbeats never wait on the disk, commands that
need the disk are refused with a code, and the payload resumes on its own when the disk does.

Where a real file system can show it (root: a small tmpfs, a read-only remount), it is used;
elsewhere the faults come from the DurableFS injection (OW_STORAGE_FAULTS, common/durable.py).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from testkit import HANG_S, make_images

from common.wire import EventId, ResponseCode, StorageState
from common.wire import messages as m
from hil.scripted_bus import BusPeer, spawn_flight

pytestmark = pytest.mark.slow

#: Events that would mean a fault of the environment was charged to a task or killed the payload.
CHARGED = {
    EventId.ABNORMAL_EXIT,
    EventId.ITEM_QUARANTINED,
    EventId.TASK_FAILED,
    EventId.WORKER_FAULT,
    EventId.MAIN_LOOP_FAULT,
    EventId.COMMAND_FAULT,
    EventId.FATAL_ERROR,
}


def _png() -> bytes:
    buf = io.BytesIO()
    make_images()[1].save(buf, format="PNG")
    return buf.getvalue()


def _control(path: Path, **spec) -> None:
    """Rewrite the fault control file atomically (the payload reads it again when it changes)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, path)


class Payload:
    def __init__(self, tmp_path: Path, model: str, data: Path, *extra: str, env: dict | None = None):
        self.bus = BusPeer(str(tmp_path / "keys"))
        self.tmp_path, self.model, self.data, self.extra, self.env = tmp_path, model, data, extra, env
        self._spawn()

    def restart(self) -> None:
        """A power cut and the next boot, under the same scripted bus (its numbering goes on)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.bus.received.clear()
        self._spawn()

    def _spawn(self) -> None:
        saved = dict(os.environ)
        os.environ.update(self.env or {})
        try:
            self.proc = spawn_flight(
                self.data,
                self.model,
                self.tmp_path / "keys",
                self.bus.endpoint,
                *self.extra,
                log_path=self.tmp_path / "flight.log",
            )
        finally:
            os.environ.clear()
            os.environ.update(saved)
        deadline = time.monotonic() + 600
        while True:  # a payload that exits at boot (what these tests guard against) fails at once
            try:
                self.bus.wait_connected(timeout=2)
                break
            except TimeoutError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"the payload never connected (exit status {self.proc.poll()})") from None

    def verdict(self, seq: int, timeout: float = 120.0) -> m.Message:
        return self.bus.wait_for(lambda h, x: isinstance(x, (m.Accepted, m.Rejected)) and x.tc_seq == seq, timeout)[1]

    def upload(self, name: str, content: bytes) -> None:
        for chunk in m.ImageChunk.split(name, content, chunk_bytes=4096):
            assert isinstance(self.verdict(self.bus.command(chunk)), m.Accepted)

    def event(self, event_id: EventId, timeout: float = 120.0, start: int = 0) -> m.Event:
        return self.bus.wait_for(lambda h, x: isinstance(x, m.Event) and x.event_id == event_id, timeout, start)[1]

    def events(self) -> set[EventId]:
        return {x.event_id for _, x in self.bus.received if isinstance(x, m.Event)}

    def ping(self, key: int, timeout: float = 60.0) -> None:
        self.bus.command(m.Ping(key=key))
        self.bus.wait_for(lambda h, x: isinstance(x, m.Pong) and x.key == key, timeout)

    def status(self) -> m.Housekeeping:
        seq = self.bus.command(m.Status())
        assert isinstance(self.verdict(seq), m.Accepted)
        mark = len(self.bus.received)
        return self.bus.wait_for(lambda h, x: isinstance(x, m.Housekeeping), HANG_S, mark)[1]

    def result(self, task_id: str, timeout: float = 300.0) -> m.TaskResult:
        self.bus.wait_for(
            lambda h, x: isinstance(x, (m.Completed, m.Failed)) and x.task_id == task_id and x.tc_type == 0x0110,
            timeout,
        )
        final = [x for _, x in self.bus.received if isinstance(x, (m.Completed, m.Failed)) and x.task_id == task_id]
        assert isinstance(final[-1], m.Completed), final[-1]
        return self.bus.wait_for(lambda h, x: isinstance(x, m.TaskResult) and x.task_id == task_id, HANG_S)[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.bus.close()


def _task(task_id: str, tokens: int = 12) -> m.UplinkTask:
    return m.UplinkTask(
        task_id=task_id, prompt="count the ships", images=["scene.png"], max_new_tokens=tokens, priority=0
    )


def test_a_full_disk_mid_task_is_waited_out_never_charged_to_the_task(tmp_path, model_dirs):
    """Finding 1 (a briefly full disk quarantined acknowledged tasks, silently) and 2 (full
    storage made the payload deaf). The disk fills while a task runs: the reserve is given back,
    STORAGE_FULL says so, the task goes on without checkpoints and its result is stored in the
    reserve's space; PING and STATUS are answered, a new uplink is refused STORAGE_FULL; nothing is
    counted against the task. Once space returns, STORAGE_RESTORED, the same task uplinked again
    is accepted and gives the same tokens (a run on a healthy disk is the reference)."""
    control = tmp_path / "faults.json"
    _control(control, mode="ok")
    data = tmp_path / "data"
    payload = Payload(
        tmp_path,
        model_dirs["qwen3-vl"],
        data,
        "--pace-ms",
        "60",
        "--storage-reserve-mb",
        "1",
        env={"OW_STORAGE_FAULTS": str(control)},
    )
    try:
        payload.upload("scene.png", _png())
        assert isinstance(payload.verdict(payload.bus.command(_task("t-full"))), m.Accepted)
        payload.bus.wait_for(lambda h, x: isinstance(x, m.Progress) and x.task_id == "t-full", 300)
        _control(control, mode="full", free_bytes=0, under=[str(data)])
        payload.event(EventId.STORAGE_FULL)
        payload.ping(101)
        assert payload.status().storage_state == StorageState.FULL
        refused = payload.verdict(payload.bus.command(_task("t-new")))
        assert isinstance(refused, m.Rejected) and refused.code == ResponseCode.STORAGE_FULL, refused
        full_result = payload.result("t-full")
        assert not payload.events() & CHARGED, payload.events() & CHARGED
        _control(control, mode="ok")
        payload.event(EventId.STORAGE_RESTORED)
        assert payload.status().storage_state == StorageState.OK
        assert isinstance(payload.verdict(payload.bus.command(_task("t-new"))), m.Accepted)
        reference = payload.result("t-new")
        assert full_result.token_ids == reference.token_ids
        assert full_result.logits_sha256 == reference.logits_sha256
        assert payload.proc.poll() is None
        assert not payload.events() & CHARGED
    finally:
        payload.close()


def test_a_stalled_disk_delays_no_heartbeat_and_no_ping(tmp_path, model_dirs):
    """Finding 4: fsync delayed on the data disk stopped the heartbeat (FDIR then power-cycled a
    payload that was only waiting on its disk). While an uplink's journal write is stalled, PINGs
    are answered and heartbeats keep coming -- before that uplink is acknowledged -- and the stall
    is reported (STORAGE_STALL), not mistaken for a hang. Ordering, not clocks: the stall is far
    longer than anything else here takes."""
    control = tmp_path / "faults.json"
    _control(control, mode="ok")
    data = tmp_path / "data"
    payload = Payload(
        tmp_path, model_dirs["qwen3-vl"], data, "--storage-reserve-mb", "0", env={"OW_STORAGE_FAULTS": str(control)}
    )
    try:
        payload.upload("scene.png", _png())
        _control(control, stall_s=8.0, under=[str(data / "queue")])
        mark = len(payload.bus.received)
        uplink = payload.bus.command(_task("t-stalled", tokens=2))
        payload.event(EventId.STORAGE_STALL, timeout=60, start=mark)
        payload.ping(202)
        assert payload.status().longest_write_s >= 2.0  # the write still running, as LONGEST_WRITE
        payload.ping(203)
        during = payload.bus.received[mark:]
        acks = [x for _, x in during if isinstance(x, (m.Accepted, m.Rejected)) and x.tc_seq == uplink]
        assert not acks, "the uplink was acknowledged before the stalled write it needs ended"
        assert sum(isinstance(x, m.Heartbeat) for _, x in during) >= 2
        _control(control, mode="ok")
        assert isinstance(payload.verdict(uplink), m.Accepted)
        payload.result("t-stalled")
        assert not payload.events() & CHARGED
    finally:
        payload.close()


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")


def _fill(where: Path) -> Path:
    """Fill a file system to the last byte; returns the filler file."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (64 << 10, 4096, 1):
            try:
                while f.write(bytes(size)):
                    pass
            except OSError:
                pass
    return filler


def test_boots_on_a_real_full_then_read_only_disk_and_recovers(tmp_path, model_dirs):
    """Finding 2 on a real file system: every boot on a full disk exited at its first state save
    (a boot loop), a read-only one likewise. Here a small tmpfs is filled to the last byte before
    the payload first boots: it comes up, answers PING and STATUS (storage full), refuses an uplink
    with STORAGE_FULL, and takes it once space returns. Then the disk is remounted read-only under
    the running payload: an uplink is refused STORAGE_READ_ONLY (the event says why), PING still
    answered; a boot on the read-only disk comes up too; writable again, the payload resumes by
    itself and the queued task runs."""
    mount = tmp_path / "mnt"
    _mount_tmpfs(mount, "4m")
    data = mount / "data"
    payload = None
    try:
        data.mkdir()
        filler = _fill(mount)
        payload = Payload(tmp_path, model_dirs["qwen3-vl"], data, "--storage-reserve-mb", "0.5")
        payload.ping(1)
        assert payload.status().storage_state == StorageState.FULL
        refused = payload.verdict(payload.bus.command(m.ImageChunk.split("scene.png", _png(), 4096)[0]))
        assert isinstance(refused, m.Rejected) and refused.code == ResponseCode.STORAGE_FULL
        filler.unlink()
        payload.event(EventId.STORAGE_RESTORED)
        payload.upload("scene.png", _png())
        # A read-only bind mount of the data directory over itself: the kernel refuses to remount a
        # file system read-only while a process holds files open for writing, as the payload does.
        subprocess.run(["mount", "--bind", str(data), str(data)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(data)], check=True)
        refused = payload.verdict(payload.bus.command(_task("t-ro", tokens=2)))
        assert isinstance(refused, m.Rejected) and refused.code == ResponseCode.STORAGE_READ_ONLY, refused
        payload.event(EventId.STORAGE_READ_ONLY)
        payload.ping(2)
        payload.restart()
        payload.ping(3)
        payload.event(EventId.STORAGE_READ_ONLY)
        assert payload.status().storage_state == StorageState.READ_ONLY
        subprocess.run(["mount", "-o", "remount,bind,rw", str(data)], check=True)
        payload.event(EventId.STORAGE_RESTORED)
        assert isinstance(payload.verdict(payload.bus.command(_task("t-ro", tokens=2))), m.Accepted)
        payload.result("t-ro")
        assert not payload.events() & CHARGED
    finally:
        if payload is not None:
            payload.close()
        subprocess.run(["umount", "-l", str(data)], capture_output=True)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
