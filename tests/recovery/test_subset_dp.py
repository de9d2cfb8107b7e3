"""The pruned subset DP (branch and bound, the payload's path) finds exactly what the full DP
finds: its two rules -- drop a set that cannot beat the best value known, finish a set after
which the compute unit never waits for a read -- never change the optimum. And the planner's
array shortcuts (fixed read orders as read ids, release times on grids) agree with the plans
and the simulator they stand for."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recovery_instances import problems, real_size

from flight.recovery.optimal import (
    _chunk_first_read_ids,
    _layer_first_read_ids,
    analyse,
    batch_tables,
    best_compute_order,
    partitions,
    plan_for_group_order,
    solve,
)
from flight.recovery.plan import PlanError, ReadOp, RecoveryProblem, chunk_first, layer_first
from flight.recovery.simulate import simulate
from flight.recovery.subset_dp import full_dp, pruned_dp

TOL = 1e-9


def check_pruned_against_full(problem, parts, bound_scale):
    s = analyse(problem)
    if not s.active:
        return
    tables = batch_tables(s, parts)
    n = len(tables.bundle_s)
    _, optimum = full_dp(n, tables.P, tables.h, tables.bundle_s)
    layer_first_value = simulate(layer_first(problem), problem).makespan
    for bound in (optimum * bound_scale, optimum, np.inf, layer_first_value):
        order, value = pruned_dp(n, tables.P, tables.h, tables.bundle_s, tables.first_release, bound)
        if optimum < bound * (1 - TOL):  # something beats the bound: the optimum, and an order reaching it
            assert value == pytest.approx(optimum, rel=TOL, abs=TOL)
            assert sorted(order) == list(range(n))
            groups = [s.active[i] for x in order for i in (parts[x] if parts else [x])]
            plan = plan_for_group_order(problem, groups, structure=s)
            expected = max(value, s.total_read_s)
            assert simulate(plan, problem).makespan == pytest.approx(expected, rel=TOL, abs=TOL)
        elif optimum > bound * (1 + TOL):  # nothing beats it: the plan in hand is optimal
            assert (order, value) == ([], np.inf)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(problems(max_groups=8, max_chunks=5), problems(max_groups=8, max_chunks=5, reprojections=True)),
    st.floats(0.9, 1.3),
)
def test_pruned_dp_finds_what_the_full_dp_finds(problem, bound_scale):
    check_pruned_against_full(problem, None, bound_scale)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_groups=8, max_chunks=4), st.integers(2, 4), st.floats(0.9, 1.3))
def test_pruned_dp_over_merged_parts(problem, limit, bound_scale):
    m = len(analyse(problem).active)
    if m < 3:
        return
    for parts in partitions(m, min(limit, m - 1)):
        check_pruned_against_full(problem, parts, bound_scale)


@pytest.mark.parametrize("seed, frontier", [(4, "random"), (7, "random"), (1, "random-stair")])
def test_36_layers_fast_path_matches_the_full_dp(seed, frontier):
    p = real_size(seed, frontier)
    fast, full = solve(p), solve(p, full=True)
    assert fast.exact and full.exact
    assert fast.makespan == pytest.approx(full.makespan, rel=TOL)
    assert simulate(fast.plan, p).makespan == pytest.approx(fast.makespan, rel=TOL)
    fast.plan.validate(p)


@settings(max_examples=150, deadline=None)
@given(st.one_of(problems(), problems(reprojections=True)))
def test_fixed_read_orders_as_ids_are_the_planners_orders(problem):
    s = analyse(problem)
    assert _layer_first_read_ids(s).tolist() == s.read_ids(layer_first(problem).reads).tolist()
    assert _chunk_first_read_ids(s).tolist() == s.read_ids(chunk_first(problem).reads).tolist()
    assert s.read_ops(s.read_ids(chunk_first(problem).reads)) == chunk_first(problem).reads


def test_an_input_never_read_is_a_plan_error():
    p = RecoveryProblem(2, 2, {(0, 0)}, {(0, 0)})
    reads = [op for op in layer_first(p).reads if op != ReadOp("weights", 1)]
    with pytest.raises(PlanError, match="weights of group 1"):
        best_compute_order(p, reads, analyse(p).costs)
    reads = [op for op in layer_first(p).reads if op != ReadOp("kv", 0, 0)]
    with pytest.raises(PlanError, match="kv g0 c0"):
        best_compute_order(p, reads, analyse(p).costs)


def test_the_planner_needs_no_compiler():
    """A payload plans at every boot after a power cut: planning must not compile (or load a
    compiler's cache: numba's cost 1.5-4 s per boot here, in a short window the whole window).
    With numba made unimportable, the planner still plans small staircases and a real-size case
    that runs the DP."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "from recovery_instances import real_size, staircase\n"
        "from flight.recovery.optimal import solve\n"
        "for progress in (0.25, 0.5, 0.75):\n"
        "    solve(staircase(6, 4, progress))\n"
        "print(solve(real_size(4)).chosen)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests" / "recovery")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "group order"
