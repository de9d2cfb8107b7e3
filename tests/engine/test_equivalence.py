"""Block-wise execution equals transformers' generate(): same tokens, bitwise logits."""

import pytest
import torch
from testkit import ARCHS, MAX_NEW, engine, inputs_for, reference

from flight.checkpoint.policies import Geometry
from flight.model.loader import load_model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["orbitweaver", "none", "sonic-layer", "sonic-chunk", "hcache"])
def test_unchunked_equals_generate_bitwise(model_dirs, tmp_path, arch, policy):
    model = load_model(model_dirs[arch], device="cpu")
    inputs = inputs_for(model)
    assert inputs.image_grid_thw.shape[0] == 2 and inputs.num_visual_tokens > 8
    ref_tokens, ref_logits = reference(model_dirs[arch], inputs, MAX_NEW, chunk=None)
    geometry = Geometry(chunk=4096, group=2, decode_every=3, vision_every=2)  # one chunk covers the prompt
    result = engine(model, geometry, policy, async_writes=True).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    assert result.token_ids == ref_tokens
    assert torch.equal(result.logits[0], ref_logits[-1])
    assert result.resumed is False


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk,group", [(16, 2), (7, 1), (24, 3)])
def test_chunked_equals_generate_with_prefill_chunks(model_dirs, tmp_path, arch, chunk, group):
    model = load_model(model_dirs[arch], device="cpu")
    inputs = inputs_for(model)
    assert inputs.num_tokens > 2 * chunk
    ref_tokens, ref_logits = reference(model_dirs[arch], inputs, MAX_NEW, chunk=chunk)
    geometry = Geometry(chunk=chunk, group=group, decode_every=2, vision_every=1)
    result = engine(model, geometry, async_writes=True).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    assert result.token_ids == ref_tokens
    assert torch.equal(result.logits[0], ref_logits[-1])


@pytest.mark.parametrize("planner", ["chunk-first", "layer-first"])
def test_result_is_stored_and_returned_again(model_dirs, tmp_path, planner):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    first = engine(model, planner=planner).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    # garbage collection after completion: only MANIFEST and RESULT remain
    remaining = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_file())
    assert remaining == ["MANIFEST", "RESULT"]
    assert not any((tmp_path / "ck" / "prefill").iterdir())
    again = engine(load_model(model_dirs["qwen3-vl"], device="cpu")).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    assert again.resumed_from["phase"] == "done"
    assert again.token_ids == first.token_ids and torch.equal(again.logits, first.logits)
    # the second run is a restart that found the RESULT: its entry is the one record it adds
    assert [(e["phase"], e["planner"]) for e in again.recoveries] == [("done", "none")]
    remaining = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_file())
    assert remaining == ["MANIFEST", "RESULT", "recoveries.log"]


def test_text_only_request(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model, images=[])
    ref_tokens, ref_logits = reference(model_dirs["qwen3-vl"], inputs, 6, chunk=None)
    result = engine(model, Geometry(chunk=4096, group=2, decode_every=2)).run(inputs, str(tmp_path / "ck"), 6)
    assert result.token_ids == ref_tokens and torch.equal(result.logits[0], ref_logits[-1])
