"""Helpers shared by test folders (importable because pytest puts tests/ on sys.path)."""
from __future__ import annotations

import numpy as np

ARCHS = ["qwen3-vl", "qwen2.5-vl"]


def make_images(seed: int = 0):
    """Two small, different pictures (a noisy gradient and pure noise), deterministic."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, 128 * 96 * 3).reshape(96, 128, 3)
    first = (base + rng.normal(0, 30, base.shape)).clip(0, 255).astype(np.uint8)
    second = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    return [Image.fromarray(first), Image.fromarray(second)]
