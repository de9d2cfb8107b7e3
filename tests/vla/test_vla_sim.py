"""The discrete-event simulator: traffic, network, SLO accounting, systems."""

import math

import pytest

from common.vla import sim
from common.vla.profiles import load_profile
from common.vla.scheduler import VlaRequest


@pytest.fixture(scope="module")
def profile():
    return load_profile("rtx-pro-6000x4")


def w(robots, **kw):
    return sim.Workload(robots, epochs=kw.pop("epochs", 2), duration_s=kw.pop("duration_s", 6.0), **kw)


def test_requests_follow_the_robot_rate(profile):
    r = sim.simulate(sim.robion(), w({"pi0": 5}, epochs=1, duration_s=6.0, warmup_s=1.0), profile)
    assert r.requests == pytest.approx(5 * 2 * 5, abs=5)  # 5 robots x 2 Hz x 5 measured seconds


def test_attainment_falls_and_latency_grows_with_load(profile):
    light = sim.simulate(sim.robion(max_batch=2), w({"pi0": 4}), profile)
    heavy = sim.simulate(sim.robion(max_batch=2), w({"pi0": 40}), profile)
    assert light.attainment == 1.0 and heavy.attainment < 0.5
    assert heavy.p99_ms > light.p99_ms


def test_latency_includes_network_and_both_stages(profile):
    r = sim.simulate(sim.robion(), w({"pi0": 1}), profile)
    floor = profile.vlm_alone("pi0", 1) + profile.adit_alone("pi0", 1) + 2 * sim.NetworkModel().base_ms
    assert r.p50_ms > floor * 0.6  # two locksteps at least (each >= the co-run time of one stage)
    assert r.p50_ms < profile.slo_ms("pi0")


def test_robion_serves_more_than_monolithic_and_vllm_omni_style_at_the_same_load(profile):
    load = w({"pi0": 14}, epochs=3)
    rob = sim.simulate(sim.robion(max_batch=2), load, profile)
    mono = sim.simulate(sim.monolithic(max_batch=2), load, profile)
    omni = sim.simulate(sim.vllm_omni(max_batch=2), load, profile)
    assert rob.attainment > mono.attainment > omni.attainment


def test_same_seed_same_result_and_other_seed_differs(profile):
    a = sim.simulate(sim.robion(), w({"pi0": 16}), profile)
    b = sim.simulate(sim.robion(), w({"pi0": 16}), profile)
    c = sim.simulate(sim.robion(), w({"pi0": 16}, seed=7), profile)
    assert a == b and (a.p99_ms, a.met) != (c.p99_ms, c.met)


def test_unserved_requests_count_as_misses(profile):
    r = sim.simulate(sim.monolithic(max_batch=1), w({"pi0": 60}, epochs=1), profile, drain_s=0.0)
    assert r.attainment < 0.2 and math.isinf(r.p99_ms)


def test_assignment_must_place_every_robot(profile):
    with pytest.raises(ValueError):
        sim.simulate(sim.robion(), w({"pi0": 4}), profile, assignment={("pi0", 0): 3})


def test_multi_gpu_assignment_routes_robots(profile):
    seen = {}
    sim.simulate(
        sim.robion(),
        w({"pi0": 4, "smolvla": 4}, epochs=1),
        profile,
        assignment={("pi0", 0): 4, ("smolvla", 1): 4},
        on_scheduler=lambda g, s: seen.setdefault(g, s),
    )
    assert set(seen) == {0, 1} and list(seen[0].models) == ["pi0"] and list(seen[1].models) == ["smolvla"]


def test_inter_gpu_disaggregation_moves_the_prefix_between_gpus(profile):
    r = sim.simulate(sim.disaggregated(1, 1, max_batch=2), w({"pi0": 6}), profile)
    assert r.system == "dis-1:1" and r.attainment > 0.9


def test_max_robots_bisects_a_monotone_curve():
    fake = lambda n: sim.SimResult("x", n, 100, 100 if n <= 37 else 90, 0, 0)  # noqa: E731
    n, seen = sim.max_robots(fake, 0.98, cap=128)
    assert n == 37 and len(seen) < 16


def test_drain_backlog_finishes_everything(profile):
    from common.vla.scheduler import LockstepScheduler

    s = LockstepScheduler({"pi0": "pi0"}, max_batch=2, profile=profile)
    reqs = [VlaRequest("pi0", 0.0, 0.0, 1.0) for _ in range(5)]
    done, t = sim.drain_backlog(s, profile, reqs)
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs) and t > 0


def test_early_release_only_moves_actions_earlier_and_helps_a_mixed_gpu():
    """Beyond the paper: an action leaves when its ADiT stream ends, not at the lockstep barrier.
    No latency grows; one architecture alone barely moves (its ADiT is mostly the longer stream,
    so its end is the barrier); pi0 beside SmolVLA (a short ADiT beside a long VLM) gains."""
    prof = load_profile("rtx-pro-6000x4")
    mb = {"pi0": 2, "smolvla": 4}

    def both(robots):
        return [
            sim.simulate(
                sim.robion(max_batch=mb, early_release=e),
                sim.Workload(robots, epochs=10, duration_s=10.0, seed=0),
                prof,
            )
            for e in (False, True)
        ]

    alone, early = both({"pi0": 12})
    assert early.system == "robion-early-release"
    assert early.per_model["pi0"].met == alone.per_model["pi0"].met and early.p50_ms <= alone.p50_ms
    barrier, early = both({"pi0": 5, "smolvla": 5})
    assert early.p99_ms <= barrier.p99_ms and early.p50_ms <= barrier.p50_ms
    assert early.per_model["smolvla"].attainment > barrier.per_model["smolvla"].attainment
    assert early.per_model["pi0"].attainment >= barrier.per_model["pi0"].attainment
