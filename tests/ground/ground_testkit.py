"""Helpers for the ground tests (importable: pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.wire.link import KeyLayout


def write_picture(path: Path, *, seed: int = 0, size: tuple[int, int] = (96, 128)) -> Path:
    """A noisy RGB PNG (noise does not compress, so the file spans several chunks)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path


#: The CURVE handshake's deadline in the tests: a hang guard only. The handshake with a bus that
#: is there completes as soon as the machine gets to it; `--timeout` (often a second, to see a
#: silent payload stay silent) is the answer wait and no longer bounds the handshake.
HANDSHAKE_HANG_S = 120.0


def link_args(keys: KeyLayout, peer, timeout: float = 5.0) -> list[str]:
    return [
        "--keys",
        str(keys.root),
        "--commands-endpoint",
        peer.commands_endpoint,
        "--telemetry-endpoint",
        peer.telemetry_endpoint,
        "--timeout",
        str(timeout),
        "--handshake-timeout",
        str(HANDSHAKE_HANG_S),
    ]
