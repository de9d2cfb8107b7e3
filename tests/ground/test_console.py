"""The console's server without a browser: pages, security refusals, decimation, CSV, the
uplink's local checks (tests/ground/test_console_browser.py drives it in Chromium)."""

from __future__ import annotations

import asyncio
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


def serve(security: ConsoleSecurity, history: History | None = None):
    """Run the console on a free loopback port around `body(session, base)`."""

    def runner(body):
        async def main():
            config = ConsoleConfig(
                client_factory=_no_link, security=security, history=history or History(), listen=False
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
    history.add({"t": 11.0, "type": "HOUSEKEEPING", "body": {"current_task": "t-x", "phase": "DECODE"}})
    history.add({"t": 20.0, "type": "SHUTDOWN_WARNING", "body": {"cause": "POWER", "lead_time_s": 5.0}})
    history.add({"t": 24.5, "type": "POWER_STATE", "body": {"payload_on": False, "cause": "POWER"}})
    timeline = history.timeline(0.0, 100.0)
    (cut,) = timeline["cuts"]
    assert cut["cause"] == "POWER" and cut["warning_lead_s"] == 4.5 and cut["task"] == "t-x"
    assert timeline["windows"] == [[10.0, 24.5]] and timeline["payload_on"] is False


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
    proc = subprocess.Popen(cmd + ["--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
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
                with urllib.request.urlopen(request, timeout=30) as response:
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
