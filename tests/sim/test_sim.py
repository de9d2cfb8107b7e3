"""The lifecycle simulator: record sizes are the engine's, sessions behave like the engine's
phases across cuts, and the real-size figures are computable (fast: no model runs)."""

import math

import pytest
from testkit import GEOMETRY, MAX_NEW, engine, inputs_for

from common.record import Kind, TensorSpec, encode, encoded_size
from flight.checkpoint.policies import Geometry
from hil.sim.lifecycle import Durable, RequestModel, trace_windows
from hil.sim.models import REAL_MODELS, Request, frames_request, spec_from_dir
from hil.sim.platform import Platform, Storage, target_platform

POLICIES = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache", "sonic-layer+", "sonic-chunk+", "hcache+")


def test_encoded_size_is_the_encoders_size():
    import torch

    tensors = {
        "k.0": torch.zeros(1, 2, 7, 32, dtype=torch.bfloat16),
        "v.0": torch.ones(1, 2, 7, 32),
        "hidden": torch.zeros(3, 5),
    }
    meta = {"group": 3, "chunk": 11, "layers": [6, 8], "tokens": [16, 23]}
    real = encode(Kind.PREFILL_BLOCK, meta, tensors, salt=(1 << 62) + 12345).nbytes
    specs = {
        "k.0": TensorSpec("bfloat16", (1, 2, 7, 32)),
        "v.0": TensorSpec("float32", (1, 2, 7, 32)),
        "hidden": TensorSpec("float32", (3, 5)),
    }
    assert encoded_size(Kind.PREFILL_BLOCK, meta, specs) == real


def _instant(pace=1.0):
    """A platform where every unit takes `pace` and storage is instant."""
    return Platform(
        "test",
        Storage(1e15, 0.0, 1e15, 0.0),
        boot_s=0.0,
        first_start_s=0.0,
        setup_s=0.0,
        vision_block_s=pace,
        vision_extra_s=0.0,
        decode_step_s=pace,
        pace_s=pace,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_simulated_records_are_the_bytes_the_engine_writes(model_dirs, tmp_path, policy):
    """Uninterrupted, per record kind: the simulator's record sizes equal what the real engine
    commits for the tiny model (vision states, vision output, prefill blocks, decode records)."""
    from flight.model.loader import load_model

    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    written: dict[str, int] = {}

    def events(name, **fields):
        if name == "checkpoint_committed":
            kind = fields["record"].split("[")[0].split(".state")[0]
            written[kind] = written.get(kind, 0) + fields["bytes"]

    # the simulator's records are the fixed cadence's (docs/sim.md): compare with the engine's
    engine(model, policy=policy, cadence="fixed", events=events).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    visual = int((inputs.input_ids == model.adapter.image_token_id).sum())
    request = Request(visual, inputs.num_tokens - visual, MAX_NEW, 2)
    sim = RequestModel(spec_from_dir(model_dirs["qwen3-vl"]), request, _instant(), policy, GEOMETRY, "chunk-first")
    simulated: dict[str, int] = {}
    for c in sim.uninterrupted().commits:
        kind = {"vision": "vision", "vision_out": "vision.out", "block": "prefill", "decode": "decode"}.get(c.kind)
        if kind:
            simulated[kind] = simulated.get(kind, 0) + c.nbytes
    assert simulated == written


def test_a_cut_in_prefill_resumes_and_loses_at_most_the_block_in_flight():
    spec = REAL_MODELS["qwen3-vl-2b"]
    request = frames_request(8, 2048, new_tokens=8)  # prefill-heavy: restoring beats starting over
    platform = target_platform(spec, request, "orin-agx", boot_s=5.0)
    geometry = Geometry(chunk=1024, group=4, decode_every=4, vision_every=4)
    for policy in ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache", "none"):
        m = RequestModel(spec, request, platform, policy, geometry)
        fresh = m.uninterrupted()
        alone = fresh.finished_at
        # one window cut halfway through prefill, then an open window
        cut = 5.0 + fresh.phase_s["vision"] + fresh.phase_s["prefill"] / 2
        outcome = m.run([(0.0, cut), (cut + 10.0, math.inf)], arrival=0.0)
        assert outcome.completed and outcome.cuts == 1 and outcome.sessions == 2
        second = outcome.finished_at - (cut + 10.0)
        if policy == "none":
            assert second == pytest.approx(5.0 + alone, rel=1e-6)  # boot + everything again
        else:
            assert second < 5.0 + alone  # progress survived the cut
    # uninterrupted, the baselines that commit on the compute path are slower, the others not
    times = {p: RequestModel(spec, request, platform, p, geometry).uninterrupted().finished_at for p in POLICIES}
    none = RequestModel(spec, request, platform, "none", geometry).uninterrupted().finished_at
    assert times["sonic-layer"] > none and times["sonic-chunk"] > none
    assert times["orbitweaver"] == pytest.approx(none, rel=0.02)


def test_durable_state_keeps_only_commits_before_the_cut():
    spec = REAL_MODELS["qwen3-vl-2b"]
    request = frames_request(1, 1024, new_tokens=4)
    m = RequestModel(
        spec,
        request,
        target_platform(spec, request),
        "sonic-layer",
        Geometry(chunk=512, group=4, decode_every=4, vision_every=4),
    )
    res = m.uninterrupted()
    blocks = sorted((c.t, c.key) for c in res.commits if c.kind == "block")
    cut = blocks[5][0] + 1e-9
    d = res.durable_at(Durable(), cut)
    assert set(d.blocks) == {k for _, k in blocks[:6]} and d.vision_done and not d.done


def test_trace_windows_and_warnings():
    import traces

    windows, warns = trace_windows(traces.load("trace-b"))
    assert windows and all(a < b for a, b in windows)
    assert all(windows[i][1] <= windows[i + 1][0] for i in range(len(windows) - 1))
    assert warns and all(w < end for end, w in warns.items())
