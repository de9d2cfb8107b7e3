"""Recovery plans: every planner yields a valid, dependency-respecting plan for any frontier,
and the validator catches plans that are not."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flight.recovery.plan import PLANNERS, PlanError, ReadOp, RecoveryPlan, RecoveryProblem, make_plan


@st.composite
def problems(draw):
    groups = draw(st.integers(1, 5))
    chunks = draw(st.integers(1, 5))
    cells = list(itertools.product(range(groups), range(chunks)))
    done = set(draw(st.lists(st.sampled_from(cells), unique=True))) if cells else set()
    with_hidden = {b for b in done if draw(st.booleans())}
    kv_missing = {b for b in done if draw(st.booleans())} if draw(st.booleans()) else set()
    return RecoveryProblem(
        groups, chunks, done, with_hidden, need_last_hidden=draw(st.booleans()), kv_missing=kv_missing
    )


@settings(max_examples=200, deadline=None)
@given(problems(), st.sampled_from(sorted(PLANNERS)))
def test_planners_produce_valid_plans(problem, planner):
    plan = make_plan(planner, problem)  # validates
    computed = {(op.group, op.chunk) for op in plan.computes if op.kind == "block"}
    assert computed.isdisjoint(problem.done - problem.must_compute())
    rebuilt = {(op.group, op.chunk) for op in plan.computes if op.kind == "reproject"}
    assert rebuilt <= problem.kv_missing


def test_staircase_frontier_reads_and_computes():
    # 3 groups x 4 chunks; chunks 0-1 fully done, chunk 2 done for group 0 only (a cut inside chunk 2)
    done = {(g, c) for g in range(3) for c in range(2)} | {(0, 2)}
    p = RecoveryProblem(3, 4, done, set(done))
    plan = make_plan("chunk-first", p)
    assert [(op.group, op.chunk) for op in plan.computes] == [(1, 2), (2, 2), (0, 3), (1, 3), (2, 3)]
    assert ReadOp("hidden", 0, 2) in plan.reads
    assert sum(r.what == "kv" for r in plan.reads) == len(done)


def test_validator_rejects_bad_orders():
    p = RecoveryProblem(2, 2, set(), set())
    good = make_plan("chunk-first", p)
    bad = RecoveryPlan("bad", good.reads, list(reversed(good.computes)))
    with pytest.raises(PlanError):
        bad.validate(p)
    missing_weights = RecoveryPlan("bad", [r for r in good.reads if r != ReadOp("weights", 1)], good.computes)
    with pytest.raises(PlanError):
        missing_weights.validate(p)


def test_done_block_without_hidden_is_recomputed_when_its_successor_needs_it():
    done = {(0, 0)}
    p = RecoveryProblem(2, 1, done, with_hidden=set())
    assert p.must_compute() == {(0, 0), (1, 0)}


def test_hcache_style_frontier_reprojects_from_stored_inputs():
    # 4 single-layer groups, 2 chunks, all done; odd layers stored without KV, their inputs stored
    done = {(g, c) for g in range(4) for c in range(2)}
    with_hidden = {(g, c) for g in (0, 2) for c in range(2)} | {(3, 1)}
    p = RecoveryProblem(4, 2, done, with_hidden, kv_missing={(g, c) for g in (1, 3) for c in range(2)})
    plan = make_plan("layer-first", p)
    assert [(op.group, op.chunk, op.kind) for op in plan.computes] == [
        (1, 0, "reproject"),
        (1, 1, "reproject"),
        (3, 0, "reproject"),
        (3, 1, "reproject"),
    ]
    assert {r for r in plan.reads if r.what == "hidden"} == {
        ReadOp("hidden", 0, 0),
        ReadOp("hidden", 0, 1),
        ReadOp("hidden", 2, 0),
        ReadOp("hidden", 2, 1),
        ReadOp("hidden", 3, 1),
    }
