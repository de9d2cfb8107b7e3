"""Random recovery problems for the planner tests: staircase frontiers (what an interrupted
prefill leaves), arbitrary done sets (records lost or quarantined), missing boundary hidden
states, blocks stored without KV (re-projected), and random non-negative costs."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from flight.recovery.plan import RecoveryProblem


@st.composite
def problems(draw, max_groups: int = 6, max_chunks: int = 4, with_costs: bool = True, reprojections: bool = False):
    groups = draw(st.integers(1, max_groups))
    chunks = draw(st.integers(1, max_chunks))
    cells = list(itertools.product(range(groups), range(chunks)))
    if draw(st.booleans()):  # staircase: chunks 0..f_g-1 done, f non-increasing in g
        steps = sorted(draw(st.lists(st.integers(0, chunks), min_size=groups, max_size=groups)), reverse=True)
        done = {(g, c) for g in range(groups) for c in range(steps[g])}
    else:
        done = set(draw(st.lists(st.sampled_from(cells), unique=True)))
    with_hidden = {b for b in sorted(done) if draw(st.integers(0, 9)) > 0}  # mostly stored
    if reprojections:  # HCache-style records: some layers' KV is rebuilt from hidden states
        kv_missing = {b for b in sorted(done) if draw(st.integers(0, 2)) == 0}
    else:
        kv_missing = {b for b in sorted(done) if draw(st.integers(0, 4)) == 0} if draw(st.booleans()) else set()
    costs = {}
    if with_costs:
        # Small integers (with zeros) make ties and degenerate cases common; floats the rest.
        value = st.one_of(st.integers(0, 3).map(float), st.floats(0.0, 3.0, allow_nan=False))
        grid = lambda: [[draw(value) for _ in range(chunks)] for _ in range(groups)]  # noqa: E731
        costs = {
            "weights": [draw(value) for _ in range(groups)],
            "kv": grid(),
            "hidden": grid(),
            "compute": grid(),
            "reproject": grid(),
        }
    return RecoveryProblem(
        groups, chunks, done, with_hidden, need_last_hidden=draw(st.booleans()), kv_missing=kv_missing, costs=costs
    )


def staircase(num_groups: int, num_chunks: int, progress: float) -> RecoveryProblem:
    """The frontier an uninterrupted (chunk-first) prefill leaves after `progress` of its blocks."""
    n = int(round(progress * num_groups * num_chunks))
    done = {(i % num_groups, i // num_groups) for i in range(n)}
    return RecoveryProblem(num_groups, num_chunks, done, set(done))


def real_size(seed: int, frontier: str = "random", progress: float = 0.5) -> RecoveryProblem:
    """Qwen3-VL-8B with G = 2 (18 groups) on a 32K-token prompt (32 chunks), target costs, as in
    the planner bench (bench/recovery_planner.py): `random` loses records anywhere (and 10 % of
    the hidden states of those kept); `random-stair` leaves each group a prefix, shorter upward."""
    import random

    from flight.recovery.cost import MODELS, CostModel, even_chunks, even_groups

    groups, chunks = 18, 32
    costs = CostModel.for_target(MODELS["qwen3-vl-8b"]).problem_costs(
        even_groups(36, groups), even_chunks(chunks * 1024, 1024)
    )
    rng = random.Random(seed)
    if frontier == "random":
        done = {(g, c) for g in range(groups) for c in range(chunks) if rng.random() < progress}
        with_hidden = {b for b in sorted(done) if rng.random() < 0.9}
    else:
        steps = sorted((rng.randint(0, chunks) for _ in range(groups)), reverse=True)
        done = {(g, c) for g in range(groups) for c in range(steps[g])}
        with_hidden = set(done)
    return RecoveryProblem(groups, chunks, done, with_hidden, costs=costs)
