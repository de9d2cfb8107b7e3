"""The shared scheduler: queue policies, lockstep pipelining, fixed batches."""

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.vla.profiles import load_profile
from common.vla.scheduler import (
    EarliestSloFirst,
    LockstepScheduler,
    LongestQueueFirst,
    RoundRobin,
    SequentialScheduler,
    Stage,
    VlaRequest,
)

MODELS = {"pi0": "pi0", "pi0-ft1": "pi0", "smolvla": "smolvla"}


def req(model, deadline, t=0.0):
    return VlaRequest(model, sent_at=t, arrived_at=t, deadline=deadline)


def test_esf_picks_least_remaining_slo_time():
    queues = {"a": deque([req("a", 0.5)]), "b": deque([req("b", 0.2), req("b", 0.9)]), "c": deque()}
    assert EarliestSloFirst().pick(queues, now=0.1) == "b"
    assert EarliestSloFirst().pick({"c": deque()}, 0.0) is None


def test_rr_rotates_over_nonempty_queues():
    queues = {m: deque([req(m, 1.0)] * 3) for m in ("a", "b", "c")}
    queues["b"].clear()
    rr = RoundRobin()
    assert [rr.pick(queues, 0.0) for _ in range(4)] == ["a", "c", "a", "c"]


def test_lqf_picks_longest_queue():
    queues = {"a": deque([req("a", 0.1)]), "b": deque([req("b", 0.9)] * 3)}
    assert LongestQueueFirst().pick(queues, 0.0) == "b"


def test_lockstep_pipelines_vlm_then_adit():
    s = LockstepScheduler(MODELS, max_batch=2, batch_sizes=(1, 2, 4))
    rs = [req("pi0", 1.0) for _ in range(3)]
    for r in rs:
        s.submit(r)
    p1 = s.plan(0.0)
    assert p1.vlm.requests == tuple(rs[:2]) and p1.adit is None and p1.vlm.padded_size == 2
    assert s.complete(p1, 0.01) == []
    p2 = s.plan(0.01)  # the first batch's ADiT runs beside the next VLM batch
    assert p2.adit.requests == tuple(rs[:2]) and p2.vlm.requests == (rs[2],)
    assert s.complete(p2, 0.02) == rs[:2]
    p3 = s.plan(0.02)
    assert p3.vlm is None and p3.adit.requests == (rs[2],)
    assert s.complete(p3, 0.03) == [rs[2]] and s.plan(0.03) is None


def test_fixed_batches_pad_to_the_next_size_and_respect_per_model_caps():
    s = LockstepScheduler(MODELS, max_batch={"pi0": 4, "smolvla": 1}, batch_sizes=(1, 2, 4))
    for _ in range(3):
        s.submit(req("pi0", 1.0))
    assert s.plan(0.0).vlm.padded_size == 4
    for _ in range(3):
        s.submit(req("smolvla", 0.5))
    assert s.plan(0.0).vlm.size == 1
    with pytest.raises(ValueError):
        LockstepScheduler(MODELS, max_batch=3, batch_sizes=(1, 2, 4))


def test_profile_sets_the_vlm_share_per_batch_pair():
    prof = load_profile("rtx-pro-6000x4")
    s = LockstepScheduler({"pi0": "pi0"}, max_batch=4, profile=prof)
    for _ in range(8):
        s.submit(req("pi0", 1.0))
    s.complete(s.plan(0.0), 0.0)
    plan = s.plan(0.0)
    best = prof.lockstep("pi0", 4, "pi0", 4)
    assert plan.vlm_share == best.vlm_share and plan.predicted_ms == best.lockstep_ms
    assert best.lockstep_ms == min(
        e.lockstep_ms
        for e in prof.locksteps
        if (e.vlm_arch, e.vlm_batch, e.adit_arch, e.adit_batch) == ("pi0", 4, "pi0", 4)
    )
    static = LockstepScheduler({"pi0": "pi0"}, max_batch=4, profile=prof, sm_mode="static", static_share=0.5)
    for _ in range(8):
        static.submit(req("pi0", 1.0))
    static.complete(static.plan(0.0), 0.0)
    assert static.plan(0.0).vlm_share == 0.5


def test_monolithic_runs_both_stages_on_one_batch():
    s = SequentialScheduler(MODELS, max_batch=2, batch_sizes=(1, 2))
    rs = [req("pi0", 1.0) for _ in range(2)]
    for r in rs:
        s.submit(r)
    p = s.plan(0.0)
    assert p.sequential and p.vlm.requests == p.adit.requests == tuple(rs)
    assert s.complete(p, 0.1) == rs


def test_unknown_model_is_refused():
    with pytest.raises(KeyError):
        LockstepScheduler(MODELS).submit(req("nope", 1.0))


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.sampled_from(list(MODELS)), st.floats(0.05, 2.0)), min_size=1, max_size=40),
    policy=st.sampled_from(["esf", "rr", "lqf"]),
    max_batch=st.sampled_from([1, 2, 4]),
    per_step=st.integers(0, 3),
)
def test_every_request_completes_once_in_single_model_batches(arrivals, policy, max_batch, per_step):
    s = LockstepScheduler(MODELS, policy=policy, max_batch=max_batch, batch_sizes=(1, 2, 4))
    pending = [req(m, d) for m, d in arrivals]
    done, vlm_done, now = [], set(), 0.0
    while pending or s.pending():
        for _ in range(per_step or 1):  # arrivals interleave with locksteps
            if pending:
                s.submit(pending.pop(0))
        plan = s.plan(now)
        if plan is None:
            continue
        for b, stage in ((plan.vlm, Stage.VLM), (plan.adit, Stage.ADIT)):
            if b:
                assert b.stage == stage and 1 <= b.size <= max_batch <= b.padded_size or b.size <= b.padded_size
                assert {r.model for r in b.requests} == {b.model}
        if plan.adit:
            assert all(r.request_id in vlm_done for r in plan.adit.requests)  # VLM strictly before ADiT
        if plan.vlm:
            vlm_done.update(r.request_id for r in plan.vlm.requests)
        now += 0.01
        done += s.complete(plan, now)
    assert sorted(r.request_id for r in done) == sorted({r.request_id for r in done})
    assert len(done) == len(arrivals)
