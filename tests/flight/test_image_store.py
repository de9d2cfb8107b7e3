"""The payload's image store across a cut between the last chunk and the assembled file."""

import io

import numpy as np
import pytest
from PIL import Image

from common.durable import DurableFS
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.ids import EventId
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
    assert not rebooted.status("scene.png").verified  # a status alone writes nothing
    assert rebooted.complete_held("scene.png") == len(content)
    status = rebooted.status("scene.png")
    assert status.verified and status.total == len(chunks)
    assert rebooted.complete_held("scene.png") is None  # verified once
    assert open(rebooted.image_path("scene.png"), "rb").read() == content


def test_a_resent_chunk_after_the_reboot_finishes_the_verification(tmp_path):
    content, chunks = _wedged_store(tmp_path)
    rebooted = ImageStore(str(tmp_path / "images"))
    assert rebooted.put_chunk(chunks[3]) is True
    assert rebooted.is_verified("scene.png")
    assert open(rebooted.image_path("scene.png"), "rb").read() == content


def test_a_query_that_finishes_the_verification_reports_it_as_a_chunk_would(tmp_path, model_dirs):
    """The ground learns from IMAGE_COMPLETE that an image is verified, whichever command finished
    it: a query after the reboot that finds every chunk held reports it once, the next none."""
    from common.wire import decode as decode_packet
    from flight.engine import EngineOptions
    from flight.runtime.app import FlightApp, FlightConfig

    app = FlightApp(
        FlightConfig(
            str(tmp_path / "data"), model_dirs["qwen3-vl"], str(tmp_path / "keys"), "tcp://127.0.0.1:1", EngineOptions()
        )
    )
    wedged = ImageStore(app.images.directory, CutBeforeImageCommit())
    content = _png()
    chunks = m.ImageChunk.split("scene.png", content, chunk_bytes=1024)
    for chunk in chunks[:-1]:
        wedged.put_chunk(chunk)
    with pytest.raises(PowerCut):
        wedged.put_chunk(chunks[-1])
    request = RequestRef(apid=1, source_id=1, seq=1, message_type=int(m.ImageQuery.TYPE))
    for _ in range(2):
        app.commands.on_image_query(request, m.ImageQuery(image="scene.png"))
    sent = []  # every packet the handlers and their events queued for the bus, as the bus gets it
    while not app.outbox.empty():
        packet, _ = app.outbox.get_nowait()
        sent.append(decode_packet(packet)[1])
    complete = [x for x in sent if isinstance(x, m.Event) and x.event_id == EventId.IMAGE_COMPLETE]
    assert [x.text for x in complete] == [f"image scene.png verified ({len(content)} bytes)"]
    statuses = [x for x in sent if isinstance(x, m.ImageStatus)]
    assert len(statuses) == 2 and all(s.verified for s in statuses)
