"""The controller's acceptance draws sample the replay the bench judges its plans by.

The bench emits a plan when the acceptance test says it holds "in a replay of `replay_epochs`
epochs", the test's draws being one-epoch simulations of `duration_s`; the bench then replays the
plan with its own `epochs` x `duration_s`. Both must be the same replay, or the test answers
another question than the one the replays ask (a 10 s epoch has 18 measured requests per robot,
a 6 s one 10, and a bad phase alignment weighs differently in each).
"""

import dataclasses

import pytest

from common.vla import sim
from common.vla.bench import BenchSettings
from common.vla.controller import simulate_draws
from common.vla.profiles import load_profile

CASES = {
    "default": BenchSettings(),
    "quick": BenchSettings.quick(),
    "--epochs 7 --duration 4": dataclasses.replace(BenchSettings(), epochs=7, duration_s=4.0),
    "--quick --epochs 3": dataclasses.replace(BenchSettings.quick(), epochs=3),
}


@pytest.mark.parametrize("settings", CASES.values(), ids=list(CASES))
def test_an_acceptance_draw_is_an_epoch_of_the_bench_replay(settings):
    profile = load_profile("rtx-pro-6000x4")
    robots, max_batch = {"smolvla": 3, "pi0": 2}, {"smolvla": 4, "pi0": 2}
    cs = settings.controller
    assert cs.replay_epochs == settings.epochs  # the test's replay is as long as the bench's
    draw = simulate_draws(profile, robots, max_batch, dataclasses.replace(cs, epochs=1))[0]
    # the bench's replay of this GPU, cut to its first epoch, with the draw's seed
    workload = dataclasses.replace(settings.workload(robots, seed=cs.seed), epochs=1)
    epoch = sim.simulate(sim.robion(max_batch=max_batch), workload, profile)
    assert draw.per_model == epoch.per_model  # the same epoch, request for request
