"""`ow ground uplink` against the scripted test peer: chunked upload with verification, only
missing chunks sent, resume after a payload power cut, a lost link and a bus restart, no
duplicated task, and the payload's rejections reported with their code (exit 3)."""

from __future__ import annotations

import json

import pytest
from ground_test_peer import ScriptedBusPayloadPeer
from ground_testkit import link_args

from common.wire import MessageType, ResponseCode
from common.wire import messages as m
from ground.images import prepare_image
from ground.state import GroundState

CHUNK = 2048  # small chunks: the test pictures span ~19 of them


def uplink(ow, keys, peer, *extra, timeout=5.0):
    return ow("ground", "uplink", *link_args(keys, peer, timeout), "--chunk-bytes", CHUNK, *extra)


def test_uplink_sends_every_chunk_once_and_the_payload_verifies_the_files(ow, keys, peer, pictures):
    result = uplink(
        ow, keys, peer, "--image", pictures[0], "--image", pictures[1], "--prompt", "count the ships", "--json"
    )
    assert result.code == 0, result.err
    report = json.loads(result.out)
    task_id = report["task_id"]
    for path in pictures:
        image = prepare_image(str(path))
        held = peer.images[image.name]
        assert held["verified"] and held["content"] == path.read_bytes()
        assert sorted(i for (name, i) in peer.chunk_receipts if name == image.name) == list(range(held["total"]))
        assert all(n == 1 for (name, _), n in peer.chunk_receipts.items() if name == image.name)
    task = peer.tasks[task_id]["message"]
    assert task.prompt == "count the ships" and list(task.images) == [prepare_image(str(p)).name for p in pictures]
    assert [i["verified"] for i in report["images"]] == [True, True]
    assert GroundState(keys.state_dir).task(task_id)["state"] == "accepted"


def test_names_on_board_come_from_content_not_from_the_path(keys, tmp_path, pictures):
    odd = tmp_path / "..hidden  name;rm -rf.png"
    odd.write_bytes(pictures[0].read_bytes())
    a, b = prepare_image(str(pictures[0])), prepare_image(str(odd))
    assert a.sha256 == b.sha256 and a.name.split("-")[-1] == b.name.split("-")[-1]
    assert b.name.startswith("hidden_name_rm_-rf-") and "/" not in b.name and ".." not in b.name


def test_only_chunks_the_payload_lacks_are_sent(ow, keys, peer, pictures):
    image = prepare_image(str(pictures[0]))
    chunks = image.chunks(CHUNK)
    already = {0, 3, 4, 7, len(chunks) - 1}
    peer.images[image.name] = {
        "size": image.size,
        "total": len(chunks),
        "sha256": image.sha256,
        "verified": False,
        "chunks": {i: chunks[i].data for i in already},
    }
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p", "--json")
    assert result.code == 0, result.err
    assert not any(peer.chunk_receipts[(image.name, i)] for i in already)
    assert all(peer.chunk_receipts[(image.name, i)] == 1 for i in range(len(chunks)) if i not in already)
    assert json.loads(result.out)["images"][0]["held_before"] == len(already)
    assert peer.images[image.name]["verified"]


def test_running_the_same_uplink_again_sends_no_chunk_and_queues_no_second_task(ow, keys, peer, pictures):
    args = ("--image", pictures[0], "--image", pictures[1], "--prompt", "describe the coast", "--priority", "7")
    first = uplink(ow, keys, peer, *args)
    assert first.code == 0, first.err
    chunks_before = len(peer.commands_of(MessageType.IMAGE_CHUNK))
    second = uplink(ow, keys, peer, *args)
    assert second.code == 0, second.err
    assert second.out == first.out  # the same task id
    assert len(peer.commands_of(MessageType.IMAGE_CHUNK)) == chunks_before
    assert len(peer.commands_of(MessageType.UPLINK_TASK)) == 2  # the second one acknowledged idempotently
    assert list(peer.tasks) == [first.out.strip()]
    # An explicit request for a second run of the same query gets a new task.
    third = uplink(ow, keys, peer, *args, "--new-task")
    assert third.code == 0 and third.out != first.out and len(peer.tasks) == 2


def _assert_resumed_without_duplicates(result, peer, pictures, task_count=1):
    assert result.code == 0, result.err
    image = prepare_image(str(pictures[0]))
    held = peer.images[image.name]
    assert held["verified"] and held["content"] == pictures[0].read_bytes()
    # The fault really struck mid-upload ...
    assert 0 < len(peer.stored_before_cut) < held["total"]
    # ... and no chunk the payload held at that moment was sent again.
    assert all(peer.chunk_receipts[key] == 1 for key in peer.stored_before_cut)
    assert len(peer.tasks) == task_count and result.out.strip() in peer.tasks
    assert "re-querying to resume" in result.err


def test_payload_power_cut_mid_uplink_resumes_and_duplicates_nothing(ow, keys, peer, pictures):
    # Off until the ground has noticed and re-queried (its timeout ran out, however late).
    peer.cut_after_chunks, peer.off_s, peer.store_while_off = 6, 1.0, True
    peer.wake_after = (MessageType.IMAGE_QUERY, 1)
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p", "--window", "4", timeout=1.0)
    _assert_resumed_without_duplicates(result, peer, pictures)
    assert peer.cuts == 1 and peer.boot_count == 2


def test_lost_link_mid_uplink_resumes_by_re_querying(ow, keys, peer, pictures):
    # While "off", everything the ground sends is lost (no store-and-forward): only a re-query
    # after the timeout can bring the upload back.
    peer.cut_after_chunks, peer.off_s, peer.store_while_off = 5, 1.2, False
    peer.wake_after = (MessageType.IMAGE_QUERY, 1)  # back once a re-query was lost: the next one is heard
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p", "--window", "4", timeout=1.0)
    _assert_resumed_without_duplicates(result, peer, pictures)
    assert len(peer.commands_of(MessageType.IMAGE_QUERY)) >= 2


def test_bus_restart_mid_uplink_resumes_and_duplicates_nothing(ow, keys, peer, pictures):
    peer.restart_bus_on_chunk = 7
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p", "--window", "4", timeout=1.0)
    _assert_resumed_without_duplicates(result, peer, pictures)
    assert peer.bus_restarts == 1


def test_uplink_works_when_answers_arrive_only_on_the_telemetry_link(ow, keys, pictures):
    with ScriptedBusPayloadPeer(keys, route_replies=False) as peer:
        result = uplink(ow, keys, peer, "--image", pictures[1], "--prompt", "p")
        assert result.code == 0, result.err
        assert list(peer.tasks) == [result.out.strip()]


@pytest.mark.parametrize(
    "message_type, code, reason, what",
    [
        (MessageType.UPLINK_TASK, ResponseCode.QUEUE_FULL, "8 tasks queued", "task"),
        (MessageType.IMAGE_CHUNK, ResponseCode.STORAGE_FULL, "no space left on the payload disk", "chunk"),
        (MessageType.IMAGE_QUERY, ResponseCode.BUSY, "payload busy", "IMAGE_QUERY"),
    ],
)
def test_payload_rejection_exits_3_with_code_name_and_reason(
    ow, keys, peer, pictures, message_type, code, reason, what
):
    peer.reject_next[message_type] = (code, reason)
    result = uplink(ow, keys, peer, "--image", pictures[1], "--prompt", "p")
    assert result.code == 3
    lines = result.err.strip().splitlines()
    assert lines[-1].startswith("ow ground: error:")
    assert what in lines[-1] and f"{code.name} ({int(code)})" in lines[-1] and reason in lines[-1]
    assert "Traceback" not in result.err
    if message_type == MessageType.UPLINK_TASK:
        assert peer.tasks == {}
        [task] = GroundState(keys.state_dir).tasks()
        assert task["state"] == "rejected" and task["code"] == "QUEUE_FULL"


def test_a_task_id_taken_on_board_by_other_content_is_rejected_as_duplicate(ow, keys, peer, pictures, tmp_path):
    first = uplink(ow, keys, peer, "--image", pictures[1], "--prompt", "first", "--task-id", "obs-1")
    assert first.code == 0 and first.out.strip() == "obs-1"
    # Known locally: refused before sending.
    sent = len(peer.commands)
    local = uplink(ow, keys, peer, "--image", pictures[1], "--prompt", "second", "--task-id", "obs-1")
    assert local.code == 5 and "already uplinked with other content" in local.err and len(peer.commands) == sent
    # Unknown locally (another station's state): the payload rejects it.
    other = uplink(
        ow,
        keys,
        peer,
        "--image",
        pictures[1],
        "--prompt",
        "second",
        "--task-id",
        "obs-1",
        "--state-dir",
        tmp_path / "other-state",
    )
    assert other.code == 3 and "DUPLICATE_TASK" in other.err
    assert peer.tasks["obs-1"]["message"].prompt == "first"


def test_uplink_task_is_resent_until_accepted_without_queueing_twice(ow, keys, peer, pictures):
    # The payload loses power just as the UPLINK_TASK arrives: it waits at the bus, the ground
    # sends it again, and both copies reach the payload at power-up: still one task.
    peer.cut_before, peer.off_s, peer.store_while_off = MessageType.UPLINK_TASK, 1.0, True
    peer.wake_after = (MessageType.UPLINK_TASK, 1)  # back once the ground has sent it again
    result = uplink(ow, keys, peer, "--image", pictures[1], "--prompt", "p", timeout=1.0)
    assert result.code == 0, result.err
    assert len(peer.commands_of(MessageType.UPLINK_TASK)) >= 2
    assert list(peer.tasks) == [result.out.strip()]
    recorded = GroundState(keys.state_dir).task(result.out.strip())
    assert len(recorded["requests"]) >= 2 and recorded["state"] == "accepted"


def test_progress_bar_reports_bytes_on_stderr(ow, keys, peer, pictures):
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p", "--progress")
    assert result.code == 0, result.err
    assert prepare_image(str(pictures[0])).name in result.err and "B/s" in result.err


def test_uplink_task_carries_operator_values(ow, keys, peer, pictures):
    result = uplink(
        ow,
        keys,
        peer,
        "--image",
        pictures[1],
        "--prompt",
        "fleet count ⛵",
        "--max-new-tokens",
        "17",
        "--priority",
        "200",
        "--task-id",
        "pass-42.a",
    )
    assert result.code == 0, result.err
    message: m.UplinkTask = peer.tasks["pass-42.a"]["message"]
    assert (message.prompt, message.max_new_tokens, message.priority) == ("fleet count ⛵", 17, 200)


def test_chunks_held_from_an_uplink_with_another_chunk_size_still_count(ow, keys, peer, pictures):
    image = prepare_image(str(pictures[0]))
    earlier = image.chunks(4096)  # an interrupted earlier uplink used --chunk-bytes 4096
    peer.images[image.name] = {
        "size": image.size,
        "total": len(earlier),
        "sha256": image.sha256,
        "verified": False,
        "chunks": {i: earlier[i].data for i in range(4)},
    }
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p", "--json")  # now 2048
    assert result.code == 0, result.err
    assert "using 4096-byte chunks to match" in result.err
    assert not any(peer.chunk_receipts[(image.name, i)] for i in range(4))
    assert peer.images[image.name]["verified"] and peer.images[image.name]["content"] == image.content


def test_chunks_from_an_odd_chunk_size_nobody_recorded_are_a_conflict_with_the_fix(ow, keys, peer, pictures):
    image = prepare_image(str(pictures[0]))
    earlier = image.chunks(3000)
    peer.images[image.name] = {
        "size": image.size,
        "total": len(earlier),
        "sha256": image.sha256,
        "verified": False,
        "chunks": {0: earlier[0].data},
    }
    result = uplink(ow, keys, peer, "--image", pictures[0], "--prompt", "p")
    assert result.code == 3 and "CHUNK_CONFLICT" in result.err and "--chunk-bytes used then" in result.err
    assert not peer.commands_of(MessageType.IMAGE_CHUNK)
    resumed = ow(
        "ground", "uplink", *link_args(keys, peer), "--chunk-bytes", 3000, "--image", pictures[0], "--prompt", "p"
    )
    assert resumed.code == 0 and peer.chunk_receipts[(image.name, 0)] == 0 and peer.images[image.name]["verified"]
