"""The traffic controller knows co-location, and every plan it emits holds when replayed.

Simulation is deterministic for given seeds and the ILP gets time to prove its optimum, so these
checks are exact, not statistical: they replay each checked plan with seeds the controller never
saw and require every model to meet 98 %.
"""

import dataclasses

import pytest

from common.vla import sim
from common.vla.controller import ControllerSettings, TrafficController, read_plan, write_plan
from common.vla.management import Placement, gpu_load
from common.vla.profiles import load_profile

# One worker measures the limits once for the whole module (make test runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("vla-controller")

SMOL = ["smolvla", "smolvla-ft1", "smolvla-ft2", "smolvla-ft3"]
PI0 = ["pi0", "pi0-ft1", "pi0-ft2", "pi0-ft3"]
# the two-stage rule's confirmation at four times the screen (the default's 1,000 would cost minutes)
SETTINGS = ControllerSettings(
    epochs=12, check_draws=3, duration_s=6.0, max_models_per_gpu=3, time_limit_s=60, confirm_epochs=48
)
MAX_BATCH = {**{m: 4 for m in SMOL}, **{m: 2 for m in PI0}}


@pytest.fixture(scope="module")
def profile():
    return load_profile("rtx-pro-6000x4")


@pytest.fixture(scope="module")
def controller(profile):
    return TrafficController.calibrate(profile, SMOL + PI0, MAX_BATCH, SETTINGS)


PAIR = (("pi0", 1), ("smolvla", 1))


def test_colocation_limits_are_keyed_by_which_architectures_share_a_gpu(controller):
    """A GPU's limit depends on which models share it, not only how many: pi0 + SmolVLA is another
    composition than two pi0 variants or two SmolVLA variants, each measured on its own."""
    smol, pi0 = controller.limits["smolvla"], controller.limits["pi0"]
    assert controller.limits["smolvla-ft2"] == smol  # variants share their architecture's table
    assert {(("pi0", 2),), (("smolvla", 2),), PAIR, (("pi0", 2), ("smolvla", 1))} <= set(pi0) | set(smol)
    assert PAIR in pi0 and PAIR in smol  # the pair limits both architectures
    # In a pair a SmolVLA robot costs less than a pi0 robot (it costs less alone)
    assert smol[PAIR] > pi0[PAIR]
    # a limit never rises when a model joins
    for table, arch in ((smol, "smolvla"), (pi0, "pi0")):
        assert table[((arch, 2),)] <= table[((arch, 1),)] and table[PAIR] <= table[((arch, 1),)]
    # Four SmolVLA variants are far from four times a quarter of one model's robots (paper's load
    # model): the per-GPU limit with two variants is well under the single-model one.
    assert smol[(("smolvla", 2),)] < 0.75 * smol[(("smolvla", 1),)]
    # the measured equal split of the pair is a load of 1 (within the limits' rounding)
    half = (1 / pi0[PAIR] + 1 / smol[PAIR]) ** -1
    assert gpu_load({"pi0": half, "smolvla": half}, controller.limits) == pytest.approx(1.0)


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


def test_a_failing_pair_derates_the_pair_and_not_two_variants_of_one_architecture(profile):
    """Limits keyed by composition learn per composition: a pi0 + SmolVLA GPU that fails its check
    lowers the pair's limits only; two pi0 variants on another GPU keep theirs (keyed by the
    number of models, both were 'two models' and both dropped)."""
    settings = ControllerSettings(epochs=6, duration_s=4.0, max_models_per_gpu=2, max_rounds=1)
    two_pi0, alone = (("pi0", 2),), (("pi0", 1),)
    limits = {
        "pi0": {alone: 40.0, two_pi0: 40.0, PAIR: 40.0},
        "pi0-ft1": {alone: 40.0, two_pi0: 40.0, PAIR: 40.0},
        "smolvla": {(("smolvla", 1),): 160.0, PAIR: 160.0},
    }
    controller = TrafficController(profile, limits, MAX_BATCH, settings)
    placement = Placement.parse("pi0,smolvla:0;pi0-ft1:1", ["pi0", "smolvla", "pi0-ft1"], 2)
    plan = controller.plan(placement, {"pi0": 30, "smolvla": 30, "pi0-ft1": 4})
    failing = [c for c in plan.checks if c.worst < settings.plan_target]
    assert [c.gpu for c in failing] == [0]  # the overloaded pair fails, pi0-ft1 alone holds
    factor = failing[0].load * 0.98
    assert plan.learned["pi0"][PAIR] == pytest.approx(40.0 * factor)
    assert plan.learned["smolvla"][PAIR] == pytest.approx(160.0 * factor)
    assert plan.learned["pi0"][two_pi0] == 40.0 and plan.learned["pi0-ft1"][two_pi0] == 40.0
    assert plan.learned["pi0"][alone] == 40.0
    assert len(plan.derated) == 1 and "1 pi0 + 1 smolvla" in plan.derated[0]


def test_the_t_rule_is_a_prediction_bound_over_epochs():
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


def test_the_bootstrap_sees_a_heavy_tail_the_t_bound_averages_away():
    """98 epochs at 100 % and 2 at 75 % (40 requests each): a 20-epoch replay with two bad epochs
    reaches 97.5 %, which happens in about 6 % of replays (binomial: 1 - 0.98^20 - 20 * 0.02 *
    0.98^19 = 0.060). The t bound (mean 99.5 %, sd 3.5 %) accepts at 98.07 %; the bootstrap's
    5 % quantile is that 97.5 % replay and rejects."""
    from common.vla.controller import bootstrap_bounds, prediction_bound

    met = [40] * 98 + [30] * 2
    asked = [40] * 100
    assert prediction_bound([m / 40 for m in met], 20, 0.95) >= 0.98
    bound = bootstrap_bounds({"pi0": met}, {"pi0": asked}, 20, 0.05, 8000, 1000)["pi0"]
    assert bound == pytest.approx(0.975)
    # the same with no bad epoch: every replay at 100 %
    assert bootstrap_bounds({"pi0": [40] * 100}, {"pi0": asked}, 20, 0.05, 8000, 1000)["pi0"] == 1.0
    # one bad epoch in 100 costs a replay 98.75 % at worst in 18 % of replays, two bad (97.5 %) in
    # 1.6 %: at 5 % it holds; spread over a family of 8 (0.6 % each) it no longer does
    one = [40] * 99 + [30]
    assert bootstrap_bounds({"pi0": one}, {"pi0": asked}, 20, 0.05, 8000, 1000)["pi0"] == pytest.approx(0.9875)
    assert bootstrap_bounds({"pi0": one}, {"pi0": asked}, 20, 0.05 / 8, 8000, 1000)["pi0"] == pytest.approx(0.975)


def test_the_confirmation_rejects_a_plan_the_small_screen_flattered(profile):
    """14 pi0 robots on one GPU: the four screen draws all reach 100 %, so the one-stage rule
    accepts the plan; sixty fresh draws show the phase alignments that cost it (95 % as the
    bootstrap judges a 20-epoch replay), and the two-stage rule rejects it, derating the limit by
    the confirmation's evidence. One GPU, one model: no ILP choice depends on its time budget."""
    placement = Placement.parse("pi0:0", ["pi0"], 1)
    two = ControllerSettings(epochs=4, duration_s=4.0, confirm_epochs=60, max_models_per_gpu=1, max_rounds=1)
    once = TrafficController(profile, {"pi0": 100.0}, MAX_BATCH, dataclasses.replace(two, acceptance="bootstrap-once"))
    flattered = once.plan(placement, {"pi0": 14})
    assert flattered.verified and not flattered.confirmed and flattered.checks[0].worst == 1.0

    controller = TrafficController(profile, {"pi0": 100.0}, MAX_BATCH, two)
    screened = controller.plan(placement, {"pi0": 14}, confirm=False)  # the search's first stage alone
    assert screened.verified and not screened.confirmed
    plan = controller.plan(placement, {"pi0": 14})
    assert not plan.verified and not plan.confirmed
    assert plan.checks[0].worst < 0.98  # the confirmation's judgement, on seeds from confirm_seed
    assert len(plan.derated) == 1 and plan.derated[0].startswith("confirmation:")
    assert plan.learned["pi0"][0] == pytest.approx(100.0 * 0.14 * 0.98)

    # a load both stages accept is confirmed, with the screen's judgement kept beside it
    held = controller.plan(placement, {"pi0": 6})
    assert held.verified and held.confirmed and len(held.screen) == 1
    assert all(c.worst >= 0.98 for c in held.checks + held.screen)


def test_the_confirmation_draws_are_fresh():
    ControllerSettings(epochs=100, seed=1000, confirm_epochs=1000, confirm_seed=2000)
    with pytest.raises(ValueError, match="overlap"):
        ControllerSettings(epochs=100, seed=1000, confirm_epochs=1000, confirm_seed=1050)
    with pytest.raises(ValueError, match="confirm_epochs"):
        ControllerSettings(confirm_epochs=0)
    # the one-stage rule has no confirmation to keep apart
    ControllerSettings(acceptance="bootstrap-once", confirm_seed=1000)
