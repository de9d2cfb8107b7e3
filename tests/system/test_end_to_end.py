"""Ground -> bus -> flight, all real processes on loopback with CurveZMQ: three tasks through
repeated SIGKILL cuts -- the trace's, wherever they land, plus one made to land in prefill and one
in decode -- a payload killed in the middle of an image uplink, and the bus itself SIGKILLed and
restarted mid-run. Every task completes with the
uninterrupted answer; no task is lost or run twice; the uplink resumes without re-sending a
chunk."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import traces
from common.record import Kind, decode
from common.wire.link import Endpoints, init_keys
from ground.client import DEFAULT_WINDOW, GroundClient, GroundOptions
from hil.bus import BusConfig, BusProcess
from hil.bus import buslog as bl
from hil.testbench import BenchConfig, RequestSpec, reference_run
from traces.model import CutCause, PowerWindow

PACE_MS = 150
ENGINE = dict(chunk=4, group=2, decode_every=4, vision_every=1)


class _LogTail:
    """The bus log's complete entries, read incrementally: each poll reads only what was appended
    since the last, so a poll costs the same however long the log has grown (re-reading the whole
    log every 0.1 s on a loaded machine made the watcher slower than a decode phase)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self.entries: list[bl.BusLogEntry] = []

    def poll(self) -> list[bl.BusLogEntry]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                raw = f.read()
        except OSError:
            return self.entries
        end = raw.rfind(b"\n") + 1  # complete lines only; a partial one is read next time
        for line in raw[:end].split(b"\n"):
            if line.strip():
                try:
                    self.entries.append(bl.BusLogEntry.from_json(json.loads(line)))
                except (ValueError, KeyError):
                    pass  # a line a killed bus left torn (the restarted bus starts a new line)
        self.offset += end
        return self.entries


def _trace(path: Path) -> str:
    causes = [CutCause.THERMAL, CutCause.FDIR, CutCause.POWER, CutCause.CONTENTION]
    windows, t = [], 0.0
    for i in range(10):
        cause = causes[i % 4]
        lead = 2.0 if cause in (CutCause.THERMAL, CutCause.POWER) else 0.0
        windows.append(PowerWindow(t, t + 8.0, cause, lead))
        t += 9.5
    windows.append(PowerWindow(t, 400.0, None, 0.0))
    traces.dump(
        traces.Trace.from_windows(
            "e2e",
            400.0,
            windows,
            reference_request_s=10.0,
            description="end-to-end test: ten 8 s windows, then on",
            source={"kind": "manual"},
            assumptions=["test"],
        ),
        path,
    )
    return str(path)


def _big_png(path: Path) -> str:
    from PIL import Image

    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (700, 900, 3), dtype=np.uint8)).save(path)  # ~1.9 MB, ~58 chunks
    return str(path)


def _flight_pids(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"flight" in cmd and b"run" in cmd and any(marker.encode() in part for part in cmd):
            pids.append(int(entry))
    return pids


def _journal(path: Path) -> list[dict]:
    buf, pos, out = bytearray(path.read_bytes()), 0, []
    while pos < len(buf):
        rec, n = decode(buf, pos, expect_kind=Kind.QUEUE_ENTRY)
        out.append(rec.meta)
        pos += n
    return out


@pytest.mark.slow
def test_three_tasks_through_cuts_payload_reboot_mid_uplink_and_bus_restart(model_dirs, tmp_path):
    model = model_dirs["qwen3-vl"]
    samples = sorted(str(p) for p in (Path(__file__).resolve().parents[2] / "hil" / "samples").glob("*.png"))
    big = _big_png(tmp_path / "big.png")
    specs = [
        RequestSpec((samples[0], samples[1]), "count the ships near the coast", 12),
        RequestSpec((samples[2], samples[3]), "describe the clouds over the fields", 12),
        RequestSpec((big,), "report any fire or flood in this scene", 12),
    ]
    cfg = BenchConfig(trace="demo", model=model, out_dir=str(tmp_path), **ENGINE)
    refs = [reference_run(model, s, cfg, str(tmp_path / f"ref{i}")) for i, s in enumerate(specs)]

    keys = str(tmp_path / "keys")
    init_keys(keys)
    data = tmp_path / "bus"
    # The bus binds ports the kernel picks (a port found free here and bound later by the bus
    # can be taken in between by any other process on a busy machine: "Address already in use");
    # the restart below comes back on the ports the first bus bound, as a real bus keeps its own.
    ephemeral = Endpoints(*(["tcp://127.0.0.1:*"] * 3))
    flight_args = [
        "--chunk",
        str(ENGINE["chunk"]),
        "--group",
        str(ENGINE["group"]),
        "--decode-every",
        str(ENGINE["decode_every"]),
        "--vision-every",
        "1",
        "--threads",
        "1",
        "--pace-ms",
        str(PACE_MS),
        "--device",
        "cpu",
    ]
    bus_cfg = BusConfig(
        trace=_trace(tmp_path / "e2e.jsonl"),
        data_dir=str(data),
        keys_dir=keys,
        time_scale=1.0,
        endpoints=ephemeral,
        model=model,
        flight_args=flight_args,
        fdir_off_s=1.0,
        heartbeat_timeout_s=30.0,
    )
    bus = BusProcess(bus_cfg).start()
    endpoints = bus.endpoints
    bus_cfg = replace(bus_cfg, endpoints=endpoints)
    uplinks, killed = {}, threading.Event()
    phase_kills: list[str] = []
    stop_watching = threading.Event()

    def kill_in_phases():
        """Besides the trace's cuts (wherever they land on this machine's clock), SIGKILL the
        payload while a task is in prefill, then while one is in decode, then once more in
        whatever phase runs next, so that three cuts certainly hit running work, whatever this
        machine's speed. Each kill waits for progress reported after the previous one."""
        wanted = ["prefill", "decode", None]  # None: any phase
        seen = 0  # log entries read before the last kill: only later progress counts
        while wanted and not stop_watching.is_set():
            entries = tail.poll()
            progress = [e for e in entries[seen:] if e.kind == bl.PAYLOAD_REPORT and e.data.get("type") == "PROGRESS"]
            if (
                progress
                and wanted[0] in (None, progress[-1].data.get("phase"))
                and progress[-1].data.get("done", 0) >= 2
            ):
                pids = _flight_pids(str(data))
                if pids:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    phase_kills.append(progress[-1].data.get("phase"))
                    wanted.pop(0)
                    seen = _after_exit(len(entries))
            time.sleep(0.02)

    # what tells the watcher the killed payload is gone: the bus saw it exit, or cut its power,
    # or the bus itself was killed before it logged either (its next run starts a new payload)
    gone = {bl.PAYLOAD_EXITED, bl.POWER_OFF, bl.RUN_START}

    def _after_exit(start: int) -> int:
        """The log index just past the first record at or after `start` that the killed payload
        is gone: reports it sent before it died come before it and never count."""
        while not stop_watching.is_set():
            entries = tail.poll()
            for index in range(start, len(entries)):
                if entries[index].kind in gone:
                    return index + 1
            time.sleep(0.02)
        return start

    tail = _LogTail(data / bl.LOG_FILE)
    watcher = threading.Thread(target=kill_in_phases, daemon=True)

    def kill_payload_mid_uplink():
        """SIGKILL the payload once part of the big image is stored (a reboot mid-uplink). Watches
        for as long as the test runs: the uplink it waits for is as slow as the machine."""
        while not killed.is_set() and not stop_watching.is_set():
            stored = list((data / "payload" / "images").glob("big-*/c*"))
            if len(stored) >= 15:
                for pid in _flight_pids(str(data)):
                    os.kill(pid, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.02)

    try:
        with GroundClient(
            keys, GroundOptions(endpoints=endpoints, timeout_s=15.0, retries=100, progress=False, notify=lambda s: None)
        ) as ground:
            for i, spec in enumerate(specs):
                if i == 2:
                    threading.Thread(target=kill_payload_mid_uplink, daemon=True).start()
                uplinks[f"t{i}"] = ground.uplink(
                    list(spec.images), spec.prompt, max_new_tokens=spec.max_new_tokens, task_id=f"t{i}"
                )
            assert killed.is_set(), "the payload was never killed during the big uplink"
            watcher.start()
            time.sleep(6)
            bus.kill()  # the bus itself dies (its payload with it) ...
            bus = BusProcess(bus_cfg).start()  # ... and comes back on the same data directory
            results = {t: ground.result(t, wait=True, max_wait_s=900, poll_s=10) for t in ("t0", "t1", "t2")}
    finally:
        stop_watching.set()
        bus.stop()

    # every answer is the uninterrupted one
    for i, (task, res) in enumerate(sorted(results.items())):
        assert list(res.token_ids) == refs[i]["token_ids"], task
        assert bytes(res.logits_sha256).hex() == refs[i]["logits_sha256"], task
    # the big image survived the payload reboot in the middle of its upload: the bus stored the
    # chunks the payload had not acknowledged and delivered them to the rebooted payload, the
    # ground re-sent at most those in flight, and the payload verified the whole file once
    big_upload = uplinks["t2"].images[0]
    assert big_upload.verified
    assert big_upload.chunks <= big_upload.chunks_sent <= big_upload.chunks + DEFAULT_WINDOW
    first_run = next(iter(bl.runs(bl.read_log(data / bl.LOG_FILE)).values()))
    chunk_times = [
        e.wall_s for e in first_run if e.kind == bl.COMMAND_FORWARDED and e.data.get("type") == "IMAGE_CHUNK"
    ]
    exits = [e.wall_s for e in first_run if e.kind in (bl.PAYLOAD_EXITED, bl.FDIR_ACTION)]
    assert any(min(chunk_times) < t < max(chunk_times) for t in exits), "no payload reboot during the uplink"
    completions = [
        e
        for e in bl.read_log(data / bl.LOG_FILE)
        if e.kind == bl.PAYLOAD_REPORT and e.data.get("type") == "EVENT" and e.data.get("event") == "IMAGE_COMPLETE"
    ]
    assert sum("big-" in e.data.get("text", "") for e in completions) == 1
    # no task lost or run twice: none left in the payload's journal of live tasks, each completed
    # in the result store, and completed once
    journal = _journal(data / "payload" / "queue" / "journal.log")
    live = {e["task"]["task_id"] for e in journal if e["op"] in ("submit", "task")}
    live -= {e["task_id"] for e in journal if e["op"] == "finished"}
    assert not live & {"t0", "t1", "t2"}
    completions = [
        e.data.get("task_id")
        for e in bl.read_log(data / bl.LOG_FILE)
        if e.kind == bl.PAYLOAD_REPORT and e.data.get("event") == "TASK_COMPLETED"
    ]
    for task in ("t0", "t1", "t2"):
        stored, _ = decode((data / "payload" / "results" / f"{task}.rec").read_bytes(), expect_kind=Kind.FINISHED_TASK)
        assert stored.meta["task"]["state"] == "completed"
        assert completions.count(task) <= 1
    # at least three trace cuts hit running tasks, in prefill and in decode
    entries = bl.read_log(data / bl.LOG_FILE)
    phase_at_cut = []
    for run in bl.runs(entries).values():
        last_phase = None
        for e in run:
            if e.kind == bl.PAYLOAD_REPORT and e.data.get("type") == "PROGRESS":
                last_phase = e.data.get("phase")
            elif e.kind in (bl.PAYLOAD_REPORT,) and e.data.get("type") == "COMPLETED":
                last_phase = None
            elif (e.kind == bl.POWER_OFF and e.data.get("origin") == "trace") or e.kind == bl.PAYLOAD_EXITED:
                if last_phase is not None:
                    phase_at_cut.append(last_phase)
                last_phase = None
    assert len(phase_kills) == 3 and phase_kills[:2] == ["prefill", "decode"], phase_kills
    assert len(phase_at_cut) >= 3, phase_at_cut
    assert {"prefill", "decode"} <= set(phase_at_cut), phase_at_cut
    assert sum(r.interruptions for r in results.values()) >= 3
