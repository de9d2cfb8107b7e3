"""int8 decode-KV compression: smaller decode records, a resume that still completes, an answer
that is close to (not necessarily bitwise) the uninterrupted one; off by default."""

import os

import pytest
import torch
from testkit import CutAfter, engine, inputs_for, run_to_completion

from flight.checkpoint.policies import Geometry
from flight.engine import SimulatedCut
from flight.model.loader import load_model

MAX_NEW = 20
GEOMETRY = Geometry(chunk=16, group=2, decode_every=8, vision_every=1)


def test_int8_decode_records_are_smaller_and_resume(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ref = engine(model, GEOMETRY).run(inputs, str(tmp_path / "ref"), MAX_NEW)
    sizes = {}
    for mode in ("none", "int8"):
        ckpt = str(tmp_path / mode)
        cut = CutAfter(4 + 8 + MAX_NEW - 2, names=CutAfter.UNITS)  # late in decode
        with pytest.raises(SimulatedCut):
            engine(
                load_model(model_dirs["qwen3-vl"], device="cpu"), GEOMETRY, events=cut.event, decode_kv_compression=mode
            ).run(inputs, ckpt, MAX_NEW)
        sizes[mode] = os.path.getsize(os.path.join(ckpt, "decode.log"))
        resumed = run_to_completion(model_dirs["qwen3-vl"], inputs, ckpt, MAX_NEW, GEOMETRY, decode_kv_compression=mode)
        assert resumed.resumed_from["phase"] == "decode"
        assert len(resumed.token_ids) == len(ref.token_ids)
        if mode == "none":
            assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits)
        else:
            # close, not bitwise: the restored KV is quantised
            assert (resumed.logits - ref.logits).abs().max() < 0.5
    assert sizes["int8"] < 0.6 * sizes["none"]


def test_compression_is_pinned_in_the_manifest(model_dirs, tmp_path):
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    e1, e2 = engine(model), engine(model, decode_kv_compression="int8")
    diff = {k for k in e1.manifest(inputs, 4) if e1.manifest(inputs, 4)[k] != e2.manifest(inputs, 4)[k]}
    assert diff == {"decode_kv_compression"}
