"""The payload's image store across a cut between the last chunk and the assembled file."""

import io

import numpy as np
import pytest
from PIL import Image

from common.durable import DurableFS
from common.wire import messages as m
from flight.runtime.images import ImageStore


class PowerCut(Exception):
    pass


class CutBeforeImageCommit(DurableFS):
    """Power fails while the assembled file is being written (after every chunk is stored)."""

    def write_atomic(self, path, chunks):
        if str(path).endswith("/image"):
            raise PowerCut(path)
        return super().write_atomic(path, chunks)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wedged_store(tmp_path):
    content = _png()
    chunks = m.ImageChunk.split("scene.png", content, chunk_bytes=1024)
    store = ImageStore(str(tmp_path / "images"), CutBeforeImageCommit())
    for chunk in chunks[:-1]:
        assert store.put_chunk(chunk) is False
    with pytest.raises(PowerCut):
        store.put_chunk(chunks[-1])  # stored, then the cut while committing the file
    return content, chunks


def test_a_query_after_the_reboot_finishes_the_verification(tmp_path):
    content, chunks = _wedged_store(tmp_path)
    rebooted = ImageStore(str(tmp_path / "images"))
    status = rebooted.status("scene.png")
    assert status.verified and status.total == len(chunks)
    assert open(rebooted.image_path("scene.png"), "rb").read() == content


def test_a_resent_chunk_after_the_reboot_finishes_the_verification(tmp_path):
    content, chunks = _wedged_store(tmp_path)
    rebooted = ImageStore(str(tmp_path / "images"))
    assert rebooted.put_chunk(chunks[3]) is True
    assert rebooted.is_verified("scene.png")
    assert open(rebooted.image_path("scene.png"), "rb").read() == content
