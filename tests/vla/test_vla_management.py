"""Placement and the traffic-control integer program (acceptance: equals brute force; solves 8x4)."""

import random

import pytest

from common.vla.config import EIGHT_MODELS, model_spec
from common.vla.controller import compositions
from common.vla.management import (
    Placement,
    assign_brute_force,
    assign_eps,
    assign_greedy,
    assign_ilp,
    assign_smg,
    gpu_load,
    robot_limits,
)


def _instances(n):
    rng = random.Random(1234)
    for i in range(n):
        models = ["a", "b", "c"][: rng.randint(1, 3)]
        if i % 3 == 0:
            pl = Placement.colocate(models, 3)
        elif i % 3 == 1:
            pl = Placement.groups([(models[:-1] or models, [0, 1]), (models[-1:] if len(models) > 1 else [], [2])])
        else:
            pl = Placement(
                f"random-{i}", 3, {m: tuple(sorted(rng.sample(range(3), rng.randint(1, 3)))) for m in models}
            )
        robots = {m: rng.randint(0, 7) for m in models}
        limits = {m: rng.randint(2, 9) for m in models}
        yield pl, robots, limits


@pytest.mark.parametrize("case", list(range(60)))
def test_ilp_equals_brute_force_on_small_instances(case):
    pl, robots, limits = list(_instances(60))[case]
    ilp = assign_ilp(pl, robots, limits)
    brute = assign_brute_force(pl, robots, limits)
    assert ilp.optimal
    assert ilp.objective[:3] == brute.objective[:3]
    assert ilp.objective[3] == pytest.approx(brute.objective[3], abs=1e-6)
    assert ilp.feasible == brute.feasible
    for m, r in robots.items():  # every robot placed, only on GPUs that host its model
        assert sum(n for (mm, g), n in ilp.counts.items() if mm == m) == r
    assert all(g in pl.hosts[m] for (m, g) in ilp.counts)


def _colocation_instances(n):
    """Like _instances, with limits that fall as models share a GPU (k-th entry: k models)."""
    rng = random.Random(99)
    for pl, robots, limits in _instances(n):
        yield (
            pl,
            robots,
            {
                m: tuple(max(1, round(lim * f)) for f in (1.0, 0.6, 0.35)[: rng.randint(2, 3)])
                for m, lim in limits.items()
            },
        )


@pytest.mark.parametrize("case", list(range(20)))
def test_colocation_aware_ilp_equals_brute_force(case):
    pl, robots, limits = list(_colocation_instances(20))[case]
    ilp = assign_ilp(pl, robots, limits, time_limit_s=30)
    brute = assign_brute_force(pl, robots, limits)
    assert ilp.optimal and ilp.objective[:3] == brute.objective[:3]
    assert ilp.objective[3] == pytest.approx(brute.objective[3], abs=1e-6)
    for g, load in ilp.loads.items():  # the reported load is the co-location-aware one
        assert load == pytest.approx(gpu_load(ilp.robots_on(g), limits))


def _composition_instances(n):
    """Catalogue models (two architectures) with limits keyed by composition: a random limit per
    architecture alone, and for each composition a random fraction of it per architecture."""
    rng = random.Random(7)
    for i in range(n):
        models = rng.sample(["pi0", "pi0-ft1", "smolvla", "smolvla-ft1"], rng.randint(2, 3))
        pl = (
            Placement.colocate(models, 2)
            if i % 2 == 0
            else Placement.parse(f"{models[0]}:0;{','.join(models[1:])}:1", models, 2)
        )
        archs = {model_spec(m).arch for m in models}
        alone = {a: rng.randint(4, 12) for a in archs}
        table = {a: {} for a in archs}
        for comp in compositions({a: sum(1 for m in models if model_spec(m).arch == a) for a in archs}, 3):
            for a, _ in comp:
                shared = sum(k for _, k in comp) > 1
                table[a][comp] = max(1, round(alone[a] * rng.uniform(0.3, 1.0))) if shared else alone[a]
        robots = {m: rng.randint(0, 6) for m in models}
        yield pl, robots, {m: table[model_spec(m).arch] for m in models}


@pytest.mark.parametrize("case", list(range(16)))
def test_composition_keyed_ilp_equals_brute_force(case):
    pl, robots, limits = list(_composition_instances(16))[case]
    ilp = assign_ilp(pl, robots, limits, time_limit_s=30)
    brute = assign_brute_force(pl, robots, limits)
    assert ilp.optimal and ilp.objective[:3] == brute.objective[:3]
    assert ilp.objective[3] == pytest.approx(brute.objective[3], abs=1e-6)
    for g, load in ilp.loads.items():
        assert load == pytest.approx(gpu_load(ilp.robots_on(g), limits))


def test_the_ilp_pairs_models_by_what_their_composition_serves():
    """Two pi0 and two SmolVLA variants on two GPUs, two per GPU. Keyed by model count alone the
    pairings look alike; keyed by composition the ILP takes the pairing whose limits hold."""
    models = ["pi0", "pi0-ft1", "smolvla", "smolvla-ft1"]
    pl = Placement.parse("pi0,smolvla:0;pi0-ft1,smolvla-ft1:1", models, 2)  # fixed mixed pairs
    same = Placement.parse("pi0,pi0-ft1:0;smolvla,smolvla-ft1:1", models, 2)
    robots = {m: 6 for m in models}
    pair, two_pi0, two_smol = (("pi0", 1), ("smolvla", 1)), (("pi0", 2),), (("smolvla", 2),)
    limits = {
        m: {(("pi0", 1),): 20.0, two_pi0: 14.0, pair: 7.0}
        if m.startswith("pi0")
        else {(("smolvla", 1),): 60, two_smol: 40.0, pair: 30.0}
        for m in models
    }
    assert not assign_ilp(pl, robots, limits).feasible  # a pair: 6/7 + 6/30 = 1.06
    assert assign_ilp(same, robots, limits).feasible  # 12/14 and 12/40
    mix = assign_ilp(Placement.colocate(models, 2), robots, limits, time_limit_s=30)
    assert mix.feasible and sorted(sorted(mix.robots_on(g)) for g in range(2)) == [
        ["pi0", "pi0-ft1"],
        ["smolvla", "smolvla-ft1"],
    ]


def _random_8x4(rng):
    pl = (
        Placement.colocate(EIGHT_MODELS, 4)
        if rng.random() < 0.5
        else Placement.parse("pi0*:0,1;smolvla*:2,3", list(EIGHT_MODELS), 4)
    )
    return pl, {m: rng.randint(0, 12) for m in EIGHT_MODELS}, {m: rng.randint(8, 40) for m in EIGHT_MODELS}


@pytest.mark.parametrize("time_limit", [0.1, 0.3, 0.5])
def test_ilp_returns_an_assignment_whatever_the_time_budget(time_limit):
    # A busy machine stretches every solve: the budget must end the search, never the answer.
    rng = random.Random(int(time_limit * 10))
    for _ in range(3):
        pl, robots, limits = _random_8x4(rng)
        a = assign_ilp(pl, robots, limits, time_limit_s=time_limit)
        for m, r in robots.items():
            assert sum(n for (mm, _), n in a.counts.items() if mm == m) == r
        assert all(g in pl.hosts[m] for (m, g) in a.counts)
        assert a.optimal or a.note  # an early stop says why


def test_no_time_at_all_gives_the_greedy_assignment_flagged():
    pl, robots, limits = _random_8x4(random.Random(5))
    a = assign_ilp(pl, robots, limits, time_limit_s=0.0)
    assert not a.optimal and "greedy" in a.note
    assert a.counts == assign_greedy(pl, robots, limits).counts


def test_gpus_below_the_peak_are_balanced():
    # Four variants with the same limit on two GPUs: 2 + 2, not 3 + 1 (the peak alone allows both
    # when a third GPU carries a bigger model).
    pl = Placement.colocate(["a", "b", "c", "d", "big"], 3)
    robots = {"a": 4, "b": 4, "c": 4, "d": 4, "big": 30}
    a = assign_ilp(pl, robots, {m: 32 for m in robots}, time_limit_s=30)
    assert a.optimal and a.splits == 5
    small = sorted(len(a.robots_on(g)) for g in range(3) if "big" not in a.robots_on(g))
    assert small == [2, 2]


def test_eight_models_on_four_gpus_solves_within_limits():
    pl = Placement.colocate(EIGHT_MODELS, 4)
    robots = {m: 11 for m in EIGHT_MODELS}  # 88 robots; total load 3.69 GPUs
    limits = {m: (15 if m.startswith("pi0") else 58) for m in EIGHT_MODELS}
    a = assign_ilp(pl, robots, limits, time_limit_s=30)
    assert a.optimal and a.feasible and a.peak_load <= 1.0
    assert a.splits == len(EIGHT_MODELS)  # every model fits whole on some GPU: no model is split
    assert len({g for (_, g) in a.counts}) == 4  # and no GPU idles


def test_paper_figure5_concentrates_a_model_and_splits_only_when_needed():
    # Paper Fig. 5: GPU 0 serves four model-A robots, GPU 1 the other two A robots and two B robots.
    pl = Placement.colocate(["A", "B"], 2)
    a = assign_ilp(pl, {"A": 6, "B": 2}, {"A": 4, "B": 4})
    assert a.feasible and a.splits == 3
    assert sorted(a.counts.values()) == [2, 2, 4]
    assert {n for (m, _), n in a.counts.items() if m == "B"} == {2}


def test_smg_and_eps_as_read():
    pl = Placement.colocate(["p", "q", "r", "s"], 4)
    robots = dict(zip("pqrs", (8, 8, 8, 24), strict=True))
    limits = {m: 16 for m in robots}
    smg, eps, ilp = assign_smg(pl, robots, limits), assign_eps(pl, robots, limits), assign_ilp(pl, robots, limits)
    assert smg.splits == 4 and not smg.feasible and smg.counts[("s", 3)] == 24  # one home GPU per model
    assert eps.splits == 16 and all(eps.counts[(m, g)] == robots[m] // 4 for m in robots for g in range(4))
    assert ilp.feasible and ilp.splits < eps.splits


def test_overloaded_mix_is_reported_not_hidden():
    pl = Placement.replicate("pi0", [0, 1], 2)
    a = assign_ilp(pl, {"pi0": 50}, {"pi0": 20})
    assert not a.feasible and a.counts[("pi0", 0)] + a.counts[("pi0", 1)] == 50
    assert a.peak_load == pytest.approx(25 / 20)


def test_placement_parsing():
    pl = Placement.parse("pi0*:0,1;smolvla*:2,3", list(EIGHT_MODELS), 4)
    assert pl.hosts["pi0-ft2"] == (0, 1) and pl.hosts["smolvla"] == (2, 3)
    with pytest.raises(ValueError):
        Placement.parse("pi0*:0,1;pi0*:1,2", ["pi0"], 4)
    with pytest.raises(ValueError):
        Placement.parse("pi0*:0", ["pi0", "smolvla"], 4)  # smolvla unplaced


def test_robot_limits_come_from_simulation_and_are_shared_by_variants():
    from common.vla.profiles import load_profile

    limits = robot_limits(
        load_profile("rtx-pro-6000x4"), ["smolvla", "smolvla-ft1"], max_batch=4, epochs=1, duration_s=4.0, cap=128
    )
    assert limits["smolvla"] == limits["smolvla-ft1"] > 0
