"""The engine is handed its policy and cost model (names are resolved only at `Engine`): a
handed policy object runs whatever the options name, and the optimal planner plans with the
cost model handed in."""

import pytest
from testkit import GEOMETRY, MAX_NEW, CutAfter, engine, inputs_for

from common.durable import ThrottledFS
from common.record import Kind, decode
from flight.checkpoint.policies import NoCheckpointPolicy
from flight.engine import Engine, EngineOptions, SimulatedCut
from flight.engine import restore as restore_module
from flight.model.loader import load_model
from flight.recovery import calibration_cache
from flight.recovery.cost import CostModel


class CountingCostModel(CostModel):
    """A cost model that remembers the block grids it was asked to cost."""

    asked: list = []

    def block_costs(self, groups, chunks):
        CountingCostModel.asked.append((list(groups), list(chunks)))
        return super().block_costs(groups, chunks)


@pytest.fixture(scope="module")
def model(model_dirs):
    return load_model(model_dirs["qwen3-vl"], device="cpu")


def _cut_in_prefill(model, tmp_path):
    """(inputs, the uninterrupted result, a checkpoint directory cut after three prefill blocks)."""
    inputs = inputs_for(model)
    whole = engine(model).run(inputs, str(tmp_path / "whole"), MAX_NEW)
    ckpt = str(tmp_path / "cut")
    cut = CutAfter(3, names=("prefill_block_done",))
    with pytest.raises(SimulatedCut):
        engine(model, events=cut.event).run(inputs, ckpt, MAX_NEW)
    return inputs, whole, ckpt


def test_a_handed_policy_is_the_one_that_runs(model, tmp_path):
    inputs = inputs_for(model)
    options = EngineOptions(geometry=GEOMETRY, policy="orbitweaver", async_writes=False)
    handed = Engine(model, options, policy=NoCheckpointPolicy()).run(inputs, str(tmp_path / "none"), MAX_NEW)
    named = engine(model, policy="none").run(inputs, str(tmp_path / "named"), MAX_NEW)
    assert handed.records_written == named.records_written == 0
    assert handed.token_ids == named.token_ids and handed.logits_sha256() == named.logits_sha256()
    stored, _ = decode((tmp_path / "none" / "MANIFEST").read_bytes(), expect_kind=Kind.MANIFEST)
    assert stored.meta["manifest"]["policy"] == "none"


def test_the_optimal_planner_plans_with_the_handed_cost_model(model, tmp_path, monkeypatch):
    inputs, whole, ckpt = _cut_in_prefill(model, tmp_path)
    default = calibration_cache.cost_model_for(model)
    handed = CountingCostModel(**{name: getattr(default, name) for name in default.__dataclass_fields__})
    CountingCostModel.asked.clear()
    # the default (the calibration cache) must not be consulted when a cost model is handed in
    monkeypatch.setattr("flight.engine.request.cost_model_for", lambda *a, **k: pytest.fail("looked up"))
    options = EngineOptions(geometry=GEOMETRY, planner="optimal", async_writes=False)
    resumed = Engine(model, options, cost_model=handed).run(inputs, ckpt, MAX_NEW)
    assert resumed.resumed and resumed.plan["planner"] == "optimal"
    groups = GEOMETRY.layer_groups(model.adapter.num_layers)
    assert CountingCostModel.asked and CountingCostModel.asked[0] == (groups, GEOMETRY.token_chunks(inputs.num_tokens))
    assert resumed.token_ids == whole.token_ids and resumed.logits_sha256() == whole.logits_sha256()


def _planned_costs(monkeypatch) -> list:
    """The costs of every plan the engine makes from now on (PrefillRestore's make_plan)."""
    planned = []
    real_make_plan = restore_module.make_plan

    def make_plan(planner, problem):
        planned.append(problem.costs)
        return real_make_plan(planner, problem)

    monkeypatch.setattr(restore_module, "make_plan", make_plan)
    return planned


def test_a_paced_engine_plans_with_the_pace_and_the_throttled_reads(model, tmp_path, monkeypatch):
    """The testbench paces compute to stand in for the target's: its planner must see that
    pace (not this machine's cached calibration, hundreds of times faster) and the emulated
    storage's read rate, or its plans depend on what happens to be cached here."""
    inputs, whole, ckpt = _cut_in_prefill(model, tmp_path)
    planned = _planned_costs(monkeypatch)
    pace_ms, read_bps = 4.0, 50e6
    fs = ThrottledFS(read_bps, None)
    resumed = engine(model, planner="optimal", pace_ms=pace_ms, fs=fs).run(inputs, ckpt, MAX_NEW)
    assert resumed.resumed and resumed.plan["costs"].startswith("paced 4 ms/unit")
    (costs,) = planned
    groups = GEOMETRY.layer_groups(model.adapter.num_layers)
    for group, (first, end) in enumerate(groups):
        assert all(c >= (end - first) * pace_ms / 1000 for c in costs["compute"][group])
    kv_bytes = calibration_cache.cost_model_for(model).kv_bytes_per_token_layer
    (first, end), (start, stop) = groups[0], GEOMETRY.token_chunks(inputs.num_tokens)[0]
    assert costs["kv"][0][0] >= (end - first) * (stop - start) * kv_bytes / read_bps
    assert resumed.token_ids == whole.token_ids and resumed.logits_sha256() == whole.logits_sha256()
    # its weights are not throttled (no read hook): charged at the cost model's own rate, not
    # at the checkpoint throttle's (which made every group's weights look slow and every group
    # order tie)
    native = calibration_cache.cost_model_for(model)
    weight_bytes = native.group_weight_bytes(groups)
    assert costs["weights"] == pytest.approx([native.read_s(b) for b in weight_bytes])
    assert costs["weights"][0] < weight_bytes[0] / read_bps / 10


def test_weights_behind_a_read_throttle_are_planned_at_its_rate(tmp_path, model_dirs, monkeypatch):
    """Weights read through an emulated throttle (`--emulate-weight-read-mbps`, or the
    checkpoint throttle as the recovery bench reads them) are planned at that rate."""
    from common.durable import TokenBucket, read_rate_of
    from flight.model.loader import load_model

    fs = ThrottledFS(50e6, None)
    assert read_rate_of(None) is None and read_rate_of(print) is None
    assert read_rate_of(TokenBucket(7e6).take) == 7e6
    assert read_rate_of(fs.charge_read) == 50e6 and read_rate_of(fs.weighted(0.25).charge_read) == 200e6
    assert read_rate_of(ThrottledFS(None, 1e6).charge_read) is None
    throttled = load_model(model_dirs["qwen3-vl"], device="cpu", read_hook=fs.charge_read)
    inputs, _, ckpt = _cut_in_prefill(throttled, tmp_path)
    planned = _planned_costs(monkeypatch)
    engine(throttled, planner="optimal", fs=fs).run(inputs, ckpt, MAX_NEW)
    (costs,) = planned
    native = calibration_cache.cost_model_for(throttled)
    groups = GEOMETRY.layer_groups(throttled.adapter.num_layers)
    expected = [b / 50e6 + native.read_latency_s for b in native.group_weight_bytes(groups)]
    assert costs["weights"] == pytest.approx(expected)


def test_a_restart_reports_what_it_found_and_what_its_plan_does_first(model, tmp_path):
    """The payload's log keeps each restart's plan: the stored blocks per layer group, whether
    vision.out was durable, and the plan's first computes (how a slow restart is explained)."""
    inputs, _, ckpt = _cut_in_prefill(model, tmp_path)
    seen = []
    engine(model, planner="optimal", events=lambda name, **fields: seen.append((name, fields))).run(
        inputs, ckpt, MAX_NEW
    )
    (plan,) = [fields for name, fields in seen if name == "recovery_plan" and "stored_by_group" in fields]
    (opened,) = [fields for name, fields in seen if name == "request_opened"]
    assert opened["phase"] == "prefill" and opened["position"] >= 1  # blocks found on disk
    assert sum(plan["stored_by_group"]) == opened["position"]
    assert len(plan["stored_by_group"]) == len(GEOMETRY.layer_groups(model.adapter.num_layers))
    assert plan["vision_out_durable"] is True
    assert plan["first_computes"] and all(c.startswith(("block", "reproject")) for c in plan["first_computes"])
