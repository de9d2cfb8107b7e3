"""The console's resumable upload from the browser (docs/ground.md "Upload to the console"),
over HTTP against the console's real server and the scripted test peer: an upload cut off
midway, with the console restarted, goes on from the offset the console kept, yields a
byte-identical file and an uplink that completes; bad chunks, wrong offsets and a bad image
are refused with their messages; every chunk needs the token and the console's origin, and a
read-only console refuses them."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from common.wire.link import Endpoints
from ground.client import GroundClient, GroundOptions
from ground.console import ConsoleConfig, ConsoleSecurity, make_app
from ground.console.server import UPLOADS_DIR
from ground.images import prepare_image
from ground.state import GroundState

TOKEN = "s3cret"
CHUNK = 16 * 1024


def run_console(state, security, client_factory, body):
    """The console's app on a free loopback port around `body(session, base, headers)`."""

    async def main():
        config = ConsoleConfig(client_factory=client_factory, security=security, listen=False, state=state)
        runner = web.AppRunner(make_app(config))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                return await body(session, base, {"Origin": base, "X-Console-Token": TOKEN})
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def _no_link(**overrides):
    raise AssertionError("this test must not reach the link")


async def _json(response) -> dict:
    return await response.json()


async def create(session, base, headers, name: str, content: bytes) -> dict:
    meta = {"name": name, "size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    async with session.post(base + "/api/uploads", json=meta, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def put(session, base, headers, upload: str, offset: int, chunk: bytes, chunk_sha: str | None = None):
    sent = {**headers, "Upload-Offset": str(offset), "Chunk-SHA256": chunk_sha or hashlib.sha256(chunk).hexdigest()}
    async with session.put(f"{base}/api/uploads/{upload}", data=chunk, headers=sent) as r:
        return r.status, await r.json()


async def cut_off_put(base: str, headers: dict, upload: str, offset: int, chunk: bytes) -> None:
    """A PUT whose connection drops after half of its body: what a lost link or a closed page does."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"PUT /api/uploads/{upload} HTTP/1.1\r\nHost: {host}:{port}\r\nOrigin: {headers['Origin']}\r\n"
        f"X-Console-Token: {TOKEN}\r\nUpload-Offset: {offset}\r\nChunk-SHA256: {hashlib.sha256(chunk).hexdigest()}\r\n"
        f"Content-Length: {len(chunk)}\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    writer.write(head.encode() + chunk[: len(chunk) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def test_an_upload_cut_off_midway_resumes_after_a_console_restart_and_the_uplink_completes(keys, peer, pictures):
    content = pictures[0].read_bytes()
    upload = hashlib.sha256(content).hexdigest()
    assert len(content) > 2 * CHUNK + 1
    state = GroundState(keys.state_dir)
    security = ConsoleSecurity(token=TOKEN)

    def client(**overrides):
        endpoints = Endpoints(commands=peer.commands_endpoint, telemetry=peer.telemetry_endpoint)
        options = GroundOptions(
            endpoints=endpoints, timeout_s=5.0, progress=False, notify=lambda s: None, chunk_bytes=2048
        )
        return GroundClient(str(keys.root), replace(options, **overrides))

    async def first(session, base, headers):
        assert (await create(session, base, headers, "coast.png", content))["offset"] == 0
        assert await put(session, base, headers, upload, 0, content[:CHUNK]) == (
            200,
            {"upload": upload, "offset": CHUNK, "size": len(content), "complete": False, "chunk_limit": 4 << 20},
        )
        await cut_off_put(base, headers, upload, CHUNK, content[CHUNK : 2 * CHUNK])
        # a damaged chunk and a wrong offset are refused, and nothing of them kept
        status, answer = await put(session, base, headers, upload, CHUNK, b"x" * 10, hashlib.sha256(b"y").hexdigest())
        assert status == 400 and "SHA-256 differs" in answer["error"]
        status, answer = await put(session, base, headers, upload, 0, content[:CHUNK])
        assert status == 409 and answer["offset"] == CHUNK
        # every chunk needs the token and the console's origin
        status, answer = await put(session, base, {"Origin": base}, upload, CHUNK, content[CHUNK : 2 * CHUNK])
        assert status == 401
        status, answer = await put(
            session, base, {"Origin": "http://evil.example", "X-Console-Token": TOKEN}, upload, CHUNK, content[CHUNK:]
        )
        assert status == 403

    run_console(state, security, client, first)
    assert (state.dir / UPLOADS_DIR / upload / "data").read_bytes() == content[:CHUNK]

    async def after_restart(session, base, headers):
        resumed = await create(session, base, headers, "coast.png", content)  # what a reloaded page asks
        assert resumed["offset"] == CHUNK and not resumed["complete"]
        offset = resumed["offset"]
        while offset < len(content):
            status, answer = await put(session, base, headers, upload, offset, content[offset : offset + CHUNK])
            assert status == 200, answer
            offset = answer["offset"]
        assert answer["complete"]
        uplink = {"prompt": "count the ships", "max_new_tokens": 8, "images": [{"upload": upload, "name": "coast.png"}]}
        async with session.post(base + "/api/uplink", json=uplink, headers=headers) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["result"]

    result = run_console(state, security, client, after_restart)
    stored = state.dir / UPLOADS_DIR / upload / "named" / "coast.png"
    assert stored.read_bytes() == content  # byte-identical on the console
    image = prepare_image(str(stored))
    assert image.name.startswith("coast-")  # the on-board name comes from the operator's file name
    assert peer.images[image.name]["verified"] and peer.images[image.name]["content"] == content  # and on board
    assert [i["verified"] for i in result["images"]] == [True]
    assert peer.tasks[result["task_id"]]["message"].prompt == "count the ships"
    assert state.task(result["task_id"])["images"]  # the task list names the stored file: `resend` finds it


def test_uploads_refuse_what_the_cli_refuses(tmp_path):
    state = GroundState(tmp_path / "state")
    bad = b"not a picture"

    async def body(session, base, headers):
        meta = {"name": "big.png", "size": 16 * 1024 * 1024 + 1, "sha256": "0" * 64}
        async with session.post(base + "/api/uploads", json=meta, headers=headers) as r:
            assert r.status == 400
            message = (await r.json())["error"]
            limit = "larger than the payload limit of 16777216 bytes (16 MiB)"
            assert message == f"image 'big.png': 16777217 bytes, {limit}"
        for name in ("../x.png", "", "a/b.png"):
            async with session.post(base + "/api/uploads", json=dict(meta, name=name, size=10), headers=headers) as r:
                assert r.status == 400 and "not a file name" in (await r.json())["error"]
        upload = (await create(session, base, headers, "bad.png", bad))["upload"]
        uplink = {"prompt": "describe", "images": [{"upload": upload, "name": "bad.png"}]}
        async with session.post(base + "/api/uplink", json=uplink, headers=headers) as r:
            assert r.status == 400
            assert (await r.json())["error"] == "image 'bad.png': not uploaded to the console yet (0 of 13 bytes)"
        status, answer = await put(session, base, headers, upload, 0, bad)
        assert status == 200 and answer["complete"]
        async with session.post(base + "/api/uplink", json=uplink, headers=headers) as r:
            assert r.status == 400
            assert (await r.json())["error"] == "image 'bad.png': not a decodable picture (UnidentifiedImageError)"
        async with session.post(base + "/api/uplink", json=dict(uplink, prompt=" \u200b"), headers=headers) as r:
            assert r.status == 400 and "EMPTY_PROMPT" in (await r.json())["error"]  # the prompt is checked first
        # the page's check before it sends any image: the fields alone
        check = {"prompt": " \u200b", "max_new_tokens": "8", "priority": "0", "check_only": True}
        async with session.post(base + "/api/uplink", json=check, headers=headers) as r:
            assert r.status == 400 and "EMPTY_PROMPT" in (await r.json())["error"]
        async with session.post(base + "/api/uplink", json=dict(check, prompt="describe"), headers=headers) as r:
            assert r.status == 200 and (await r.json()) == {"ok": True, "checked": True}
        for tokens in (8.5, True, "8 tokens"):
            request = dict(uplink, max_new_tokens=tokens)
            async with session.post(base + "/api/uplink", json=request, headers=headers) as r:
                assert r.status == 400 and "whole numbers" in (await r.json())["error"]
        async with session.post(base + "/api/uplink", json=dict(uplink, max_new_tokens=2000), headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"] == "max new tokens 2000 outside 1..1024"
        # a chunk over the limit is refused, announced (Content-Length) or not (chunked transfer)
        large = bytes(5 * 1024 * 1024)
        big = (await create(session, base, headers, "large.png", large))["upload"]
        over = large[: 4 * 1024 * 1024 + 1]
        status, answer = await put(session, base, headers, big, 0, over)
        assert status == 413

        async def streamed():
            yield over

        sent = {**headers, "Upload-Offset": "0", "Chunk-SHA256": hashlib.sha256(over).hexdigest()}
        async with session.put(f"{base}/api/uploads/{big}", data=streamed(), headers=sent) as r:
            assert r.status == 413 and (await r.json())["offset"] == 0
        # a file that is not the one announced is dropped whole
        liar = (await create(session, base, headers, "liar.png", b"abcd"))["upload"]
        status, answer = await put(session, base, headers, liar, 0, b"abce")
        assert status == 422 and "dropped" in answer["error"]
        assert not (state.dir / UPLOADS_DIR / liar).exists()

    run_console(state, ConsoleSecurity(token=TOKEN), _no_link, body)


@pytest.mark.parametrize("method", ["create", "chunk"])
def test_a_read_only_console_refuses_uploads(tmp_path, method):
    state = GroundState(tmp_path / "state")

    async def body(session, base, headers):
        if method == "create":
            meta = {"name": "a.png", "size": 4, "sha256": "0" * 64}
            async with session.post(base + "/api/uploads", json=meta, headers=headers) as r:
                status, answer = r.status, await r.json()
        else:
            status, answer = await put(session, base, headers, "0" * 64, 0, b"abcd")
        assert status == 403 and "read-only" in answer["error"]

    run_console(state, ConsoleSecurity(read_only=True), _no_link, body)


def test_unfinished_uploads_untouched_for_a_week_are_swept_and_finished_ones_kept(tmp_path):
    import os

    from ground.console.uploads import STALE_AFTER_S, UploadStore

    store = UploadStore(tmp_path / UPLOADS_DIR)
    done, stale, fresh = b"done", b"stale file", b"fresh file"
    for content in (done, stale, fresh):
        store.create("a.png", len(content), hashlib.sha256(content).hexdigest())
    done_id = hashlib.sha256(done).hexdigest()
    store.write(done_id, 0, done, done_id)
    week_ago = 1_000_000.0 - STALE_AFTER_S - 1
    for content in (done, stale):
        os.utime(store.root / hashlib.sha256(content).hexdigest() / "upload.json", (week_ago, week_ago))
    fresh_id = hashlib.sha256(fresh).hexdigest()
    os.utime(store.root / fresh_id / "upload.json", (1_000_000.0, 1_000_000.0))
    assert store.sweep(now=1_000_000.0) == [hashlib.sha256(stale).hexdigest()]
    assert sorted(p.name for p in store.root.iterdir()) == sorted([done_id, fresh_id])
