"""simulate(): the executor's semantics in modelled time — checked by hand on small plans and
against the real PlanExecutor running timed operations."""

import threading
import time

import pytest
from testkit import HANG_S

from flight.recovery.executor import PlanExecutor
from flight.recovery.optimal import solve
from flight.recovery.plan import ComputeOp, PlanError, ReadOp, RecoveryPlan, RecoveryProblem
from flight.recovery.simulate import simulate

# 2 groups x 2 chunks; block (0, 0) is durable with its hidden state. To compute: (0, 1) (reads
# KV g0 c0), (1, 0) (reads hidden g0 c0), (1, 1) (after both).
HAND = RecoveryProblem(
    2,
    2,
    {(0, 0)},
    {(0, 0)},
    costs={"weights": [2.0, 3.0], "kv": 1.0, "hidden": 1.0, "compute": [[9.0, 2.0], [1.0, 3.0]]},
)


def test_hand_computed_schedule():
    reads = [ReadOp("weights", 0), ReadOp("kv", 0, 0), ReadOp("hidden", 0, 0), ReadOp("weights", 1)]
    plan = RecoveryPlan("hand", reads, [ComputeOp(0, 1), ComputeOp(1, 0), ComputeOp(1, 1)])
    plan.validate(HAND)
    s = simulate(plan, HAND)
    # reads: W0 [0,2]  KV00 [2,3]  H00 [3,4]  W1 [4,7]
    assert [(str(op), a, b) for op, a, b in s.reads] == [
        ("read weights g0", 0, 2),
        ("read kv g0 c0", 2, 3),
        ("read hidden g0 c0", 3, 4),
        ("read weights g1", 4, 7),
    ]
    # (0,1) waits for KV00 -> [3,5]; (1,0) waits for W1 -> [7,8]; (1,1) waits for (1,0) -> [8,11]
    assert [(str(op), a, b) for op, a, b in s.computes] == [
        ("compute g0 c1", 3, 5),
        ("compute g1 c0", 7, 8),
        ("compute g1 c1", 8, 11),
    ]
    assert (s.makespan, s.read_end, s.compute_end, s.compute_busy, s.stall) == (11, 7, 11, 6, 5)
    assert s.exposed_io == 5 and s.tail == 0


def test_reads_after_the_last_compute_set_the_makespan():
    reads = [ReadOp("weights", 0), ReadOp("kv", 0, 0), ReadOp("weights", 1), ReadOp("hidden", 0, 0)]
    plan = RecoveryPlan("hand", reads, [ComputeOp(0, 1), ComputeOp(1, 0), ComputeOp(1, 1)])
    s = simulate(plan, HAND)
    assert [(a, b) for _, a, b in s.computes] == [(3, 5), (7, 8), (8, 11)]
    plan.reads.append(ReadOp("kv", 1, 1))  # a read nothing waits for, still part of the makespan
    s = simulate(plan, HAND)
    assert (s.compute_end, s.read_end, s.makespan, s.tail) == (11, 8, 11, 0)
    plan.reads.extend([ReadOp("kv", 1, 1)] * 4)
    s = simulate(plan, HAND)
    assert (s.compute_end, s.read_end, s.makespan, s.tail) == (11, 12, 12, 1)


def test_reprojection_waits_for_weights_and_input_only():
    # (1, 0) is stored without KV: re-projected from hidden g0 c0; (1, 1) needs that KV.
    p = RecoveryProblem(
        2,
        2,
        {(0, 0), (1, 0)},
        {(0, 0), (1, 0)},
        kv_missing={(1, 0)},
        need_last_hidden=False,
        costs={"weights": [2.0, 3.0], "kv": 1.0, "hidden": 1.0, "compute": [[9.0, 2.0], [9.0, 3.0]], "reproject": 0.5},
    )
    reads = [ReadOp("weights", 0), ReadOp("kv", 0, 0), ReadOp("weights", 1), ReadOp("hidden", 0, 0)]
    plan = RecoveryPlan("hand", reads, [ComputeOp(0, 1), ComputeOp(1, 0, "reproject"), ComputeOp(1, 1)])
    plan.validate(p)
    s = simulate(plan, p)
    assert [(str(op), a, b) for op, a, b in s.computes] == [
        ("compute g0 c1", 3, 5),
        ("reproject g1 c0", 7, 7.5),
        ("compute g1 c1", 7.5, 10.5),
    ]


def test_plans_the_executor_cannot_finish_are_rejected():
    reads = [ReadOp("weights", 0), ReadOp("kv", 0, 0), ReadOp("hidden", 0, 0), ReadOp("weights", 1)]
    with pytest.raises(PlanError, match="computed later or never"):
        simulate(RecoveryPlan("bad", reads, [ComputeOp(1, 1), ComputeOp(0, 1), ComputeOp(1, 0)]), HAND)
    with pytest.raises(PlanError, match="never reads"):
        simulate(RecoveryPlan("bad", reads[:3], [ComputeOp(0, 1), ComputeOp(1, 0), ComputeOp(1, 1)]), HAND)
    with pytest.raises(PlanError, match="kv g0 c0"):
        simulate(RecoveryPlan("bad", [reads[0], reads[3], reads[2]], [ComputeOp(0, 1)]), HAND)


@pytest.mark.parametrize(
    "problem",
    [
        RecoveryProblem(
            3,
            3,
            {(0, 0), (1, 0), (2, 0), (0, 1)},
            {(0, 0), (1, 0), (2, 0), (0, 1)},
            costs={"weights": [2.0, 1.0, 2.0], "kv": 1.0, "hidden": 0.5, "compute": [[1, 2, 2], [1, 1, 2], [1, 2, 3]]},
        ),
        RecoveryProblem(
            3,
            3,
            {(0, 1), (1, 1), (2, 0), (2, 2)},
            {(0, 1), (2, 0)},
            kv_missing={(1, 1), (2, 2)},
            costs={"weights": [1.0, 3.0, 1.0], "kv": 2.0, "hidden": 0.5, "compute": 1.0, "reproject": 2.0},
        ),
    ],
    ids=["staircase", "holes-and-reprojections"],
)
def test_simulation_follows_the_real_executor(problem):
    """Drive the real PlanExecutor one read at a time (each read completes only when the test
    releases it; computes take no time; a compute also waits for its group's weights, as
    WeightStore.ensure does while the reader loads them). After the k-th read, exactly the
    computes that simulate() starts by time k (reads of one unit, computes of none) have run."""
    plan = solve(problem).plan
    unit = RecoveryProblem(
        problem.num_groups,
        problem.num_chunks,
        problem.done,
        problem.with_hidden,
        problem.need_last_hidden,
        problem.kv_missing,
        costs={"weights": 1.0, "kv": 1.0, "hidden": 1.0, "compute": 0.0, "reproject": 0.0},
    )
    expected = simulate(plan, unit)
    gates = {op: threading.Event() for op in plan.reads}
    weights = {g: gates[ReadOp("weights", g)] for g in range(problem.num_groups)}
    ran, ran_lock = [], threading.Lock()

    def do_read(op):
        assert gates[op].wait(HANG_S)
        return 0

    def do_compute(op):
        assert weights[op.group].wait(HANG_S)
        with ran_lock:
            ran.append(op)

    executor = PlanExecutor(plan, do_read, do_compute)
    runner = threading.Thread(target=executor.run, daemon=True)
    runner.start()
    for k, op in enumerate(plan.reads, start=1):
        due = [c for c, start, _ in expected.computes if start <= k]
        gates[op].set()
        deadline = time.monotonic() + HANG_S
        while len(ran) < len(due) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.01)  # room for a compute that would (wrongly) run early to show up
        with ran_lock:
            assert ran == due, f"after '{op}'"
    runner.join(HANG_S)
    assert not runner.is_alive() and ran == plan.computes
