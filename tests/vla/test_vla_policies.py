"""Acceptance: ESF beats RR and LQF when co-located models' SLOs differ (simulated, shared scheduler)."""

import pytest

from common.vla import sim
from common.vla.bench import POLICY_CASES, BenchSettings, policy_case
from common.vla.profiles import load_profile

SETTINGS = BenchSettings(epochs=3, duration_s=8.0)


@pytest.fixture(scope="module")
def profile():
    return load_profile("rtx-pro-6000x4")


def test_esf_beats_rr_and_lqf_when_slos_differ(profile):
    # SmolVLA-like robots with a 75 ms SLO share a GPU with more pi0-like robots that have 400 ms:
    # LQF keeps serving the longer pi0 queue, RR gives it every other lockstep, ESF serves the
    # queue whose head is closest to its deadline.
    name, robots, slo = POLICY_CASES[2]
    assert slo["smolvla"] < slo["pi0"] and robots["pi0"] > robots["smolvla"]
    att = {p: policy_case(profile, SETTINGS, robots, slo, p) for p in ("esf", "rr", "lqf")}
    assert att["esf"].attainment > att["rr"].attainment
    assert att["esf"].attainment > att["lqf"].attainment
    # The gain comes from the tight-SLO model, not from starving the other one below it.
    assert att["esf"].per_model["smolvla"].attainment > att["rr"].per_model["smolvla"].attainment
    assert att["esf"].per_model["smolvla"].attainment > att["lqf"].per_model["smolvla"].attainment


def test_policies_tie_when_queues_are_alike(profile):
    # Paper §5.3: ESF has little advantage when co-located models share architecture and SLO.
    robots = {"pi0": 6, "pi0-ft1": 6}
    att = [
        sim.simulate(sim.robion(policy=p, max_batch=2), SETTINGS.workload(robots), profile).attainment
        for p in ("esf", "rr", "lqf")
    ]
    assert max(att) - min(att) < 0.05
