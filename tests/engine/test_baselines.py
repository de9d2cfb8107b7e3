"""The baselines follow their definitions (docs/baselines.md): SONIC commits every task on the
compute path and restores before continuing; HCache saves hidden states off the compute path,
recomputes the first layers and restores layer by layer; the strengthened variants use
OrbitWeaver's writer and planner."""

import threading

import pytest
from testkit import MAX_NEW, CutAfter, engine, inputs_for, run_to_completion

from flight.checkpoint.policies import get_policy, hcache_recompute_layers
from flight.engine import SimulatedCut
from flight.model.loader import load_model


def _commits(model_dir, tmp_path, policy):
    """(record, bytes, committed on the compute thread?) for an uninterrupted run with the
    background writer requested."""
    model = load_model(model_dir, device="cpu")
    seen = []
    main = threading.current_thread()
    engine(
        model,
        policy=policy,
        async_writes=True,
        after_commit=lambda what, n: seen.append((what, n, threading.current_thread() is main)),
    ).run(inputs_for(model), str(tmp_path / policy), MAX_NEW)
    return seen


@pytest.mark.parametrize(
    "policy,on_compute_path",
    [("sonic-layer", True), ("sonic-chunk", True), ("hcache", False), ("orbitweaver", False), ("sonic-layer+", False)],
)
def test_who_commits_on_the_compute_path(model_dirs, tmp_path, policy, on_compute_path):
    commits = _commits(model_dirs["qwen3-vl"], tmp_path, policy)
    ordered = [c for c in commits if c[0] != "vision.out"]
    assert ordered and all(c[2] == on_compute_path for c in ordered)
    names = [c[0] for c in commits]
    if policy.startswith("sonic-") and not policy.endswith("+"):
        # every vision block and every decode step is a task of its own
        assert sum(n.startswith("vision.state") for n in names) == 3  # 4 blocks: after 1, 2, 3
        assert sum(n.startswith("decode") for n in names) == MAX_NEW - 2  # not the last step (RESULT)


def test_hcache_saves_hidden_states_not_kv_and_nothing_for_recomputed_layers(model_dirs, tmp_path):
    from flight.checkpoint.store import CheckpointStore

    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    layers = model.adapter.num_layers
    policy = get_policy("hcache")
    policy.geometry(engine(model).options.geometry, layers)
    assert policy.recompute_layers == hcache_recompute_layers(layers)
    inputs = inputs_for(model)
    ckpt = tmp_path / "h"
    with pytest.raises(SimulatedCut):  # stop at the end of prefill: every block record is there
        engine(model, policy="hcache", events=CutAfter(1, ("decode_step_done",)).event).run(inputs, str(ckpt), MAX_NEW)
    store = CheckpointStore(str(ckpt))
    assert store.open(engine(model, policy="hcache").manifest(inputs, MAX_NEW)).status == "resume"
    fr = store.scan()
    assert fr.blocks and all(info.kv_bytes == 0 for info in fr.blocks.values())
    assert {g for g, _ in fr.blocks} == set(range(max(0, policy.recompute_layers - 1), layers))


@pytest.mark.parametrize(
    "policy,planner",
    [("sonic-layer", "chunk-first"), ("sonic-chunk", "chunk-first"), ("hcache", "layer-first"), ("hcache+", "optimal")],
)
def test_each_restores_with_its_own_scheduler(model_dirs, tmp_path, policy, planner):
    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    ref = engine(model, policy=policy).run(inputs, str(tmp_path / "ref"), MAX_NEW)
    ckpt = tmp_path / "ck"
    with pytest.raises(SimulatedCut):  # a cut in the middle of prefill
        engine(load_model(model_dir, device="cpu"), policy=policy, events=CutAfter(4 + 3).event).run(
            inputs, str(ckpt), MAX_NEW
        )
    resumed = run_to_completion(model_dir, inputs, ckpt, policy=policy, planner="optimal")
    assert resumed.resumed_from["phase"] == "prefill"
    assert resumed.plan["planner"] == planner
    assert resumed.token_ids == ref.token_ids
