"""GroundClient used in-process, as a testbench or demo drives it (no CLI)."""

from __future__ import annotations

import re
from dataclasses import FrozenInstanceError, replace

import pytest
from ground_test_peer import RESULT_TEXT

from common.wire import ResponseCode
from common.wire.link import Endpoints
from ground.client import GroundClient, GroundOptions
from ground.errors import CommandRejected, LocalInputError, NoAnswer


def test_client_api_uplinks_waits_and_downlinks(keys, peer, pictures):
    peer.task_run_s = 0.5
    notices: list[str] = []
    progress: list[tuple[str, int, int]] = []
    endpoints = Endpoints(commands=peer.commands_endpoint, telemetry=peer.telemetry_endpoint)
    with GroundClient(
        keys.root,
        GroundOptions(
            endpoints=endpoints,
            timeout_s=5,
            notify=notices.append,
            chunk_bytes=4096,
            upload_progress=lambda *report: progress.append(report),
        ),
    ) as ground:
        assert ground.ping() > 0
        up = ground.uplink([str(p) for p in pictures], "count the ships", max_new_tokens=8, priority=3)
        assert [i.verified for i in up.images] == [True, True] and up.images[0].chunks_sent == up.images[0].chunks
        # the upload's progress, as the console's page shows it: bytes on board, rising to the size
        for image in up.images:
            mine = [done for name, done, size in progress if name == image.name and size == image.size]
            assert mine == sorted(mine) and mine[-1] == image.size and len(mine) > 1, (image.name, mine)
        result = ground.result(up.task_id, wait=True, poll_s=10)
        assert result.text == RESULT_TEXT and result.interruptions == 1
        assert ground.tasks()[0]["state"] == "completed"
        with pytest.raises(CommandRejected) as rejected:
            ground.result("t-unknown")
        assert rejected.value.code == ResponseCode.UNKNOWN_TASK and rejected.value.exit_code == 3
        with pytest.raises(LocalInputError):
            ground.uplink([str(pictures[0])], "")
        peer.powered, peer.off_until = False, None
        ground.timeout_s = 0.5
        with pytest.raises(NoAnswer):
            ground.status()
    assert any("prefill 4/4" in n for n in notices)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("timeout_s", 0, "timeout_s must be a finite number > 0"),
        ("timeout_s", float("nan"), "timeout_s must be a finite number > 0"),
        ("handshake_timeout_s", -1.0, "handshake_timeout_s must be a finite number > 0"),
        ("retries", -1, "retries must be >= 0"),
        ("window", 0, "window must be >= 1"),
        ("chunk_bytes", 0, "chunk size 0 outside"),
        ("source_id", 256, "source id 256 outside 1..255"),
        ("station", "../x", "station name"),
    ],
)
def test_options_refuse_a_bad_value_once_made(field, value, says):
    """A value that cannot work is refused when the options are made (exit 5, as any local input),
    and again when an override is put in with dataclasses.replace (the console's per action);
    no client, key or socket is touched."""
    with pytest.raises(LocalInputError, match=re.escape(says)) as made:
        GroundOptions(**{field: value})
    assert made.value.exit_code == 5
    with pytest.raises(LocalInputError, match=re.escape(says)):
        replace(GroundOptions(), **{field: value})
    with pytest.raises(FrozenInstanceError):
        GroundOptions().timeout_s = 1.0  # type: ignore[misc]


def test_a_client_takes_its_options_as_given(keys):
    """Not a default where a setting was given: the parts read the options the client was made with."""
    options = GroundOptions(station="ground", timeout_s=2.5, retries=3, window=2, chunk_bytes=1024, origin="here")
    client = GroundClient(keys.root, options)
    assert (client.timeout_s, client.session.retries, client.session.window) == (2.5, 3, 2)
    assert (client.session.chunk_bytes, client.session.origin, client.session.options) == (1024, "here", options)
    assert GroundClient(keys.root).session.options == GroundOptions()
