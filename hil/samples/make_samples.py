"""Procedural Earth-observation-like sample scenes for the demo (deterministic).

Regenerate from the repository root: .venv/bin/python hil/samples/make_samples.py
"""

import numpy as np
from PIL import Image, ImageFilter


def fractal(rng, n, octaves=5):
    out = np.zeros((n, n))
    for o in range(octaves):
        k = 2 ** (o + 2)
        small = rng.random((k, k))
        out += np.array(Image.fromarray((small * 255).astype(np.uint8)).resize((n, n), Image.BICUBIC)) / 255 / 2**o
    return out / out.max()


def scene(kind, seed, n=160):
    rng = np.random.default_rng(seed)
    h = fractal(rng, n)
    img = np.zeros((n, n, 3))
    sea = np.array([20, 60, 120])
    land = np.array([70, 110, 50])
    sand = np.array([200, 190, 140])
    if kind in ("coast", "harbor"):
        x = np.linspace(0, 1, n)[None, :] + 0.25 * (h - 0.5)
        img[:] = np.where(x[..., None] < 0.45, sea, land)
        img[(x > 0.43) & (x < 0.47)] = sand
        if kind == "harbor":
            for _ in range(7):
                r, c = rng.integers(20, n - 20), rng.integers(10, int(n * 0.35))
                img[r : r + 3, c : c + 9] = [230, 230, 225]
            img[70:76, int(n * 0.3) : int(n * 0.5)] = [120, 120, 120]  # pier
    elif kind == "fields":
        for r in range(0, n, 32):
            for c in range(0, n, 40):
                img[r : r + 32, c : c + 40] = rng.choice([[90, 140, 60], [160, 150, 70], [60, 100, 40], [130, 110, 80]])
        img[:, 78:82] = [90, 90, 90]  # road
    elif kind == "clouds":
        img[:] = land * (0.7 + 0.3 * h[..., None])
        cloud = fractal(rng, n, 4)
        mask = np.clip((cloud - 0.55) * 4, 0, 1)[..., None]
        img = img * (1 - mask) + 245 * mask
    img = img * (0.9 + 0.2 * h[..., None])
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).filter(ImageFilter.SMOOTH)


for i, kind in enumerate(["coast", "harbor", "fields", "clouds"]):
    scene(kind, 100 + i).save(f"hil/samples/{kind}.png", optimize=True)
