"""The checkpoint writer: optional records (intermediate vision states) give way to a busy writer
instead of stalling the compute thread; mandatory ones, and those the bus asked for, never do."""

import threading
import time

import pytest
import torch
from testkit import HANG_S, MAX_NEW, CutAfter, engine, inputs_for, run_to_completion

from common.durable import DurableFS
from flight.checkpoint.writer import CheckpointWriter
from flight.engine import SimulatedCut
from flight.events import UNIT_DONE
from flight.model.loader import load_model


def test_an_optional_record_is_dropped_while_the_writer_is_busy():
    events, written = [], []
    release = threading.Event()

    def slow(name):
        release.wait(10)
        written.append(name)
        return 1

    def fast(name):
        written.append(name)
        return 1

    w = CheckpointWriter(lambda name, **kw: events.append((name, kw)))
    try:
        assert w.submit("a", slow, "a") is True
        assert w.submit("b", fast, "b", optional=True) is False  # "a" is still being written
        release.set()
        w.drain()
        assert w.submit("c", fast, "c", optional=True) is True  # idle again: written
        w.drain()
    finally:
        w.close()
    assert written == ["a", "c"]
    assert w.records_deferred == 1 and w.records_committed == 2
    assert ("checkpoint_deferred", {"record": "b", "reason": "writer busy"}) in events


def test_a_synchronous_writer_never_drops_optional_records():
    w = CheckpointWriter(lambda *a, **k: None, async_writes=False)
    assert all(w.submit(str(i), lambda: 1, optional=True) for i in range(5))
    assert w.records_committed == 5 and w.records_deferred == 0


class SlowVisionDisk(DurableFS):
    """Storage on which a vision-state record is still being written when the engine has finished
    two more units of work: each is held until then (`unit_done`, from the engine's events), so the
    writer is busy when the next state comes, however fast or slow the machine computes a block.
    `stop_holding` ends the holds (where the engine is about to wait for the writer)."""

    #: the hold's own limit: it ends early only where the engine waits for this very write (then no
    #: unit can finish); the writer's rules are what is tested, not a race against the compute
    HOLD_LIMIT_S = 30.0

    def __init__(self):
        self.units = 0
        self.holding = True
        self.progress = threading.Condition()

    def stop_holding(self):
        with self.progress:
            self.holding = False
            self.progress.notify_all()

    def unit_done(self, name, **_):
        if name in UNIT_DONE:
            with self.progress:
                self.units += 1
                self.progress.notify_all()

    def write_atomic(self, path, chunks):
        n = super().write_atomic(path, chunks)
        if "vision." in str(path) and not str(path).endswith("vision.out"):
            with self.progress:
                began = self.units
                self.progress.wait_for(lambda: self.units >= began + 2 or not self.holding, self.HOLD_LIMIT_S)
        return n


def test_slow_storage_defers_vision_states_and_the_answer_is_unchanged(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ref = engine(model).run(inputs, str(tmp_path / "ref"), MAX_NEW)  # synchronous: every state written
    assert ref.records_deferred == 0
    events = []
    disk = SlowVisionDisk()

    def on_event(name, **kw):
        events.append((name, kw))
        disk.unit_done(name)
        if name == "vision_block_done" and kw["block"] == kw["of"]:
            disk.stop_holding()  # what comes next (prefill) waits for the last state's write

    result = engine(
        load_model(model_dirs["qwen3-vl"], device="cpu"),
        fs=disk,
        async_writes=True,
        # the writer's own drops; the adaptive cadence would skip some of these states first
        # (docs/engine.md, "Cadence"), by how this machine's timings compare
        cadence="fixed",
        events=on_event,
    ).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    deferred = [kw["record"] for n, kw in events if n == "checkpoint_deferred"]
    assert deferred and result.records_deferred == len(deferred)
    assert all(r.startswith("vision.state[") for r in deferred)  # prefill and decode records never
    assert result.records_written == ref.records_written - len(deferred)
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)


def test_a_requested_checkpoint_waits_for_the_writer_and_a_cut_resumes_from_it(model_dirs, tmp_path):
    """checkpoint_soon (the bus warned of a cut) makes the next vision state mandatory even while
    the writer is busy; a cut one block later resumes from that state, bitwise. (The cut here
    lets queued records finish, as the writer is joined; what matters is that vision.state[2] was
    submitted at all.)"""
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ref = engine(model).run(inputs, str(tmp_path / "ref"), MAX_NEW)
    ckpt = str(tmp_path / "ck")
    committed = []
    disk = SlowVisionDisk()
    eng = engine(
        load_model(model_dirs["qwen3-vl"], device="cpu"),
        fs=disk,
        async_writes=True,
        cadence="fixed",  # the writer's rules, not the adaptive cadence's skips
        after_commit=lambda what, n: committed.append(what),
    )
    cut = CutAfter(3, names=("vision_block_done",))

    def on_event(name, **kw):
        if name == "vision_block_done" and kw["block"] == 2:
            eng.checkpoint_soon.set()  # the warning arrives while vision.state[1] is being written
            # ... and that write ends only now (holding the next one would hold the engine waiting
            # for it)
            disk.stop_holding()
        cut.event(name, **kw)

    eng.events = on_event
    try:
        eng.run(inputs, ckpt, MAX_NEW)
        raise AssertionError("the cut did not happen")
    except SimulatedCut:
        pass
    assert "vision.state[2]" in committed
    resumed = run_to_completion(model_dirs["qwen3-vl"], inputs, ckpt)
    assert resumed.resumed_from == {"phase": "vision", "position": 2}
    assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits)


def test_a_background_record_gives_way_to_ordered_records_between_slices():
    release, log = threading.Event(), []

    def ordered(name, gate=None):
        if gate is not None:
            gate.wait(HANG_S)
        log.append(name)
        return 1

    def background(between_slices=None):
        for i in range(3):
            between_slices()
            log.append(f"slice{i}")
        return 3

    w = CheckpointWriter(lambda *a, **k: None)
    try:
        w.submit("block0", ordered, "block0", release)  # being written, held
        w.submit_background("vision.out", background)
        time.sleep(0.3)
        assert log == []  # the background record waits while an ordered record is outstanding
        release.set()
        w.drain()
    finally:
        w.close()
    assert log == ["block0", "slice0", "slice1", "slice2"]
    assert w.records_committed == 2 and w.bytes_committed == 4


class GatedVisionOut(DurableFS):
    """vision.out takes until `gate` opens; if the power is gone by then, it never lands."""

    def __init__(self):
        self.gate, self.power_lost = threading.Event(), False

    def write_atomic(self, path, chunks):
        if str(path).endswith("vision.out"):
            self.gate.wait(HANG_S)
            if self.power_lost:
                raise SimulatedCut("power lost while vision.out was being written")
        return super().write_atomic(path, chunks)


def test_prefill_blocks_commit_ahead_of_vision_out_and_a_cut_between_resumes_bitwise(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ref = engine(model).run(inputs, str(tmp_path / "ref"), MAX_NEW)
    ckpt = tmp_path / "ck"
    disk, committed = GatedVisionOut(), []

    def after_commit(what, n):
        committed.append(what)
        if what.startswith("prefill[g1,c0]"):
            disk.power_lost = True
            disk.gate.set()
            raise SimulatedCut("cut after prefill[g1,c0]")

    eng = engine(
        load_model(model_dirs["qwen3-vl"], device="cpu"), fs=disk, async_writes=True, after_commit=after_commit
    )
    try:
        eng.run(inputs, str(ckpt), MAX_NEW)
        raise AssertionError("the cut did not happen")
    except SimulatedCut:
        pass
    assert "vision.out" not in committed and any(c.startswith("prefill[g0,c0]") for c in committed)
    assert not (ckpt / "vision.out").exists() and (ckpt / "prefill").is_dir()
    assert (ckpt / "vision.A").exists() or (ckpt / "vision.B").exists()  # kept until vision.out lands
    resumed = run_to_completion(model_dirs["qwen3-vl"], inputs, ckpt)
    assert resumed.resumed_from["phase"] == "prefill"
    assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits)


def test_throttled_writes_are_charged_chunk_by_chunk(tmp_path):
    from common.durable import ThrottledFS

    # Lower bounds from the moment the bucket starts (empty) only: a slow or busy machine can
    # only add time, and a chunk late to start leaves the next less to wait, so gaps between
    # chunks prove nothing (seen at 0.084 s on a starved core).
    before = time.monotonic()
    fs, asked = ThrottledFS(None, 1_000_000), []

    def chunks():
        for _ in range(3):
            asked.append(time.monotonic() - before)
            yield bytes(100_000)

    assert fs.write_atomic(str(tmp_path / "r"), chunks()) == 300_000
    slack = 1e-4  # the clock's rounding, not the machine's speed
    assert time.monotonic() - before >= 0.3 - slack  # 300 kB at 1 MB/s, from an empty bucket
    assert asked[1] >= 0.1 - slack and asked[2] >= 0.2 - slack  # each chunk paid before the next is asked for


class SlowDisk(DurableFS):
    """Every whole-file record takes 50 ms: far slower than a tiny model's block."""

    def write_atomic(self, path, chunks):
        n = super().write_atomic(path, chunks)
        time.sleep(0.05)
        return n


def test_checkpointing_holds_at_most_two_records_of_state_even_when_the_disk_lags(model_dirs, tmp_path):
    """What checkpointing keeps alive is bounded by records, not by how far the disk lags: at most
    two records (one written, one queued), whichever phase they come from."""
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    sizes: dict[str, list[int]] = {}

    def on_event(name, **kw):
        if name == "checkpoint_committed":
            sizes.setdefault(kw["record"].split("[")[0], []).append(kw["bytes"])

    # the fixed cadence: every scheduled vision state reaches the writer, which drops or queues it
    result = engine(model, fs=SlowDisk(), async_writes=True, cadence="fixed", events=on_event).run(
        inputs, str(tmp_path / "ck"), MAX_NEW
    )
    peaks = result.held_state_peak_bytes
    block = max(sizes["prefill"])  # record bytes: tensors plus a small header
    state = max(sizes["vision.state"])
    # The disk lagged (two held), and never more than two records: the second may be a vision
    # state still queued when prefill began (one the cadence would not drop).
    assert block < peaks["prefill"] <= block + max(block, state)
    # Vision states: one being written and at most one waiting (the one after a dropped state
    # is kept, so that a lagging disk cannot starve progress; engine.md "Cadence").
    assert 0 < peaks["vision"] <= 2 * state
    assert result.records_deferred > 0


class _Bucket:
    """Records what a ThrottledFS charges (the real TokenBucket's sleeps are tested above)."""

    def __init__(self):
        self.taken = []

    def take(self, nbytes):
        self.taken.append(nbytes)
        return 0.0


def test_a_weighted_view_shares_the_device_and_charges_its_weight(tmp_path):
    """The payload's own data (task inputs, images) goes through a weighted view of the storage
    that the checkpoint records use: the same buckets, each byte charged `weight` bytes."""
    from common.durable import ThrottledFS

    fs = ThrottledFS(1_000_000, 1_000_000)
    fs.read_bucket, fs.write_bucket = _Bucket(), _Bucket()
    data = fs.weighted(0.25)
    assert data.write_bucket is fs.write_bucket and data.read_bucket is fs.read_bucket and fs.weight == 1.0
    data.write_atomic(str(tmp_path / "inputs"), [bytes(400_000)])
    fs.write_atomic(str(tmp_path / "record"), [bytes(400_000)])
    assert fs.write_bucket.taken == [100_000, 400_000]
    data.read(str(tmp_path / "inputs"))
    fs.read(str(tmp_path / "record"))
    assert fs.read_bucket.taken == [100_000, 400_000]
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="storage weight"):
            fs.weighted(bad)


def test_the_payload_charges_its_own_data_at_the_emulated_weight():
    import argparse

    from common.durable import DurableFS, ThrottledFS
    from common.errors import CliError
    from flight.cli_options import data_storage_for, storage_for

    args = argparse.Namespace(emulate_read_mbps=1.0, emulate_write_mbps=0.5, emulate_data_weight=0.25)
    fs, _ = storage_for(args)
    data = data_storage_for(args, fs)
    assert isinstance(data, ThrottledFS) and data.weight == 0.25 and data.write_bucket is fs.write_bucket
    assert data_storage_for(argparse.Namespace(emulate_data_weight=None), fs) is fs  # not named: one weight
    plain = DurableFS()
    assert data_storage_for(args, plain) is plain  # nothing throttled: nothing to weigh
    with pytest.raises(CliError, match="emulate-data-weight"):
        data_storage_for(argparse.Namespace(emulate_data_weight=2.0), fs)
