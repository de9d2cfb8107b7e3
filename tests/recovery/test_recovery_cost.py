"""Cost model: byte and FLOP counts, block costs, the target-emulated scaling, calibration."""

import warnings

import numpy as np
import pytest

from bench import calibration
from flight.recovery import calibration_cache, cost
from flight.recovery.calibration_cache import cost_model_for
from flight.recovery.cost import (
    MODELS,
    ORIN_AGX_NVME,
    BlockCosts,
    CostModel,
    ModelDims,
    even_chunks,
    even_groups,
    reference_costs,
)
from flight.recovery.plan import ReadOp, RecoveryProblem

KIB = 1024


def test_kv_sizes_match_the_released_checkpoints():
    # DESIGN §5: Qwen3-VL-2B 112 KiB of KV per token; 4B and 8B 144 KiB (bf16)
    per_token = {name: d.kv_bytes_per_token_layer * d.layers for name, d in MODELS.items()}
    assert per_token == {"qwen3-vl-2b": 112 * KIB, "qwen3-vl-4b": 144 * KIB, "qwen3-vl-8b": 144 * KIB}
    # ~1.7 B decoder parameters in Qwen3-VL-2B's 28 layers + embeddings (the "2B" of its name)
    d = MODELS["qwen3-vl-2b"]
    assert 1.6e9 < d.layers * d.layer_params + d.vocab * d.hidden < 1.8e9


def test_block_costs_by_hand():
    m = CostModel(
        layer_weight_bytes=(100, 100, 100),
        embed_weight_bytes=50,
        head_weight_bytes=30,
        kv_bytes_per_token_layer=2,
        hidden_bytes_per_token=4,
        read_bytes_per_s=10.0,
        read_latency_s=1.0,
        layer_call_s=0.5,
        token_layer_s=0.01,
        pair_layer_s=0.001,
        reproject_share=0.5,
    )
    c = m.block_costs([(0, 2), (2, 3)], [(0, 10), (10, 20), (20, 25)])
    assert c.weights.tolist() == [1 + 250 / 10, 1 + 130 / 10]
    assert c.kv[0].tolist() == pytest.approx([1 + 2 * 10 * 2 / 10, 1 + 2 * 10 * 2 / 10, 1 + 2 * 5 * 2 / 10])
    assert c.hidden[1].tolist() == pytest.approx([1 + 40 / 10, 1 + 40 / 10, 1 + 20 / 10])
    # compute (2 layers, 10 tokens from 10): 2 * (0.5 + 10*0.01 + (10*10 + 55)*0.001)
    assert c.compute[0, 1] == pytest.approx(2 * (0.5 + 0.1 + 0.155))
    assert c.reproject[1, 0] == pytest.approx(1 * (0.5 + 10 * 0.01 * 0.5))
    # equal chunks: attention makes a block cost a + b*c
    big = MODELS["qwen3-vl-8b"]
    costs = CostModel.for_target(big).block_costs(even_groups(36, 18), even_chunks(16 * 1024, 1024))
    steps = np.diff(costs.compute[3])
    assert steps.min() > 0 and steps.max() == pytest.approx(steps.min(), rel=1e-9)


def test_costs_dict_round_trip_and_broadcasting():
    c = BlockCosts.from_dict({"weights": 2, "kv": [1, 2], "hidden": 0.5, "compute": [[1, 2, 3], [4, 5, 6]]}, 2, 3)
    assert c.kv.tolist() == [[1, 1, 1], [2, 2, 2]] and c.weights.tolist() == [2, 2]
    assert np.allclose(c.reproject, np.array([[1, 2, 3], [4, 5, 6]]) * cost.REPROJECT_COST_SHARE)
    again = BlockCosts.from_dict(c.as_dict(), 2, 3)
    for key in ("weights", "kv", "hidden", "compute", "reproject"):
        assert np.array_equal(getattr(c, key), getattr(again, key))
    assert c.read_s(ReadOp("kv", 1, 2)) == 2 and c.compute_s(1, 0) == 4
    with pytest.raises(ValueError, match="shape"):
        BlockCosts.from_dict({"weights": [1, 2, 3], "kv": 1, "hidden": 1, "compute": 1}, 2, 3)
    with pytest.raises(ValueError, match="lack"):
        BlockCosts.from_dict({"weights": 1, "kv": 1}, 2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        BlockCosts.from_dict({"weights": 1, "kv": -1, "hidden": 1, "compute": 1}, 2, 3)


def test_reference_costs_when_a_problem_has_none():
    c = BlockCosts.for_problem(RecoveryProblem(7, 3, set(), set()))
    assert c.source.startswith("reference:") and c.shape == (7, 3)
    assert c.weights[0] > c.weights[1]  # group 0 also reads the token embeddings
    assert reference_costs(40, 2).shape == (40, 2)  # more groups than the reference has layers


def test_target_emulation_keeps_the_target_read_to_compute_ratio():
    dims = MODELS["qwen3-vl-4b"]
    target = CostModel.for_target(dims)
    native = CostModel(
        **{
            **target.to_json(),
            "layer_call_s": 2e-3,
            "token_layer_s": 5e-3,
            "pair_layer_s": 1e-7,
            "read_bytes_per_s": 1.5e9,
            "read_latency_s": 1e-4,
            "label": "native",
        }
    )
    emulated = native.target_emulated(target, layers=2, tokens=1024)
    ref_native, ref_target = native.compute_s(2, 1024, 1024), target.compute_s(2, 1024, 1024)
    assert emulated.compute_s(2, 1024, 1024) == ref_native  # compute as measured
    for nbytes in (1e3, 1e6, 1e9):
        assert emulated.read_s(nbytes) / ref_native == pytest.approx(target.read_s(nbytes) / ref_target)
    # this CPU is slower than the Orin at compute, so the emulated disk must be slower too
    assert emulated.read_bytes_per_s < ORIN_AGX_NVME.read_bytes_per_s
    assert emulated.meta["compute_slowdown_vs_target"] == pytest.approx(ref_native / ref_target)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from flight.model.loader import load_model
    from flight.model.tiny import build_tiny

    root = tmp_path_factory.mktemp("recovery-cost")
    with pytest.MonkeyPatch.context() as mp:  # the loader caches content hashes there too
        mp.setenv("OW_CACHE_DIR", str(root / "cache"))
        path = build_tiny("qwen3-vl", "tiny", 0, str(root / "tiny"))["path"]
        yield load_model(path, device="cpu")


def test_calibration_measures_and_caches(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("OW_CACHE_DIR", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # contended: checked below
        measured = calibration.calibrate(model=tiny_model, group=2, scratch_dir=str(tmp_path))
    assert measured.meta["seconds"] > 0  # how long it took is the bench's business, not a test's (rule 4)
    assert measured.read_bytes_per_s > 1e7 and measured.meta["read_samples"] >= 10
    assert measured.layer_call_s > 0 or measured.token_layer_s > 0
    assert measured.num_layers == tiny_model.adapter.num_layers
    assert measured.kv_bytes_per_token_layer == 2 * 2 * 32 * 4  # 2 KV heads x 32 dims, K and V, fp32
    if measured.meta["contended"]:  # a loaded machine gave no sample timed alone: nothing is kept
        assert calibration_cache.cached(measured.meta["key"]) is None
        pytest.skip("calibration ran next to other work on every try, so it was rightly not cached")
    # a second call is served from the cache, measuring nothing
    monkeypatch.setattr(calibration, "measure_reads", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(calibration, "measure_compute", lambda *a, **k: pytest.fail("measured again"))
    again = calibration.calibrate(model=tiny_model, group=2, scratch_dir=str(tmp_path))
    assert again == measured
    assert cost_model_for(tiny_model, scratch_dir=str(tmp_path)) == measured
    emulated = cost_model_for(tiny_model, emulate=ORIN_AGX_NVME, scratch_dir=str(tmp_path))
    assert emulated.label == "target-emulated" and emulated.layer_call_s == measured.layer_call_s
    # another model (content hash) is another key
    assert calibration_cache.calibration_key("other", "cpu", "float32", str(tmp_path)) != measured.meta["key"]


def test_uncalibrated_model_uses_its_bytes_at_target_rates(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("OW_CACHE_DIR", str(tmp_path / "empty-cache"))
    m = cost_model_for(tiny_model, scratch_dir=str(tmp_path))
    assert m.label.startswith("uncalibrated:") and m.read_bytes_per_s == ORIN_AGX_NVME.read_bytes_per_s
    assert m.layer_weight_bytes == cost.model_bytes(tiny_model)["layer_weight_bytes"]
    dims = ModelDims.from_text_config(tiny_model.adapter.text_config, dtype_bytes=4)
    assert sum(m.layer_weight_bytes) == dims.layers * dims.layer_bytes  # the FLOP model counts every weight
