"""A task's stored inputs (TASK_INPUTS + TASK_PIXELS, flight/model/inputs.py): a restart reads
the token ids and the grid; the pixel patches only when its vision phase starts from them."""

import pytest
import torch
from testkit import MAX_NEW, CutAfter, engine, inputs_for

from common.durable import DurableFS
from common.record import Kind, encode
from flight.engine import SimulatedCut
from flight.model.inputs import (
    PixelsUnavailable,
    RequestInputs,
    load_inputs,
    save_inputs,
    task_inputs_parts,
)
from flight.model.loader import load_model

KEY = {"task": "t" * 64, "model": "m" * 64, "processors": "p" * 64}


class CountingFS(DurableFS):
    def __init__(self):
        self.reads = []

    def read(self, path):
        self.reads.append(path.rsplit("/", 1)[-1])
        return super().read(path)


@pytest.fixture(scope="module")
def model(model_dirs):
    return load_model(model_dirs["qwen3-vl"], device="cpu")


def test_stored_inputs_read_their_pixels_only_when_asked(model, tmp_path):
    inputs = inputs_for(model)
    path = str(tmp_path / "inputs.rec")
    save_inputs(DurableFS(), path, inputs, KEY)
    fs = CountingFS()
    loaded, why = load_inputs(fs, path, KEY)
    assert why is None and fs.reads == ["inputs.rec"] and not loaded.pixels_loaded
    assert loaded.digest() == inputs.digest() and fs.reads == ["inputs.rec"]  # the MANIFEST's check: no pixels
    assert torch.equal(loaded.input_ids, inputs.input_ids) and torch.equal(loaded.image_grid_thw, inputs.image_grid_thw)
    assert torch.equal(loaded.pixel_values, inputs.pixel_values) and fs.reads == ["inputs.rec", "pixels.rec"]
    assert loaded.num_visual_tokens == inputs.num_visual_tokens


def test_damaged_pixels_are_built_again_and_never_used_if_they_differ(model, tmp_path):
    inputs = inputs_for(model)
    path = str(tmp_path / "inputs.rec")
    save_inputs(DurableFS(), path, inputs, KEY)
    pixels = tmp_path / "pixels.rec"
    data = bytearray(pixels.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip in the patches: the record's CRC fails
    pixels.write_bytes(bytes(data))
    asked = []

    def rebuild(reason):
        asked.append(reason)
        return inputs.pixel_values.clone()

    loaded, _ = load_inputs(DurableFS(), path, KEY, rebuild_pixels=rebuild)
    assert torch.equal(loaded.pixel_values, inputs.pixel_values) and len(asked) == 1
    other, _ = load_inputs(DurableFS(), path, KEY, rebuild_pixels=lambda reason: inputs.pixel_values + 1)
    with pytest.raises(PixelsUnavailable, match="rebuilt_pixels_differ"):
        _ = other.pixel_values
    none, _ = load_inputs(DurableFS(), path, KEY)  # nobody to build them: the reason, never bad pixels
    pixels.unlink()
    with pytest.raises(PixelsUnavailable, match="missing"):
        _ = none.pixel_values


def test_a_record_of_the_earlier_layout_still_loads(model, tmp_path):
    """A payload updated in orbit finds tasks stored before the split: one record, pixels inside."""
    inputs = inputs_for(model)
    meta, tensors = task_inputs_parts(
        inputs.prompt, inputs.digest(), KEY, inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw, "x"
    )
    del meta["pixels_digest"]
    tensors["pixel_values"] = inputs.pixel_values
    path = str(tmp_path / "inputs.rec")
    DurableFS().write_atomic(path, encode(Kind.TASK_INPUTS, meta, tensors).chunks)
    loaded, why = load_inputs(DurableFS(), path, KEY)
    assert why is None and loaded.pixels_loaded and loaded.digest() == inputs.digest()


def test_a_restart_past_the_vision_phase_never_reads_the_pixels(model, tmp_path):
    """Cut in prefill, resumed with inputs whose pixels cannot be had: bitwise the same answer."""
    inputs = inputs_for(model)
    ref = engine(model, cadence="fixed").run(inputs, str(tmp_path / "ref"), MAX_NEW)
    ckpt = str(tmp_path / "ckpt")
    vision_blocks = model.adapter.num_vision_blocks
    with pytest.raises(SimulatedCut):
        engine(model, cadence="fixed", events=CutAfter(vision_blocks + 2).event).run(inputs, ckpt, MAX_NEW)

    def no_pixels():
        raise AssertionError("a restart past the vision phase read the pixels")

    stored = RequestInputs(
        inputs.input_ids,
        inputs.mm_token_type_ids,
        None,
        inputs.image_grid_thw,
        inputs.prompt,
        load_pixels=no_pixels,
        digest=inputs.digest(),
    )
    resumed = engine(model, cadence="fixed").run(stored, ckpt, MAX_NEW)
    assert resumed.resumed_from["phase"] == "prefill" and not stored.pixels_loaded
    assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits)
