"""Fixtures shared by every test folder: tiny models built once per test worker, sample images."""

from __future__ import annotations

import os

import pytest
from testkit import ARCHS, make_images


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    from flight.model.tiny import build_tiny

    root = tmp_path_factory.mktemp("models")
    os.environ.setdefault("OW_CACHE_DIR", str(root / "cache"))
    return {arch: build_tiny(arch, "tiny", 0, str(root / arch))["path"] for arch in ARCHS}


@pytest.fixture(scope="session")
def image_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    paths = []
    for i, im in enumerate(make_images()):
        p = root / f"img{i}.png"
        im.save(p)
        paths.append(str(p))
    return paths
