"""A MANIFEST mismatch restarts the request from scratch with an event; never a silent mix."""

import pytest
import torch
from testkit import GEOMETRY, MAX_NEW, CutAfter, engine, inputs_for

from flight.checkpoint.policies import Geometry
from flight.engine import SimulatedCut
from flight.model.loader import load_model


def _partial(model_dirs, inputs, ckpt, geometry=GEOMETRY):
    with pytest.raises(SimulatedCut):
        engine(load_model(model_dirs["qwen3-vl"], device="cpu"), geometry, events=CutAfter(12).event).run(
            inputs, ckpt, MAX_NEW
        )


@pytest.mark.parametrize("change", ["chunk", "threads", "prompt", "max_new_tokens"])
def test_mismatch_restarts_from_scratch(model_dirs, tmp_path, change):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ckpt = str(tmp_path / "ck")
    _partial(model_dirs, inputs, ckpt)
    geometry, max_new, threads = GEOMETRY, MAX_NEW, torch.get_num_threads()
    if change == "chunk":
        geometry = Geometry(chunk=24, group=2, decode_every=2, vision_every=1)
    elif change == "prompt":
        inputs = inputs_for(model, prompt="list the ships")
    elif change == "max_new_tokens":
        max_new = MAX_NEW + 2
    elif change == "threads":
        threads = threads + 1
    events = []
    try:
        result = engine(
            load_model(model_dirs["qwen3-vl"], device="cpu"),
            geometry,
            threads=threads,
            events=lambda n, **kw: events.append((n, kw)),
        ).run(inputs, ckpt, max_new)
        fresh = engine(load_model(model_dirs["qwen3-vl"], device="cpu"), geometry, threads=threads).run(
            inputs, str(tmp_path / "fresh"), max_new
        )
    finally:
        torch.set_num_threads(max(1, threads - 1) if change == "threads" else threads)
    mismatch = [kw for n, kw in events if n == "manifest_mismatch"]
    assert mismatch, events
    expected_key = {
        "chunk": "chunk",
        "threads": "threads",
        "prompt": "inputs_hash",
        "max_new_tokens": "max_new_tokens",
    }[change]
    assert expected_key in mismatch[0]["differences"]
    assert result.restarted_reason == "mismatch" and result.resumed is False
    assert result.token_ids == fresh.token_ids and torch.equal(result.logits, fresh.logits)
