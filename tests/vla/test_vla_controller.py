"""The traffic controller knows co-location, and every plan it emits holds when replayed.

Simulation is deterministic for given seeds and the ILP gets time to prove its optimum, so these
checks are exact, not statistical: they replay each checked plan with seeds the controller never
saw and require every model to meet 98 %.
"""

from itertools import pairwise

import pytest

from common.vla import sim
from common.vla.controller import ControllerSettings, TrafficController, read_plan, write_plan
from common.vla.management import Placement, gpu_load
from common.vla.profiles import load_profile

# One worker measures the limits once for the whole module (make test runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("vla-controller")

SMOL = ["smolvla", "smolvla-ft1", "smolvla-ft2", "smolvla-ft3"]
PI0 = ["pi0", "pi0-ft1", "pi0-ft2", "pi0-ft3"]
SETTINGS = ControllerSettings(epochs=12, check_draws=3, duration_s=6.0, max_models_per_gpu=3, time_limit_s=60)
MAX_BATCH = {**{m: 4 for m in SMOL}, **{m: 2 for m in PI0}}


@pytest.fixture(scope="module")
def profile():
    return load_profile("rtx-pro-6000x4")


@pytest.fixture(scope="module")
def controller(profile):
    return TrafficController.calibrate(profile, SMOL + PI0, MAX_BATCH, SETTINGS)


def test_colocation_limits_fall_with_models_per_gpu(controller):
    smol, pi0 = controller.limits["smolvla"], controller.limits["pi0"]
    assert controller.limits["smolvla-ft2"] == smol  # variants share their architecture's table
    assert all(a >= b for a, b in pairwise(smol)) and all(a >= b for a, b in pairwise(pi0))
    # Four SmolVLA variants are far from four times a quarter of one model's robots (paper's load
    # model): the per-GPU limit with two variants is well under the single-model one.
    assert smol[1] < 0.75 * smol[0]


def _replay(profile, robots, plan, seed):
    workload = sim.Workload(robots, epochs=6, duration_s=6.0, seed=seed)
    return sim.simulate(sim.robion(max_batch=MAX_BATCH), workload, profile, assignment=plan.counts)


CASES = [  # (name, placement, robots, does a plan within the limits exist)
    ("4 SmolVLA variants x 8 on 2 GPUs", Placement.colocate(SMOL, 2), {m: 8 for m in SMOL}, True),
    ("pi0 (8, 8, 8, 24) on 4 GPUs", Placement.colocate(PI0, 4), dict(zip(PI0, (8, 8, 8, 24), strict=True)), False),
    ("8 models x 3, groups", Placement.parse("pi0*:0,1;smolvla*:2,3", PI0 + SMOL, 4), {m: 3 for m in PI0 + SMOL}, True),
    ("8 models x 3, mix", Placement.colocate(PI0 + SMOL, 4), {m: 3 for m in PI0 + SMOL}, True),
]


@pytest.mark.parametrize("name,placement,robots,fits", CASES, ids=[c[0] for c in CASES])
def test_every_emitted_plan_meets_the_slo_for_every_model_in_replays(
    profile, controller, name, placement, robots, fits
):
    plan = controller.plan(placement, robots)
    assert plan.feasible == fits
    if not plan.feasible:  # flagged, never emitted as within limits
        assert plan.note
        return
    assert all(c.worst >= SETTINGS.plan_target for c in plan.checks)
    for seed in (0, 1):  # seeds the controller's checks never used
        r = _replay(profile, robots, plan, seed)
        assert r.worst_attainment >= 0.98, (name, seed, r.per_model_text(), plan.counts)


def test_four_variants_spread_two_and_two(controller):
    plan = controller.plan(Placement.colocate(SMOL, 2), {m: 8 for m in SMOL})
    assert plan.feasible
    assert sorted(len(plan.assignment.robots_on(g)) for g in range(2)) == [2, 2]
    assert all(gpu_load(plan.assignment.robots_on(g), plan.learned) <= 1.0 for g in range(2))


def test_plan_file_round_trip(tmp_path, controller):
    placement, robots = Placement.colocate(SMOL, 2), {m: 8 for m in SMOL}
    plan = controller.plan(placement, robots)
    write_plan(tmp_path / "plan.json", plan, placement, robots, "rtx-pro-6000x4")
    gpus = read_plan(tmp_path / "plan.json")
    assert {g: on for g, on in gpus.items()} == {g: plan.assignment.robots_on(g) for g in range(2)}
    (tmp_path / "bad.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError):
        read_plan(tmp_path / "bad.json")


def test_identical_failing_gpus_derate_once_and_plans_do_not_inherit(profile):
    """Four pi0 variants, one per GPU, each given far more robots than a GPU serves: all four GPUs
    fail the check with the same composition. The limit drops once by that GPU's factor (it
    dropped by the factor to the fourth power when every failing GPU derated it), and the next
    plan starts again from the measured limit instead of the lowered one."""
    settings = ControllerSettings(epochs=6, check_draws=2, duration_s=4.0, max_models_per_gpu=1, max_rounds=1)
    measured = 40.0
    controller = TrafficController(profile, {m: measured for m in PI0}, MAX_BATCH, settings)
    placement = Placement.parse("pi0:0;pi0-ft1:1;pi0-ft2:2;pi0-ft3:3", PI0, 4)
    robots = {m: 36 for m in PI0}
    plan = controller.plan(placement, robots)
    assert not plan.verified and len(plan.checks) == 4
    assert all(c.worst < settings.plan_target for c in plan.checks)  # all four fail alike
    factor = min(c.load for c in plan.checks) * 0.98
    assert plan.learned["pi0"][0] == pytest.approx(measured * factor)
    assert len(plan.derated) == 1 and "worst of 4 failing GPUs" in plan.derated[0]
    assert controller.limits["pi0"] == (measured,)  # the measured limits are untouched
    again = controller.plan(placement, robots)
    assert again.learned == plan.learned  # no carry-over: the same plan from the same start


def test_the_acceptance_is_a_prediction_bound_over_epochs():
    from common.vla.controller import prediction_bound

    # no spread: the bound is the mean; a spread lowers it by t * sd * sqrt(1/n + 1/replay)
    assert prediction_bound([1.0] * 10, 20, 0.95) == 1.0
    draws = [1.0, 0.98, 0.99, 1.0, 0.97, 1.0, 0.99, 1.0, 1.0, 0.99]
    mean, sd = 0.992, 0.010328
    expected = mean - 1.833113 * sd * (1 / 10 + 1 / 20) ** 0.5  # t(0.95, 9) = 1.833
    assert prediction_bound(draws, 20, 0.95) == pytest.approx(expected, abs=1e-5)
    assert prediction_bound(draws, 20, 0.99) < prediction_bound(draws, 20, 0.95)  # more confidence, lower
    assert prediction_bound(draws, 5, 0.95) < prediction_bound(draws, 50, 0.95)  # a short replay swings more
    with pytest.raises(ValueError):
        ControllerSettings(acceptance="average")
