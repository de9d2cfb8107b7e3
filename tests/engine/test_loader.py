"""Lazily loaded weights are bitwise what from_pretrained gives; legacy checkpoints load too."""

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from testkit import ARCHS

from flight.model.loader import load_model


def _all_tensors(model):
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_lazy_weights_equal_from_pretrained(model_dirs, arch):
    m = load_model(model_dirs[arch], device="cpu")
    assert not any(p.device.type != "meta" for p in m.model.parameters())  # nothing read yet
    m.weights.ensure(*m.adapter.all_vision_modules(), *m.adapter.all_lm_modules())
    ref = transformers.AutoModelForImageTextToText.from_pretrained(model_dirs[arch])
    ours, theirs = _all_tensors(m.model), _all_tensors(ref)
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert m.weights.stats.bytes_read == sum(p.numel() * p.element_size() for p in ref.parameters())


def test_legacy_key_layout_loads(model_dirs, tmp_path):
    """Older Qwen2.5-VL checkpoints keep the LM under `model.` and the tower under `visual.`."""
    src = model_dirs["qwen2.5-vl"]
    dst = tmp_path / "legacy"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        if k.startswith("model.visual."):
            k = k.replace("model.visual.", "visual.", 1)
        elif k.startswith("model.language_model."):
            k = k.replace("model.language_model.", "model.", 1)
        renamed[k] = v
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    a = load_model(src, device="cpu")
    b = load_model(str(dst), device="cpu")
    for m in (a, b):
        m.weights.ensure(*m.adapter.all_vision_modules(), *m.adapter.all_lm_modules())
    ta, tb = _all_tensors(a.model), _all_tensors(b.model)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_content_hash_changes_with_weights(model_dirs, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(model_dirs["qwen3-vl"], dst)
    h1 = load_model(str(dst), device="cpu").content_hash
    tensors = load_file(str(dst / "model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert load_model(str(dst), device="cpu").content_hash != h1


def test_missing_weights_are_refused(model_dirs, tmp_path):
    from flight.model.loader import ModelError

    dst = tmp_path / "broken"
    shutil.copytree(model_dirs["qwen3-vl"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop(sorted(k for k in tensors if ".layers.2." in k)[0])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="missing"):
        load_model(str(dst), device="cpu")
