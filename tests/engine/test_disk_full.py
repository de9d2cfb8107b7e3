"""ENOSPC while writing a checkpoint: inference carries on without that checkpoint, logs an
event, leaves no partial file behind, and later records still resume correctly."""

import errno
import os
import subprocess
import uuid

import pytest
import torch
from testkit import MAX_NEW, CutAfter, engine, inputs_for, run_to_completion

from common.durable import DurableFS
from flight.engine import SimulatedCut
from flight.model.loader import load_model


class FillingDisk(DurableFS):
    """A disk that is full between two byte marks: writes fail part-way with ENOSPC, as a real
    file system's write() does once its blocks run out."""

    def __init__(self, full_from: int, full_until: int):
        self.written, self.full_from, self.full_until = 0, full_from, full_until
        self.failures = 0

    def _metered(self, chunks):
        for chunk in chunks:
            n = memoryview(chunk).nbytes
            if self.full_from <= self.written + n and self.written < self.full_until:
                self.failures += 1
                self.written += n
                yield bytes(memoryview(chunk).cast("B")[: n // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += n
            yield chunk

    def write_atomic(self, path, chunks):
        return super().write_atomic(path, self._metered(chunks))

    def append(self, path, chunks):
        return super().append(path, self._metered(chunks))


def _reference(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    return inputs, engine(model).run(inputs, str(tmp_path / "ref"), MAX_NEW)


@pytest.mark.parametrize("async_writes", [False, True])
def test_full_disk_skips_checkpoints_and_carries_on(model_dirs, tmp_path, async_writes):
    inputs, ref = _reference(model_dirs, tmp_path)
    size = ref.bytes_written
    events = []
    disk = FillingDisk(full_from=size // 4, full_until=size // 2)
    result = engine(
        load_model(model_dirs["qwen3-vl"], device="cpu"),
        fs=disk,
        async_writes=async_writes,
        events=lambda name, **kw: events.append((name, kw)),
    ).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)
    failed = [kw for name, kw in events if name == "checkpoint_write_failed"]
    assert failed and disk.failures == len(failed) == result.records_skipped
    assert all(kw["errno"] == errno.ENOSPC for kw in failed)
    leftovers = [n for _, _, names in os.walk(tmp_path / "ck") for n in names if n.endswith(".tmp")]
    assert leftovers == []


def test_decode_records_cover_a_skipped_record(model_dirs, tmp_path):
    """A decode record lost to ENOSPC leaves no gap: the next one covers its steps too."""
    inputs, ref = _reference(model_dirs, tmp_path)
    ckpt = str(tmp_path / "ck")
    events = []

    class FullForOneDecodeRecord(DurableFS):
        appends = 0

        def append(self, path, chunks):
            self.appends += 1
            if self.appends == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().append(path, chunks)

    cut = CutAfter(MAX_NEW - 2 + 12, names=("decode_step_done", "prefill_block_done", "vision_block_done"))
    with pytest.raises(SimulatedCut):
        engine(
            load_model(model_dirs["qwen3-vl"], device="cpu"),
            fs=FullForOneDecodeRecord(),
            events=lambda n, **kw: (events.append(n), cut.event(n, **kw)),
        ).run(inputs, ckpt, MAX_NEW)
    assert "checkpoint_write_failed" in events
    resumed = run_to_completion(model_dirs["qwen3-vl"], inputs, ckpt)
    assert resumed.resumed_from["phase"] == "decode" and resumed.resumed_from["position"] >= 4
    assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits)


def test_real_full_tmpfs(model_dirs, tmp_path):
    """The same on a real 96 KiB tmpfs (needs mount permission; skipped without it)."""
    inputs, ref = _reference(model_dirs, tmp_path)
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        events = []
        result = engine(
            load_model(model_dirs["qwen3-vl"], device="cpu"),
            async_writes=True,
            events=lambda n, **kw: events.append((n, kw)),
        ).run(inputs, str(mnt / "ck"), MAX_NEW)
        assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)
        failed = [kw for n, kw in events if n == "checkpoint_write_failed"]
        assert failed and all(kw["errno"] == errno.ENOSPC for kw in failed)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
