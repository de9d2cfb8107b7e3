"""The checkpoint writer: optional records (intermediate vision states) give way to a busy writer
instead of stalling the compute thread; mandatory ones, and those the bus asked for, never do."""
import threading
import time

import torch

from common.durable import DurableFS
from flight.checkpoint.writer import CheckpointWriter
from flight.engine import SimulatedCut
from flight.model.loader import load_model

from testkit import MAX_NEW, CutAfter, engine, inputs_for, run_to_completion


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
    """Storage on which a vision-state record takes far longer than a tiny vision block."""

    def write_atomic(self, path, chunks):
        n = super().write_atomic(path, chunks)
        if "vision." in str(path) and not str(path).endswith("vision.out"):
            time.sleep(0.3)
        return n


def test_slow_storage_defers_vision_states_and_the_answer_is_unchanged(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ref = engine(model).run(inputs, str(tmp_path / "ref"), MAX_NEW)  # synchronous: every state written
    assert ref.records_deferred == 0
    events = []
    result = engine(load_model(model_dirs["qwen3-vl"], device="cpu"), fs=SlowVisionDisk(), async_writes=True,
                    events=lambda n, **kw: events.append((n, kw))).run(inputs, str(tmp_path / "ck"), MAX_NEW)
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
    eng = engine(load_model(model_dirs["qwen3-vl"], device="cpu"), fs=SlowVisionDisk(), async_writes=True,
                 after_commit=lambda what, n: committed.append(what))
    cut = CutAfter(3, names=("vision_block_done",))

    def on_event(name, **kw):
        if name == "vision_block_done" and kw["block"] == 2:
            eng.checkpoint_soon.set()  # the warning arrives while vision.state[1] is being written
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
