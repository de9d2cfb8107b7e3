"""The optimal planner: exact over group orders (brute force), never worse than the fixed orders,
never below the lower bound, always a plan the executor can run."""

import itertools
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recovery_instances import problems, staircase

from flight.recovery.cost import BlockCosts
from flight.recovery.optimal import (
    analyse,
    best_compute_order,
    lower_bound,
    optimal,
    partitions,
    plan_for_group_order,
    solve,
)
from flight.recovery.plan import PLANNERS, ComputeOp, PlanError, RecoveryPlan, RecoveryProblem, make_plan
from flight.recovery.simulate import simulate

TOL = 1e-9


def brute_force_group_orders(problem):
    s = analyse(problem)
    return min(
        simulate(plan_for_group_order(problem, list(order), structure=s), problem).makespan
        for order in itertools.permutations(s.active)
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(), problems(reprojections=True)))
def test_dp_equals_brute_force_over_group_orders(problem):
    sol = solve(problem, full=True)
    sol.plan.validate(problem)
    assert sol.exact
    assert sol.group_order_makespan == pytest.approx(brute_force_group_orders(problem), rel=TOL, abs=TOL)
    assert simulate(sol.plan, problem).makespan == pytest.approx(sol.makespan, rel=TOL, abs=TOL)
    # the DP's own plan scores what the DP says
    dp_plan = plan_for_group_order(problem, sol.group_order)
    assert simulate(dp_plan, problem).makespan == pytest.approx(sol.group_order_makespan, rel=TOL, abs=TOL)
    # the fast paths (early exit at the bound, pruned DP) find a plan exactly as good
    fast = solve(problem)
    fast.plan.validate(problem)
    assert fast.makespan == pytest.approx(sol.makespan, rel=TOL, abs=TOL)
    assert simulate(fast.plan, problem).makespan == pytest.approx(fast.makespan, rel=TOL, abs=TOL)


@settings(max_examples=200, deadline=None)
@given(problems(max_groups=7, max_chunks=5))
def test_never_worse_than_fixed_orders_never_below_the_bound(problem):
    plan = make_plan("optimal", problem)  # validates
    value = simulate(plan, problem).makespan
    for fixed in ("chunk-first", "layer-first"):
        assert value <= simulate(make_plan(fixed, problem), problem).makespan + TOL
    assert value >= lower_bound(problem) - TOL


@settings(max_examples=200, deadline=None)
@given(problems(with_costs=False))
def test_plans_without_costs_use_the_reference_payload(problem):
    plan = optimal(problem)
    plan.validate(problem)
    assert BlockCosts.for_problem(problem).source.startswith("reference:")
    assert simulate(plan, problem).makespan <= simulate(make_plan("layer-first", problem), problem).makespan + TOL


def topological_orders(kind):
    """All job orders the executor accepts (dependencies before dependents)."""

    def deps(g, c):
        out = {(g - 1, c)} if kind.get((g - 1, c)) == "block" else set()
        if kind[(g, c)] == "block":
            out |= {(g, cc) for cc in range(c) if (g, cc) in kind}
        return out

    jobs = sorted(kind)
    for perm in itertools.permutations(jobs):
        seen = set()
        if all(deps(*b) <= seen and not seen.add(b) for b in perm):
            yield [ComputeOp(g, c, kind[(g, c)]) for g, c in perm]


@settings(max_examples=80, deadline=None)
@given(problems(max_groups=3, max_chunks=3), st.randoms(use_true_random=False))
def test_release_order_is_the_best_compute_order_for_any_reads(problem, rnd):
    s = analyse(problem)
    if not s.kind or len(s.kind) > 6:
        return
    reads = [op for g in s.active for op in s.bundles[g]] + s.trailing
    rnd.shuffle(reads)  # any read order, not only bundles
    try:
        ours = simulate(RecoveryPlan("x", reads, best_compute_order(problem, reads, s.costs, s.kind)), problem).makespan
    except PlanError:
        pytest.fail("a complete read list must admit the release order")
    best = min(simulate(RecoveryPlan("x", reads, order), problem).makespan for order in topological_orders(s.kind))
    assert ours == pytest.approx(best, rel=TOL, abs=TOL)


@settings(max_examples=60, deadline=None)
@given(problems(max_groups=4, max_chunks=3), st.randoms(use_true_random=False))
def test_bundle_order_and_trailing_reads_are_dominant(problem, rnd):
    """Inside the group-order family, shuffling a bundle after its weights, or pulling reads that
    nothing waits for forward, never beats the DP (without re-projections, which need only part
    of their group's bundle, the need order is provably dominant)."""
    if problem.kv_missing:
        return
    s = analyse(problem)
    sol = solve(problem, full=True)
    order = list(sol.group_order)
    for _ in range(5):
        reads = []
        for g in order:
            rest = s.bundles[g][1:]
            rnd.shuffle(rest)
            reads += [s.bundles[g][0]] + rest
        for op in s.trailing:
            reads.insert(rnd.randint(0, len(reads)), op)
        value = simulate(
            RecoveryPlan("x", reads, best_compute_order(problem, reads, s.costs, s.kind)), problem
        ).makespan
        assert sol.group_order_makespan <= value + TOL


@settings(max_examples=40, deadline=None)
@given(problems(max_groups=3, max_chunks=3))
def test_lower_bound_holds_for_every_read_order(problem):
    s = analyse(problem)
    gating = [op for g in s.active for op in s.bundles[g]]
    if len(gating) > 6:
        return
    bound = lower_bound(problem)
    for perm in itertools.permutations(gating):
        reads = list(perm) + s.trailing
        value = simulate(
            RecoveryPlan("x", reads, best_compute_order(problem, reads, s.costs, s.kind)), problem
        ).makespan
        assert value >= bound - TOL


def test_worked_example_chooses_the_order_that_hides_reads():
    # Group 0 needs a long KV read before its block; group 1's block can start right after its
    # weights and hidden input. Reading group 1 first hides group 0's KV behind that compute.
    p = RecoveryProblem(
        2,
        2,
        {(0, 0), (1, 0)},
        {(0, 0), (1, 0)},
        costs={
            "weights": [1.0, 1.0],
            "kv": [[6.0, 0.0], [0.5, 0.0]],
            "hidden": [[1.0, 1.0], [1.0, 1.0]],
            "compute": [[1.0, 1.0], [1.0, 6.0]],
        },
    )
    # jobs (0,1) needs W0 + KV00 (7); (1,1) needs W1 + KV10 + (0,1) computed
    sol = solve(p)
    assert sol.group_order == [0, 1]  # (1,1) depends on (0,1): group 0's bundle must come first anyway
    p.done = {(0, 0), (1, 0), (0, 1)}
    p.with_hidden = set(p.done)
    # now (1,1) reads hidden g0 c1 and group 1 goes first: W1, KV10, H01 (2.5), compute 6 hides W0+KV00
    sol = solve(p)
    assert sol.group_order == [1]
    s = simulate(sol.plan, p)
    assert s.makespan == pytest.approx(max(s.read_end, 2.5 + 6.0))


def test_36_layers_in_groups_of_two_plan_exactly():
    for progress in (0.25, 0.5, 0.75):
        p = staircase(18, 16, progress)
        t0 = time.perf_counter()
        sol = solve(p)
        elapsed = time.perf_counter() - t0
        sol.plan.validate(p)
        assert sol.exact and len(analyse(p).active) == 18
        assert simulate(sol.plan, p).makespan == pytest.approx(sol.makespan, rel=TOL)
        assert sol.lower_bound <= sol.makespan + TOL
        print(f"18 groups x 16 chunks at {progress:.0%}: {elapsed * 1e3:.0f} ms")


def test_many_groups_plan_over_merged_runs():
    p = staircase(36, 6, 0.5)  # G = 1 on a 36-layer model: 2^36 sets is out of reach
    sol = solve(p, full=True)
    sol.plan.validate(p)
    assert not sol.exact
    fast = solve(p)  # a staircase: layer-first meets the bound, provably optimal, no DP run
    assert fast.chosen == "layer-first (meets the bound)" and fast.makespan == pytest.approx(fast.lower_bound)
    assert sol.makespan <= simulate(make_plan("chunk-first", p), p).makespan + TOL
    assert all(len(parts) <= 20 and sorted(sum(parts, [])) == list(range(36)) for parts in partitions(36, 20))
    assert partitions(5, 20) == [[[0], [1], [2], [3], [4]]]


def test_random_larger_instances_validate_and_beat_the_fixed_orders():
    rng = random.Random(3)
    for _ in range(20):
        ng, nc = rng.randint(6, 12), rng.randint(2, 8)
        done = {(g, c) for g in range(ng) for c in range(nc) if rng.random() < 0.6}
        p = RecoveryProblem(
            ng,
            nc,
            done,
            {b for b in done if rng.random() < 0.9},
            costs={
                "weights": [rng.uniform(0.5, 2) for _ in range(ng)],
                "kv": rng.uniform(0.1, 1),
                "hidden": 0.1,
                "compute": [[rng.uniform(0.5, 1.5) * (1 + 0.2 * c) for c in range(nc)] for _ in range(ng)],
            },
        )
        plan = make_plan("optimal", p)
        value = simulate(plan, p).makespan
        assert value <= min(simulate(make_plan(n, p), p).makespan for n in ("chunk-first", "layer-first")) + TOL


def test_registered_as_optimal():
    assert PLANNERS["optimal"] is optimal


def test_nothing_to_compute_reads_everything():
    p = RecoveryProblem(2, 2, {(g, c) for g in range(2) for c in range(2)}, {(1, 1)})
    plan = optimal(p)
    plan.validate(p)
    assert plan.computes == [] and len(plan.reads) == 2 + 4 + 1


def test_reprojection_is_released_by_its_own_input_alone():
    # Block (1,1) is stored without KV (re-projected from hidden g0 c1); block (1,0) must be
    # computed after (0,0). Reading group 1 first lets the long re-projection hide W0's read:
    #   W1 [0,1] H01 [1,2] W0 [2,7] | reproject (1,1) [2,8] (0,0) [8,9] (1,0) [9,10] | KV01, H11 [7,7.2]
    # whereas group 0 first gives W0 [0,5] W1 [5,6] H01 [6,7] -> reproject [7,13].
    p = RecoveryProblem(
        2,
        2,
        {(0, 1), (1, 1)},
        {(0, 1), (1, 1)},
        kv_missing={(1, 1)},
        costs={
            "weights": [5.0, 1.0],
            "kv": 0.1,
            "hidden": [[1.0, 1.0], [1.0, 0.1]],
            "compute": 1.0,
            "reproject": [[1.0, 1.0], [1.0, 6.0]],
        },
    )
    sol = solve(p)
    assert sol.group_order == [1, 0]
    assert sol.group_order_makespan == pytest.approx(10.0) and sol.makespan == pytest.approx(10.0)
    assert simulate(plan_for_group_order(p, [0, 1]), p).makespan == pytest.approx(13.0)


def test_a_tie_with_layer_first_runs_layer_first_itself():
    """Where no order beats layer-first under the model, optimal returns layer-first's own plan
    (the same digest), and where one does, a different plan that is strictly faster."""
    from flight.recovery.plan import layer_first

    tie = staircase(6, 8, 0.5)  # a chunk-first staircase: layer-first already reaches the bound
    sol = solve(tie)
    plain = layer_first(tie)
    assert sol.chosen == "layer-first (tie)"
    assert sol.plan.order_digest() == plain.order_digest() and sol.plan.planner == "optimal"
    better = RecoveryProblem(
        2,
        2,
        {(0, 0), (1, 0), (0, 1)},
        {(0, 0), (1, 0), (0, 1)},
        costs={
            "weights": [1.0, 1.0],
            "kv": [[6.0, 0.0], [0.5, 0.0]],
            "hidden": [[1.0, 1.0], [1.0, 1.0]],
            "compute": [[1.0, 1.0], [1.0, 6.0]],
        },
    )
    sol = solve(better)
    assert sol.chosen != "layer-first (tie)"
    assert sol.makespan < simulate(layer_first(better), better).makespan - TOL
