"""The console's server without a browser: pages, security refusals, decimation, CSV, the
uplink's local checks (tests/ground/test_console_browser.py drives it in Chromium)."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io

import aiohttp
import pytest
from aiohttp import web

from ground.console import ConsoleConfig, ConsoleSecurity, History, SecurityError, make_app
from ground.console.history import decimate
from ground.console.security import self_signed
from ground.errors import LocalInputError
from ground.images import prepare_images


def _no_link(**overrides):
    raise AssertionError("this test must not reach the link")


def serve(security: ConsoleSecurity, history: History | None = None, state=None):
    """Run the console on a free loopback port around `body(session, base)`."""

    def runner(body):
        async def main():
            config = ConsoleConfig(
                client_factory=_no_link, security=security, history=history or History(), listen=False, state=state
            )
            app_runner = web.AppRunner(make_app(config))
            await app_runner.setup()
            site = web.TCPSite(app_runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            try:
                async with aiohttp.ClientSession() as session:
                    return await body(session, f"http://127.0.0.1:{port}")
            finally:
                await app_runner.cleanup()

        return asyncio.run(main())

    return runner


def test_page_and_vendored_scripts_are_served():
    async def body(session, base):
        async with session.get(base + "/") as r:
            page = await r.text()
            assert r.status == 200 and "OrbitWeaver ground console" in page
            assert "http" not in page.replace("http-equiv", "")  # nothing from a CDN
        for name in ("uPlot.iife.min.js", "uPlot.min.css", "console.js", "console.css"):
            async with session.get(base + "/static/" + name) as r:
                assert r.status == 200, name
        async with session.get(base + "/api/info") as r:
            assert (await r.json())["read_only"] is False

    serve(ConsoleSecurity())(body)


def test_beyond_loopback_refuses_to_start_without_token_or_tls(tmp_path):
    with pytest.raises(SecurityError, match="without a token"):
        ConsoleSecurity(host="0.0.0.0").check_startup()
    with pytest.raises(SecurityError, match="without TLS"):
        ConsoleSecurity(host="0.0.0.0", token="t").check_startup()
    cert, key, fingerprint = self_signed(str(tmp_path), "10.0.0.5")
    ConsoleSecurity(host="10.0.0.5", token="t", tls_cert=cert, tls_key=key).check_startup()
    assert len(fingerprint) == 95 and fingerprint.count(":") == 31
    assert ConsoleSecurity(host="10.0.0.5", token="t", tls_cert=cert, tls_key=key).ssl_context() is not None
    ConsoleSecurity(host="127.0.0.1").check_startup()  # loopback: nothing more needed


def _form(prompt: str = "describe") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("prompt", prompt)
    form.add_field("image", b"not a picture", filename="bad.png", content_type="image/png")
    return form


def test_actions_need_the_token_and_the_same_origin():
    async def body(session, base):
        own = {"Origin": base}
        async with session.post(base + "/api/uplink", data=_form(), headers=own) as r:
            assert r.status == 401 and "token" in (await r.json())["error"]
        async with session.post(base + "/api/uplink", data=_form(), headers={**own, "X-Console-Token": "wrong"}) as r:
            assert r.status == 401
        evil = {"Origin": "http://evil.example", "X-Console-Token": "s3cret"}
        async with session.post(base + "/api/tasks/t-abc/cancel", headers=evil) as r:
            assert r.status == 403 and "cross-origin" in (await r.json())["error"]
        async with session.post(base + "/api/tasks/t-abc/cancel", headers={"X-Console-Token": "s3cret"}) as r:
            assert r.status == 403  # no Origin at all: refused too
        # right token, right origin: reaches the uplink's own checks (a bad image, refused locally)
        async with session.post(base + "/api/uplink", data=_form(), headers={**own, "X-Console-Token": "s3cret"}) as r:
            assert r.status == 400

    serve(ConsoleSecurity(token="s3cret"))(body)


def test_read_only_console_refuses_an_uplink():
    async def body(session, base):
        async with session.post(base + "/api/uplink", data=_form(), headers={"Origin": base}) as r:
            assert r.status == 403 and "read-only" in (await r.json())["error"]
        async with session.get(base + "/api/tasks") as r:
            assert r.status == 200  # views still served

    serve(ConsoleSecurity(read_only=True))(body)


def test_bad_image_gets_the_cli_message(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a picture")
    with pytest.raises(LocalInputError) as cli:
        prepare_images([str(bad)])
    expected = str(cli.value).replace(repr(str(bad)), repr("bad.png"))

    async def body(session, base):
        async with session.post(base + "/api/uplink", data=_form(), headers={"Origin": base}) as r:
            assert r.status == 400
            assert (await r.json())["error"] == expected

    serve(ConsoleSecurity())(body)


def _history(n: int) -> History:
    history = History(max_events=1000, max_samples=n)
    for i in range(n):
        body = {"battery_soc": (i % 97) / 97, "payload_power_w": float(i % 13), "bus_voltage_v": 28.0}
        history.add({"t": 1000.0 + i, "type": "POWER", "body": body})
    return history


def test_decimation_keeps_extremes_and_bounds_points():
    ts = [float(i) for i in range(10_000)]
    vs = [0.0 if i == 5_555 else 1.0 + (i % 7) for i in range(10_000)]
    points = decimate(ts, vs, 0.0, 9_999.0, 100)
    assert len(points) <= 200
    assert [5_555.0, 0.0] in points and max(p[1] for p in points) == 7.0


def test_memory_is_bounded():
    history = _history(5_000)
    history2 = History(max_events=10, max_samples=100)
    for i in range(1_000):
        history2.add({"t": float(i), "type": "EVENT", "body": {"event_id": "TASK_PHASE"}, "text": "x"})
        history2.add({"t": float(i), "type": "POWER", "body": {"battery_soc": 0.5}})
    assert len(history2.events) == 10 and len(history2.series["battery_soc"].t) == 100
    assert len(history.series["battery_soc"].t) == 5_000


def test_csv_holds_what_the_plot_shows():
    history = _history(300)

    async def body(session, base):
        async with session.get(base + "/api/telemetry?t0=1100&t1=1199&buckets=800") as r:
            shown = (await r.json())["series"]["battery_soc"]
        async with session.get(base + "/api/telemetry.csv?t0=1100&t1=1199&series=battery_soc") as r:
            rows = list(csv.DictReader(io.StringIO(await r.text())))
        assert [[float(row["time_unix_s"]), float(row["value"])] for row in rows] == shown
        assert len(rows) == 100

    serve(ConsoleSecurity(), history)(body)


def test_memory_and_storage_written_over_boots_are_plotted_and_exported():
    """HOUSEKEEPING `written_bytes` restarts at each boot (wire-protocol.md §3.3): the console sums
    each boot's largest count; a late report of an earlier boot, and an older payload's report
    without the fields, add nothing. Memory is plotted as reported."""
    history = History()
    reports = [  # (t, boot, written, memory)
        (1.0, 1, 100, 50_000_000),
        (2.0, 1, 300, 60_000_000),
        (3.0, 2, 40, 55_000_000),  # a cut and a boot: the count restarted
        (3.5, 1, 310, None),  # late, from boot 1: already summed
        (4.0, 2, 90, 70_000_000),
    ]
    for t, boot, written, memory in reports:
        body = {"boot_count": boot, "written_bytes": written, "memory_rss_bytes": memory}
        history.add({"t": t, "type": "HOUSEKEEPING", "body": body})
    history.add({"t": 5.0, "type": "HOUSEKEEPING", "body": {"boot_count": 2}})  # an older payload
    raw = history.raw(0.0, 10.0, ["storage_written_bytes", "payload_memory_bytes"])
    assert raw["storage_written_bytes"] == ([1.0, 2.0, 3.0, 4.0], [100.0, 300.0, 340.0, 390.0])
    assert raw["payload_memory_bytes"] == ([1.0, 2.0, 3.0, 4.0], [5e7, 6e7, 5.5e7, 7e7])

    async def body(session, base):
        async with session.get(base + "/api/info") as r:
            assert {"storage_written_bytes", "payload_memory_bytes"} <= set((await r.json())["series"])
        async with session.get(base + "/api/telemetry.csv?t0=0&t1=10&series=storage_written_bytes") as r:
            rows = list(csv.DictReader(io.StringIO(await r.text())))
        assert [float(row["value"]) for row in rows] == [100.0, 300.0, 340.0, 390.0]

    serve(ConsoleSecurity(), history)(body)


def test_timeline_records_cut_cause_warning_lead_and_running_task():
    history = History()
    history.add({"t": 10.0, "type": "POWER_STATE", "body": {"payload_on": True, "cause": "TRACE"}})
    history.add({"t": 11.0, "type": "HOUSEKEEPING", "body": {"current_task": "t-x", "phase": "decode"}})
    history.add({"t": 20.0, "type": "SHUTDOWN_WARNING", "body": {"cause": "POWER", "lead_time_s": 5.0}})
    # PROGRESS reports (more often than HOUSEKEEPING) say what the cut interrupted, to the unit
    progress = {"task_id": "t-x", "phase": "decode", "done": 31, "total": 39}
    history.add({"t": 22.0, "type": "PROGRESS", "body": progress})
    history.add({"t": 24.5, "type": "POWER_STATE", "body": {"payload_on": False, "cause": "POWER"}})
    timeline = history.timeline(0.0, 100.0)
    (cut,) = timeline["cuts"]
    assert cut["cause"] == "POWER" and cut["warning_lead_s"] == 4.5 and cut["task"] == "t-x"
    assert (cut["phase"], cut["done"], cut["total"]) == ("decode", 31, 39)
    assert timeline["windows"] == [[10.0, 24.5]] and timeline["payload_on"] is False
    assert history.progress["t-x"] == {"phase": "decode", "done": 31, "total": 39, "t": 22.0}
    # a finished task's last report leaves the payload idle: a cut then interrupts nothing
    history.add({"t": 30.0, "type": "POWER_STATE", "body": {"payload_on": True, "cause": "TRACE"}})
    done = {"task_id": "t-x", "phase": "completed", "done": 39, "total": 39}
    history.add({"t": 31.0, "type": "PROGRESS", "body": done})
    history.add({"t": 32.0, "type": "POWER_STATE", "body": {"payload_on": False, "cause": "THERMAL"}})
    assert history.timeline(0.0, 100.0)["cuts"][-1]["task"] is None
    assert history.timeline(0.0, 100.0)["doing"] == {}


def test_on_loopback_a_token_is_made_for_the_run_and_actions_need_it(tmp_path):
    """`ow ground console` with no token (loopback) makes one for the run and announces the
    address with it (#token=, for the page): a POST without it is refused, as beyond loopback.
    With --port 0 the address announced has the port the system picked."""
    import os
    import re
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run(
        [sys.executable, "-m", "common.cli", "ground", "keys", "init", "--keys", str(tmp_path / "keys")],
        check=True,
        capture_output=True,
        env=env,
        timeout=120,
    )
    cmd = [sys.executable, "-m", "common.cli", "ground", "console", "--keys", str(tmp_path / "keys")]
    # --port 0: the system picks a free port, and the announcement names the one it picked
    # No bus runs here: the authorised action ends in "no answer" once the handshake wait is over.
    # A short one keeps that wait (30 s by default) apart from the request's hang guard below.
    proc = subprocess.Popen(
        cmd + ["--port", "0", "--handshake-timeout", "1", "--timeout", "1"], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        line = ""
        for line in proc.stderr:  # the announcement, once it is bound
            if "console on" in line:
                break
        found = re.search(r"console on http://127\.0\.0\.1:(\d+)/#token=([A-Za-z0-9_\-]+)", line)
        assert found, f"no port and token in the announcement: {line!r}"
        port = int(found.group(1))
        assert port != 0
        url = f"http://127.0.0.1:{port}/api/tasks/t-1/cancel"

        def post(token: str | None) -> int:
            headers = {"Origin": f"http://127.0.0.1:{port}"}
            if token is not None:
                headers["X-Console-Token"] = token
            request = urllib.request.Request(url, data=b"", headers=headers, method="POST")
            try:  # it announces once it is bound: no retry needed
                with urllib.request.urlopen(request, timeout=300) as response:  # a hang guard
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert post(None) == 401
        assert post("wrong") == 401
        assert post(found.group(2)) != 401
    finally:
        proc.terminate()
        proc.wait(30)


def test_routine_housekeeping_is_marked_for_the_events_view_and_kept():
    """The bus's once-a-second FDIR "nominal" is marked routine (the events view hides it unless
    asked, as `ow ground events` does); a change of FDIR mode is not routine."""
    from ground.console.server import Console

    console = Console(ConsoleConfig(client_factory=_no_link, security=ConsoleSecurity(), listen=False))
    body = {"mode": "nominal", "fault_count": 0, "last_fault": ""}
    records = [{"n": n, "t": 100.0 + n, "sent_t": 100.0 + n, "type": "FDIR", "body": dict(body)} for n in range(3)]
    records.append({"n": 3, "t": 103.0, "sent_t": 103.0, "type": "FDIR", "body": {**body, "mode": "safe"}})
    for record in records:
        console.ingest(record)
    assert [r["routine"] for r in records] == [False, True, True, False]


def test_command_history_follows_the_station_command_log(tmp_path):
    """The history shows every command of the station's shared log (ground/state.py), not only
    the console's: what was there at start, then each line another `ow ground` process appends,
    pushed on the stream."""
    import json
    import time

    from ground.state import GroundState

    state = GroundState(tmp_path / "state")

    def command(name: str, code: str = "OK") -> dict:
        return {"t": time.time(), "origin": "ow ground cancel", "command": name, "code": code, "rtt_ms": 12.5}

    state.log_command(command("CANCEL_TASK", "TASK_FINISHED"))

    async def commands(session, base, wanted: int) -> list[dict]:
        for _ in range(200):  # the log is looked at twice a second
            async with session.get(base + "/api/events") as r:
                found = (await r.json())["commands"]
            if len(found) >= wanted:
                return found
            await asyncio.sleep(0.05)
        raise AssertionError(f"the console's history never had {wanted} command(s)")

    async def body(session, base):
        (first,) = await commands(session, base, 1)
        assert (first["command"], first["code"], first["origin"]) == (
            "CANCEL_TASK",
            "TASK_FINISHED",
            "ow ground cancel",
        )
        async with session.get(base + "/api/stream") as stream:
            await stream.content.readline()  # ": connected": the page is subscribed
            with open(state.command_log_path, "ab") as log:  # a torn line, as a killed writer leaves
                log.write(b'{"command": "PI')
            state.log_command(command("STATUS"))
            pushed = None
            while pushed is None:
                line = await asyncio.wait_for(stream.content.readline(), 30)
                if line.startswith(b"data: "):
                    pushed = json.loads(line[6:])
        assert (pushed["type"], pushed["command"], pushed["code"]) == ("COMMAND", "STATUS", "OK")
        assert [c["command"] for c in await commands(session, base, 2)] == ["CANCEL_TASK", "STATUS"]

    serve(ConsoleSecurity(), state=state)(body)


def _address_beyond_loopback() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None. (A UDP socket's connect
    only picks the route's source address: nothing is sent.)"""
    import socket

    found = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("198.51.100.1", 9))  # TEST-NET-2 (documentation only): any route to it will do
        found.append(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    return next((a for a in found if a and not a.startswith("127.") and a != "0.0.0.0"), None)


def test_beyond_loopback_over_tls_with_a_self_signed_certificate(tmp_path):
    """`ow ground console` bound to this machine's network address, with a token file and a
    certificate it makes: reached over https by a real TLS client that trusts that certificate
    (and checks the fingerprint the console printed), refused without the token; plain http gets
    no page."""
    import hashlib
    import http.client
    import json
    import os
    import re
    import socket
    import ssl
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    host = _address_beyond_loopback()
    if host is None:
        pytest.skip("this machine has no IPv4 address beyond loopback to bind the console to")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    keys = str(tmp_path / "keys")
    (tmp_path / "token").write_text("s3cret-token\n")
    ow = [sys.executable, "-m", "common.cli", "ground"]
    subprocess.run(ow + ["keys", "init", "--keys", keys], check=True, capture_output=True, env=env, timeout=120)
    cmd = ow + ["console", "--keys", keys, "--host", host, "--port", "0", "--token-file", str(tmp_path / "token")]
    cmd += ["--tls-self-signed", str(tmp_path / "tls")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # the certificate's fingerprint, then the address once bound
            lines.append(line)
            if "console on" in line:
                break
        text = "".join(lines)
        printed = re.search(r"SHA-256 fingerprint ([0-9A-F:]{95})", text)
        found = re.search(rf"console on https://{re.escape(host)}:(\d+)/", text)
        assert printed and found, text
        base = f"https://{host}:{found.group(1)}"
        # a real client: verifies the chain against the certificate and the host name against its SAN
        context = ssl.create_default_context(cafile=str(tmp_path / "tls" / "console-cert.pem"))

        def call(path: str, headers: dict | None = None, data: bytes | None = None) -> tuple[int, bytes]:
            request = urllib.request.Request(base + path, data=data, headers=headers or {})
            try:
                with urllib.request.urlopen(request, timeout=30, context=context) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        status, body = call("/api/info")
        assert status == 200 and json.loads(body)["token_required"] is True
        with context.wrap_socket(
            socket.create_connection((host, int(found.group(1))), 30), server_hostname=host
        ) as tls:
            served = hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest().upper()
        assert ":".join(served[i : i + 2] for i in range(0, 64, 2)) == printed.group(1)
        own = {"Origin": base}
        assert call("/api/tasks/t-1/cancel", own, b"")[0] == 401  # no token
        assert call("/api/tasks/t-1/cancel", {**own, "X-Console-Token": "wrong"}, b"")[0] == 401
        status, body = call(
            "/api/tasks/t-1/cancel", {"Origin": "https://evil.example", "X-Console-Token": "s3cret-token"}, b""
        )
        assert status == 403 and b"cross-origin" in body  # the token passed; the origin did not
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{host}:{found.group(1)}/api/info", timeout=30)  # no plain http
    finally:
        proc.terminate()
        proc.wait(30)


def test_lifetime_storage_written_survives_a_console_restart(tmp_path):
    """The running lifetime total is kept in the station's state (docs/ground.md "Lifetime
    storage written"): a restarted console shows the same total and goes on from it without
    counting the present boot twice; a payload whose boot count restarted adds to it; a damaged
    file is set aside and said."""
    from ground.console.server import WRITTEN_FILE, Console
    from ground.state import GroundState

    state = GroundState(tmp_path / "state")

    def console() -> Console:
        return Console(ConsoleConfig(client_factory=_no_link, security=ConsoleSecurity(), listen=False, state=state))

    def report(target: Console, t: float, boot: int, written: int) -> None:
        body = {"boot_count": boot, "written_bytes": written}
        target.ingest({"t": t, "type": "HOUSEKEEPING", "body": body})

    def total(target: Console) -> float:
        return target.history.raw(0.0, 1e12, ["storage_written_bytes"])["storage_written_bytes"][1][-1]

    first = console()
    for t, boot, written in [(1.0, 1, 100), (2.0, 1, 300), (3.0, 2, 40)]:
        report(first, t, boot, written)
    assert total(first) == 340.0
    second = console()  # a restart: a fresh history, the same state
    assert total(second) == 340.0
    report(second, 4.0, 2, 90)  # the same boot goes on: 300 + 90, not 340 + 90
    assert total(second) == 390.0
    report(second, 5.0, 3, 10)
    third = console()
    assert total(third) == 400.0
    report(third, 6.0, 1, 5)  # below the saved boot, before any report of it: the count restarted
    assert total(third) == 405.0
    report(third, 7.0, 0, 999)  # now a lower boot is a late packet
    assert total(third) == 405.0
    (state.dir / WRITTEN_FILE).write_text("{not json")
    fourth = console()
    assert not fourth.history.raw(0.0, 1e12, ["storage_written_bytes"])["storage_written_bytes"][0]
    assert (state.dir / (WRITTEN_FILE + ".damaged")).exists()
    report(fourth, 8.0, 1, 7)
    assert total(fourth) == 7.0
    said = [e["text"] for e in fourth.history.events if e["type"] == "CONSOLE"]
    assert any("set aside" in text and "starts from zero" in text for text in said), said


def test_task_view_shows_each_tasks_latest_progress(tmp_path):
    """Every task's latest progress (its PROGRESS reports), not only the payload's current task's;
    the checkpoint bytes of the current one."""
    from ground.state import GroundState

    state = GroundState(tmp_path / "state")
    for task in ("t-a", "t-b"):
        state.update_task(task, state="accepted", prompt="p")
    history = History()
    history.add({"t": 1.0, "type": "PROGRESS", "body": {"task_id": "t-a", "phase": "decode", "done": 4, "total": 4}})
    hk = {"current_task": "t-b", "phase": "prefill", "progress_done": 2, "progress_total": 8, "checkpoint_bytes": 512}
    history.add({"t": 2.0, "type": "HOUSEKEEPING", "body": hk})

    async def body(session, base):
        async with session.get(base + "/api/tasks") as r:
            tasks = {t["task_id"]: t for t in (await r.json())["tasks"]}
        assert tasks["t-a"]["live"] == {"phase": "decode", "done": 4, "total": 4}
        assert tasks["t-b"]["live"] == {"phase": "prefill", "done": 2, "total": 8, "checkpoint_bytes": 512}

    serve(ConsoleSecurity(), history, state=state)(body)
