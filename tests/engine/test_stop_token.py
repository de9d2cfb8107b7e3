"""A run ended through its StopToken (flight/events.py): the engine looks at the token at every
unit boundary and returns a status; nothing is raised through it. The run ends at the boundary
after the cancel (no unit after it is reported), the request's directory is byte for byte what
that boundary left (nothing of the unit it stopped after, no RESULT), and a later run resumes
from it to bitwise the uninterrupted answer.

Synchronous writes (testkit's default): every record handed to the writer before a boundary is
on disk at it, so a boundary's directory is a snapshot taken in its UNIT_DONE event."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from testkit import HANG_S, MAX_NEW, engine, inputs_for, run_to_completion

from flight.events import UNIT_DONE, EngineEvent, RunStatus, StopToken
from flight.model.loader import load_model

ARCH = "qwen3-vl"


def _files(ckpt: Path) -> dict[str, bytes]:
    return {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}


class Boundaries:
    """Engine events: counts units, snapshots the directory at each boundary, and asks `act`
    (cancel, pause) of the token at unit `at`."""

    def __init__(self, ckpt: Path, token: StopToken, at: int | None, act: str = "cancel"):
        self.ckpt, self.token, self.at, self.act = ckpt, token, at, act
        self.units: list[tuple[EngineEvent, dict]] = []
        self.snapshots: list[dict[str, bytes]] = []
        self.reached = threading.Event()

    def event(self, event: EngineEvent, **fields) -> None:
        if event not in UNIT_DONE:
            return
        self.units.append((event, fields))
        self.snapshots.append(_files(self.ckpt))
        if self.at is not None and len(self.units) == self.at:
            self.reached.set()
            getattr(self.token, self.act)()


@pytest.fixture(scope="module")
def reference(model_dirs, tmp_path_factory):
    model = load_model(model_dirs[ARCH], device="cpu")
    inputs = inputs_for(model)
    ckpt = tmp_path_factory.mktemp("reference")
    seen = Boundaries(ckpt, StopToken(), None)
    result = engine(model, events=seen.event).run(inputs, str(ckpt), MAX_NEW)
    phases = [event for event, _ in seen.units]
    return inputs, result, phases


def test_a_cancel_ends_the_run_at_the_next_boundary_with_the_disk_as_it_left_it(model_dirs, tmp_path, reference):
    inputs, ref, phases = reference
    vision = phases.count(EngineEvent.VISION_BLOCK_DONE)
    prefill = phases.count(EngineEvent.PREFILL_BLOCK_DONE)
    # one boundary in each phase: a vision block, prefill blocks (inside the plan executor), the
    # decode step before the last, and the last step (which would have written RESULT)
    picks = [2, vision + 1, vision + prefill // 2 + 1, len(phases) - 1, len(phases)]
    for n in picks:
        ckpt = tmp_path / f"cancel-{n}"
        token = StopToken()
        seen = Boundaries(ckpt, token, n)
        outcome = engine(load_model(model_dirs[ARCH], device="cpu"), events=seen.event).run_or_stop(
            inputs, str(ckpt), MAX_NEW, token
        )
        assert outcome.status == RunStatus.CANCELLED and outcome.result is None, n
        assert len(seen.units) == n, f"cancelled at unit {n}, ran on to unit {len(seen.units)}"
        event, fields = seen.units[-1]
        assert outcome.stopped_after == {"event": event, **fields}
        assert event == phases[n - 1]
        assert _files(ckpt) == seen.snapshots[-1], f"the directory changed after the boundary of unit {n}"
        assert "RESULT" not in _files(ckpt)
    # the state left is a boundary's: a later run resumes from it to the same answer
    for n in (vision + 1, len(phases) - 1):
        resumed = run_to_completion(model_dirs[ARCH], inputs, tmp_path / f"cancel-{n}")
        assert resumed.resumed_from["phase"] != "start" or n == vision + 1
        assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits), n


def test_a_cancel_from_another_thread_and_a_pause(model_dirs, tmp_path, reference):
    """The payload cancels from its command thread while the worker computes; a pause leaves a
    directory a later run resumes from."""
    inputs, ref, phases = reference
    ckpt = tmp_path / "threaded"
    token = StopToken()
    seen = Boundaries(ckpt, token, 3, act="requested")  # only marks unit 3; the cancel comes from a thread
    canceller = threading.Thread(target=lambda: seen.reached.wait(HANG_S) and token.cancel())
    canceller.start()
    outcome = engine(load_model(model_dirs[ARCH], device="cpu"), events=seen.event).run_or_stop(
        inputs, str(ckpt), MAX_NEW, token
    )
    canceller.join(HANG_S)
    assert seen.reached.is_set(), "the run never reached unit 3"
    assert outcome.status == RunStatus.CANCELLED
    assert 3 <= len(seen.units) < len(phases)
    assert outcome.stopped_after == {"event": seen.units[-1][0], **seen.units[-1][1]}
    assert _files(ckpt) == seen.snapshots[-1]

    paused = tmp_path / "paused"
    token = StopToken()
    seen = Boundaries(paused, token, 5, act="pause")
    outcome = engine(load_model(model_dirs[ARCH], device="cpu"), events=seen.event).run_or_stop(
        inputs, str(paused), MAX_NEW, token
    )
    assert outcome.status == RunStatus.PAUSED and len(seen.units) == 5
    assert _files(paused) == seen.snapshots[-1]
    resumed = run_to_completion(model_dirs[ARCH], inputs, paused)
    assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits)


def test_the_process_stop_pauses_and_a_cancel_outranks_a_pause():
    """The payload's process-wide stop (an Event) pauses whatever runs; the token never sets it."""
    stopping = threading.Event()
    token = StopToken(paused_by=stopping)
    assert token.requested() is None
    token.pause()
    assert token.requested() == RunStatus.PAUSED and not stopping.is_set()
    other = StopToken(paused_by=stopping)
    stopping.set()
    assert other.requested() == RunStatus.PAUSED
    other.cancel()
    assert other.requested() == RunStatus.CANCELLED


def test_inputs_that_cannot_be_had_end_the_run_awaiting_them_without_raising(model_dirs, tmp_path, reference):
    """The payload's pixel loader answers None when a task's stored pixels and one of its images
    are damaged (it waits for the ground to send the image again): the engine ends the run with
    AWAITING_INPUTS before the vision block that needed them -- no exception through its stack,
    no unit run -- and a later run with the pixels gives the uninterrupted answer."""
    from flight.model.inputs import RequestInputs

    inputs, ref, _ = reference
    asked = []

    def unavailable():
        asked.append(True)
        return None

    awaiting = RequestInputs(
        inputs.input_ids,
        inputs.mm_token_type_ids,
        None,
        inputs.image_grid_thw,
        inputs.prompt,
        load_pixels=unavailable,
        digest=inputs.digest(),
    )
    ckpt = tmp_path / "awaiting"
    seen = Boundaries(ckpt, StopToken(), None)
    model = load_model(model_dirs[ARCH], device="cpu")
    outcome = engine(model, events=seen.event).run_or_stop(awaiting, str(ckpt), MAX_NEW, StopToken())
    assert outcome.status == RunStatus.AWAITING_INPUTS and outcome.result is None and outcome.stopped_after is None
    assert asked == [True] and seen.units == []
    assert "RESULT" not in _files(ckpt)
    result = engine(model).run(inputs, str(ckpt), MAX_NEW)
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)
