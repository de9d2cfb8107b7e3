"""Recovery plans beyond prefill (flight/recovery/phases.py): the vision phase reads ahead in
need order, a prefill plan reads the visual tokens first, a decode restart runs its first step
group by group behind the reads. Bitwise results after restarts in every phase are proven by
tests/engine/test_exhaustive_stops.py; this checks what is read, in which order, against what."""

from __future__ import annotations

import threading

import pytest
import torch
from testkit import HANG_S, MAX_NEW, CutAfter, engine, inputs_for, run_to_completion

from flight.engine import SimulatedCut
from flight.model.loader import load_model
from flight.recovery.phases import VISION_OUT, PhaseExecutor, ReadAhead, StepOp, needs_vision_out
from flight.recovery.plan import ComputeOp, ReadOp, RecoveryProblem, make_plan


def test_read_ahead_reads_in_order_and_hands_over_values_and_errors():
    order, gate = [], threading.Event()

    def read(name, value=None, fail=False):
        def fn():
            if name == "b":
                gate.wait(HANG_S)
            order.append(name)
            if fail:
                raise OSError("bad sector")
            return value, 10

        return fn

    reads = ReadAhead([("a", read("a", 1)), ("b", read("b", 2)), ("c", read("c", fail=True)), ("d", read("d", 4))])
    reads.start()
    assert reads.result("a") == 1
    gate.set()
    assert reads.result("b") == 2
    with pytest.raises(OSError):
        reads.result("c")
    assert reads.result("d") == 4 and order == ["a", "b", "c", "d"] and reads.bytes_read == 30
    stopped = ReadAhead([("x", read("x", 1))])
    stopped.stop()  # never started: nothing is read, waiting returns at once
    assert stopped.result("x") is None


def test_first_decode_step_of_a_group_waits_for_that_group_only():
    problem = RecoveryProblem(3, 4, {(g, c) for g in range(3) for c in range(4)}, set(), need_last_hidden=False)
    plan = make_plan("layer-first", problem)
    plan.computes = plan.computes + [StepOp(g) for g in range(3)]
    executor = PhaseExecutor(plan, None, None, num_chunks=4)
    reads, computed = executor.dependencies(StepOp(1))
    assert set(reads) == {ReadOp("weights", 1)} | {ReadOp("kv", 1, c) for c in range(4)}
    assert computed == [(0, -1)]  # the step through group 0
    # group 1's reads come before group 2's: the step through group 1 overlaps them
    last_read_of = {g: max(i for i, r in enumerate(plan.reads) if r.group == g) for g in range(3)}
    assert last_read_of[0] < last_read_of[1] < last_read_of[2]


def test_recomputed_visual_blocks_wait_for_vision_out_read_first():
    problem = RecoveryProblem(2, 3, {(1, 0)}, {(1, 0)})
    plan = make_plan("chunk-first", problem)
    plan.reads.insert(0, VISION_OUT)
    executor = PhaseExecutor(plan, None, None, visual_chunks=frozenset({0, 1}), num_chunks=3)
    deps = {(op.group, op.chunk): executor.dependencies(op)[0] for op in plan.computes}
    assert VISION_OUT in deps[(0, 0)] and VISION_OUT in deps[(0, 1)]
    assert VISION_OUT not in deps[(0, 2)] and VISION_OUT not in deps[(1, 1)]


def test_deepstack_layer_blocks_wait_for_vision_out_too():
    """A group holding a DeepStack layer adds visual features: its visual blocks need vision.out
    as group 0's do (PrefillRestore.vision_groups)."""
    problem = RecoveryProblem(3, 2, {(0, 0), (0, 1)}, {(0, 0), (0, 1)})
    plan = make_plan("layer-first", problem)
    plan.reads.insert(0, VISION_OUT)
    executor = PhaseExecutor(
        plan, None, None, visual_chunks=frozenset({0, 1}), num_chunks=2, vision_groups=frozenset({0, 1})
    )
    deps = {(op.group, op.chunk): executor.dependencies(op)[0] for op in plan.computes}
    assert VISION_OUT in deps[(1, 0)] and VISION_OUT in deps[(1, 1)]
    assert VISION_OUT not in deps[(2, 0)] and VISION_OUT not in deps[(2, 1)]


def test_group_zero_reprojections_of_visual_chunks_wait_for_vision_out_read_first():
    """HCache re-projects layer 0's KV from the chunk's embeddings, the visual tokens among them:
    that needs vision.out as a block of group 0 does. Until 2026-12 the plan left the read out
    and the re-projection read it on the compute thread (3 MB through the testbench's throttle,
    10 trace s of every HCache restore, unplanned and unsimulated)."""
    every = {(g, c) for g in range(3) for c in range(3)}
    plan = make_plan("layer-first", RecoveryProblem(3, 3, set(every), set(every), kv_missing=set(every)))
    reprojections = {(op.group, op.chunk): op for op in plan.computes if op.kind == "reproject"}
    assert set(reprojections) == every
    visual = frozenset({0, 1})
    assert [needs_vision_out(reprojections[(0, c)], frozenset({0}), visual) for c in range(3)] == [True, True, False]
    # a later group re-projects from the stored hidden state, which holds the visual tokens already
    assert not any(needs_vision_out(reprojections[(g, c)], frozenset({0, 1}), visual) for g in (1, 2) for c in range(3))
    assert needs_vision_out(ComputeOp(1, 0, "block"), frozenset({0, 1}), visual)
    assert not needs_vision_out(ComputeOp(2, 0, "block"), frozenset({0, 1}), visual)
    plan.reads.insert(0, VISION_OUT)
    executor = PhaseExecutor(plan, None, None, visual_chunks=visual, num_chunks=3)
    deps = {key: executor.dependencies(op)[0] for key, op in reprojections.items()}
    assert VISION_OUT in deps[(0, 0)] and VISION_OUT in deps[(0, 1)]
    assert VISION_OUT not in deps[(0, 2)] and VISION_OUT not in deps[(1, 0)] and VISION_OUT not in deps[(2, 1)]


def _cut_then_resume(model_dirs, tmp_path, units: int):
    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    ckpt = tmp_path / f"cut-{units}"
    with pytest.raises(SimulatedCut):
        # the paper's cadence: the cut points below count on its records (decode every D = 2)
        engine(model, cadence="fixed", events=CutAfter(units).event).run(inputs, str(ckpt), MAX_NEW)
    return inputs, run_to_completion(model_dir, inputs, ckpt, cadence="fixed")


def test_restarts_read_what_their_phase_needs_first(model_dirs, tmp_path):
    ref = engine(load_model(model_dirs["qwen3-vl"], device="cpu")).run(
        inputs_for(load_model(model_dirs["qwen3-vl"], device="cpu")), str(tmp_path / "ref"), MAX_NEW
    )
    # vision: cut as block 3 of 4 ends, before its state is written: the state after block 2,
    # then the vision weights from block 2 on (blocks 0 and 1 are never read)
    _, vision = _cut_then_resume(model_dirs, tmp_path, 3)
    plan = vision.phase_plans["vision"]
    assert vision.resumed_from == {"phase": "vision", "position": 2}
    order = plan["order"]
    assert plan["resume_block"] == 2 and order[0] == "vision.state"
    blocks = [name for name in order if ".visual.blocks." in name]
    assert blocks[0].endswith(".blocks.2") and not any(name.endswith((".blocks.0", ".blocks.1")) for name in blocks)
    assert order.index(blocks[-1]) < next(i for i, name in enumerate(order) if ".language_model.layers." in name)
    # decode: cut after 3 decode steps (records every 2): layer-first reads, the first step behind them
    _, decode = _cut_then_resume(model_dirs, tmp_path, 4 + 8 + 3)
    assert decode.resumed_from["phase"] == "decode"
    assert decode.phase_plans["decode"]["planner"] == "layer-first" and decode.phase_plans["decode"]["groups"] == 2
    for result in (vision, decode):
        assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)
