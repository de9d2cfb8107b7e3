"""The two-stage model: real torch modules, batched tensors in, action chunks out."""

import dataclasses

import numpy as np
import pytest
import torch

from common.vla.config import ARCHS, MODELS, PI0
from common.vla.models import VlaPolicy, example_observation, tokenize


@pytest.fixture(scope="module")
def policies():
    return {a: VlaPolicy(MODELS[a]) for a in ARCHS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_action_chunk_shape_and_public_shapes(policies, arch):
    p = policies[arch]
    actions = p.infer(example_observation(3))
    assert actions.shape == (p.cfg.action_horizon, p.cfg.output_action_dim) == (50, 7)
    assert np.isfinite(actions).all()
    assert p.cfg.image_size == 224 and p.cfg.denoise_steps == 10


def test_pi0_prefix_has_256_tokens_per_camera_and_three_slots():
    assert PI0.tokens_per_image == 256 and PI0.cameras == 3
    assert PI0.prefix_tokens == 3 * 256 + 48


@pytest.mark.parametrize("arch", list(ARCHS))
def test_padded_fixed_batches_do_not_change_a_request(policies, arch):
    p = policies[arch]
    inputs = [p.prepare(example_observation(i)) for i in range(3)]
    alone = [p.run_adit(p.run_vlm([x], 1), [x], 1)[0] for x in inputs]
    batched = p.run_adit(p.run_vlm(inputs, 4), inputs, 4)  # 3 real rows + 1 pad row
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_noise_seed_and_prompt_change_the_chunk(policies):
    p = policies["pi0"]
    base = example_observation(1)
    other_seed = dataclasses.replace(base, noise_seed=99)
    other_prompt = dataclasses.replace(base, prompt="open the drawer")
    a = p.infer(base)
    assert np.array_equal(a, p.infer(base))  # deterministic
    assert not np.allclose(a, p.infer(other_seed))
    assert not np.allclose(a, p.infer(other_prompt))


def test_variants_share_shapes_but_not_weights():
    a, b = VlaPolicy(MODELS["pi0"]), VlaPolicy(MODELS["pi0-ft1"])
    wa, wb = a.adit.action_out.weight, b.adit.action_out.weight
    assert wa.shape == wb.shape and not torch.equal(wa, wb)
    assert torch.equal(wa, VlaPolicy(MODELS["pi0"]).adit.action_out.weight)  # rebuilt bitwise from the seed


def test_arch_outside_the_vla_class_is_refused():
    with pytest.raises(ValueError):
        dataclasses.replace(PI0, denoise_steps=20)
    with pytest.raises(ValueError):
        dataclasses.replace(PI0, patch_size=13)


def test_tokenizer_truncates_and_masks():
    tokens, mask = tokenize("x" * 100, 8)
    assert tokens.shape == (8,) and mask.all()
    tokens, mask = tokenize("ab", 8)
    assert mask.sum() == 3 and tokens[3] == 0
