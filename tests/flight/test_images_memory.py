"""Image memory is bounded by the model's input, not by the upload (finding 6: a 25 KB PNG of
10000 x 9999 pixels cost 1.3 GB; eight in one task took the payload to 6.5 GB), and what the
image processor cannot take is refused at uplink (finding 9)."""

from __future__ import annotations

import io
import math
import os
import signal

import numpy as np
import pytest
from PIL import Image
from testkit import HANG_S

from common.imagecheck import ImageRejected, ProcessorLimits, open_reduced, target_size
from common.wire import ResponseCode
from common.wire import messages as m
from common.wire.ids import MAX_DECODE_BYTES

#: The bound docs/flight.md states: peak RSS of a task with eight maximal uploads, above the
#: payload's RSS before it, at most one decode budget plus this.
HEADROOM_BYTES = 192 << 20


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    """A picture of the given size that compresses to almost nothing (a few flat bands)."""
    im = Image.new(mode, (width, height))
    band = max(1, height // 4)
    for i in range(4):
        colour = (60 * i, 255 - 50 * i, 40 + 30 * i) if mode == "RGB" else 50 * i
        im.paste(colour, (0, i * band, width, min(height, (i + 1) * band)))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=6)
    return buf.getvalue()


def test_target_size_is_the_processors_own_rule():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(0)
    limits = ProcessorLimits(32, 4096, 16384)
    shapes = [(1, 1), (300, 1), (201, 1), (200, 1), (1, 200), (32, 32), (160, 160), (10000, 9999)]
    shapes += [tuple(int(x) for x in rng.integers(1, 6000, 2)) for _ in range(300)]
    for width, height in shapes:
        try:
            expected = smart_resize(height, width, factor=32, min_pixels=4096, max_pixels=16384)[::-1]
        except ValueError:
            with pytest.raises(ImageRejected) as info:
                target_size(width, height, limits)
            assert info.value.code == ResponseCode.IMAGE_SHAPE_UNSUPPORTED
            continue
        assert target_size(width, height, limits) == expected, (width, height)


def test_header_checks_before_any_decode():
    limits = ProcessorLimits(32, 4096, 16384)
    with pytest.raises(ImageRejected) as info:
        open_reduced(_png(300, 1), "thin.png", limits)  # finding 9: failed later on aspect ratio
    assert info.value.code == ResponseCode.IMAGE_SHAPE_UNSUPPORTED
    side = int(math.sqrt(MAX_DECODE_BYTES / 4)) + 64
    with pytest.raises(ImageRejected) as info:
        open_reduced(_png(side, side), "big.png", limits)  # over the decode budget as RGB
    assert info.value.code == ResponseCode.IMAGE_TOO_LARGE
    # the finding's picture: 10000 x 9999 grey, taken, and decoded no larger than needed
    picture = open_reduced(_png(10000, 9999, "L"), "grey.png", limits)
    assert picture.mode == "RGB" and picture.width < 2 * 128 + 32 and picture.height < 2 * 128 + 32
    buf = io.BytesIO()
    Image.new("RGB", (8000, 6000), (10, 20, 30)).save(buf, "JPEG")
    # 192 MB to decode at full size, over the budget: taken because the JPEG decoder decodes it at 1/8
    picture = open_reduced(buf.getvalue(), "big.jpg", limits)
    assert picture.width < 2 * 148 and picture.height < 2 * 111


def _rss_peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


@pytest.mark.slow
def test_eight_maximal_uploads_stay_within_one_decode_budget(tmp_path, model_dirs):
    """Eight pictures at the payload's decode budget (RGB, 41.6 megapixels each, ~100 KB files)
    in one task: the payload's peak RSS grows by at most one decode budget plus headroom."""
    from hil.scripted_bus import BusPeer, spawn_flight

    bus = BusPeer(str(tmp_path / "keys"))
    proc = spawn_flight(
        tmp_path / "data", model_dirs["qwen3-vl"], tmp_path / "keys", bus.endpoint, log_path=tmp_path / "flight.log"
    )
    try:
        bus.wait_connected(timeout=600)

        def upload(name: str, content: bytes) -> None:
            for chunk in m.ImageChunk.split(name, content, chunk_bytes=60 * 1024):
                seq = bus.command(chunk)
                reply = bus.wait_for(
                    lambda h, x, seq=seq: isinstance(x, (m.Accepted, m.Rejected)) and x.tc_seq == seq, timeout=HANG_S
                )[1]
                assert isinstance(reply, m.Accepted), reply

        def run_task(task_id: str, images: list[str]) -> None:
            seq = bus.command(
                m.UplinkTask(task_id=task_id, prompt="describe the scenes", images=images, max_new_tokens=2, priority=0)
            )
            done = bus.wait_for(
                lambda h, x: isinstance(x, (m.Completed, m.Failed)) and x.task_id == task_id and x.tc_seq == seq,
                timeout=600,
            )[1]
            assert isinstance(done, m.Completed), done

        # One small task first: the model is then loaded and has run (the worker loads it in the
        # background, in seconds or minutes depending on the machine), so what grows after it is
        # the images' doing alone.
        upload("warm.png", _png(256, 256))
        run_task("warm", ["warm.png"])
        _reset_peak(proc.pid)
        before = _rss_peak(proc.pid)
        names = []
        content = _png(6400, 6500)  # 41.6 MP x 4 B in PIL: just under the 160 MiB budget
        for i in range(8):
            names.append(f"max{i}.png")
            upload(names[-1], content)
        run_task("eight", names)
        grown = _rss_peak(proc.pid) - before
        print(
            f"peak RSS growth for eight maximal uploads: {grown / 2**20:.0f} MiB "
            f"(bound {(MAX_DECODE_BYTES + HEADROOM_BYTES) / 2**20:.0f} MiB)"
        )
        assert grown <= MAX_DECODE_BYTES + HEADROOM_BYTES
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        bus.close()
