"""Acceptance: the same scheduler code drives the simulator and the real CPU backend."""

import numpy as np
import pytest

from common.vla import scheduler as sched_mod
from common.vla import sim
from common.vla.backend_cpu import CpuLockstepBackend
from common.vla.config import MODELS
from common.vla.engine import ServingEngine
from common.vla.models import VlaPolicy, example_observation
from common.vla.profiles import load_profile
from common.vla.scheduler import LockstepScheduler, PlanRecord, SequentialScheduler, VlaRequest

ARCH = {"pi0": "pi0", "smolvla": "smolvla"}
SLO_MS = {"pi0": 900.0, "smolvla": 300.0}  # differ a lot, so ESF's choice does not hinge on submit jitter
BACKLOG = ["pi0", "smolvla", "pi0", "smolvla", "smolvla", "pi0", "smolvla", "pi0"]


@pytest.fixture(scope="module")
def policies():
    return {m: VlaPolicy(MODELS[m]) for m in ARCH}


def _positions(records, order):
    """Plan records with request ids replaced by backlog positions (ids differ between runs)."""
    pos = {rid: i for i, rid in enumerate(order)}
    return [
        PlanRecord(
            r.index,
            r.vlm_model,
            tuple(pos[i] for i in r.vlm_requests),
            r.adit_model,
            tuple(pos[i] for i in r.adit_requests),
            r.vlm_share,
            r.sequential,
        )
        for r in records
    ]


def _spy(monkeypatch):
    """Count plan() calls per scheduler instance, through the class both paths must use."""
    calls = []
    for cls in (LockstepScheduler, SequentialScheduler):
        original = cls.plan

        def plan(self, now, _orig=original):
            calls.append(self)
            return _orig(self, now)

        monkeypatch.setattr(cls, "plan", plan)
    return calls


@pytest.mark.parametrize("system,policy", [("robion", "esf"), ("robion", "rr"), ("monolithic", "esf")])
def test_simulator_and_cpu_engine_make_identical_decisions(policies, monkeypatch, system, policy):
    profile = load_profile("rtx-pro-6000x4")
    calls = _spy(monkeypatch)

    # Simulator: the backlog at t = 0, durations from the profile.
    sim_sched = sched_mod.make_scheduler(system, ARCH, policy=policy, max_batch=2, profile=profile)
    backlog = [VlaRequest(m, 0.0, 0.0, SLO_MS[m] / 1e3) for m in BACKLOG]
    done_sim, makespan = sim.drain_backlog(sim_sched, profile, backlog)
    assert len(done_sim) == len(BACKLOG) and makespan > 0

    # Real engine: the same backlog submitted before the coordinator starts, real threads and models.
    real_sched = sched_mod.make_scheduler(system, ARCH, policy=policy, max_batch=2, profile=profile)
    engine = ServingEngine(policies, real_sched, CpuLockstepBackend(2), SLO_MS)
    futures = [engine.submit(m, policies[m].prepare(example_observation(i))) for i, m in enumerate(BACKLOG)]
    with engine:
        results = [f.result(timeout=60) for f in futures]
    assert all(r.actions.shape == (50, 7) for r in results)
    order_real = [r.request_id for r in results]  # in backlog order

    assert type(sim_sched) is type(real_sched)
    assert sim_sched in calls and real_sched in calls  # both paths went through the shared class
    sim_trace = _positions(sim_sched.trace, [r.request_id for r in backlog])
    real_trace = _positions(real_sched.trace, order_real)
    assert sim_trace == real_trace
    models_used = {r.vlm_model for r in sim_trace} | {r.adit_model for r in sim_trace}
    assert models_used >= {"pi0", "smolvla"}


def test_engine_results_match_the_unbatched_model(policies):
    """Requests batched and pipelined by the real engine get the chunk the model gives alone."""
    engine = ServingEngine.build(
        ["pi0", "smolvla"], slo_ms=SLO_MS, max_batch=4, batch_sizes=(1, 2, 4), backend="cpu", threads=2
    )
    obs = [example_observation(i) for i in range(6)]
    with engine:
        futs = [
            engine.submit(m, engine.policies[m].prepare(o)) for m, o in zip(["pi0", "smolvla"] * 3, obs, strict=True)
        ]
        results = [f.result(timeout=60) for f in futs]
    for (m, o), r in zip(zip(["pi0", "smolvla"] * 3, obs, strict=True), results, strict=True):
        np.testing.assert_allclose(r.actions, engine.policies[m].infer(o), atol=1e-4)
        assert r.total_ms >= r.vlm_done_ms > 0
    assert engine.stats.served == 6 and engine.stats.locksteps >= 3


def test_a_failing_batch_fails_its_requests_and_the_engine_keeps_serving(policies):
    class Flaky(VlaPolicy):
        fail_next = True

        def run_vlm(self, batch, padded):
            if Flaky.fail_next:
                Flaky.fail_next = False
                raise RuntimeError("injected stage failure")
            return super().run_vlm(batch, padded)

    flaky = Flaky(MODELS["smolvla"])
    engine = ServingEngine(
        {"smolvla": flaky},
        LockstepScheduler({"smolvla": "smolvla"}, max_batch=1, batch_sizes=(1,)),
        CpuLockstepBackend(2),
        {"smolvla": 500.0},
    )
    with engine:
        first = engine.submit("smolvla", flaky.prepare(example_observation(0)))
        with pytest.raises(RuntimeError, match="injected"):
            first.result(timeout=30)
        second = engine.submit("smolvla", flaky.prepare(example_observation(1)))
        assert second.result(timeout=30).actions.shape == (50, 7)
    assert engine.stats.failed == 1 and engine.stats.served == 1
    # stop() leaves no executor thread behind: one still alive when the interpreter exits made
    # `ow vla serve` abort on SIGTERM ("terminate called without an active exception", exit -6)
    assert not engine.backend._vlm.is_alive() and not engine.backend._adit.is_alive()
