"""Boot-time faults of the payload (issue 27, finding 3), with the real bus and the real flight
process: a missing model directory no longer stops the payload before it connects (it comes up,
says what is wrong and waits for the model), and an OOM kill while the worker imports torch is
counted against `engine:load` like any engine-load fault, so the third one quarantines it and
the payload stays up answering commands instead of looping."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import traces
from common.wire import ResponseCode
from common.wire.link import Endpoints, init_keys
from hil.bus import BusConfig, BusThread
from hil.bus import buslog as bl
from hil.bus.config import default_payload_command
from traces.model import PowerWindow

FLIGHT_ARGS = ["--chunk", "16", "--group", "2", "--decode-every", "2", "--vision-every", "1", "--threads", "1"]
SAMPLES = sorted(str(p) for p in (Path(__file__).resolve().parents[2] / "hil" / "samples").glob("*.png"))
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


def _always_on(tmp_path: Path) -> Path:
    path = tmp_path / "on.jsonl"
    traces.dump(
        traces.Trace.from_windows(
            "on",
            3600.0,
            [PowerWindow(0.0, 3600.0, None, 0.0)],
            description="always on",
            source={"kind": "manual"},
            assumptions=["test"],
        ),
        path,
    )
    return path


def _config(tmp_path: Path, keys: str, model: str, **overrides) -> BusConfig:
    settings: dict = dict(
        trace=str(_always_on(tmp_path)),
        data_dir=str(tmp_path / "bus"),
        keys_dir=keys,
        time_scale=1.0,
        endpoints=Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        model=model,
        fdir_off_s=0.1,
        heartbeat_timeout_s=60.0,
        boot_timeout_s=180.0,
        flight_args=FLIGHT_ARGS,
    )
    settings.update(overrides)
    return BusConfig(**settings)


def _events(log, name: str) -> list[str]:
    return [e["text"] for e in log if e.kind == bl.PAYLOAD_REPORT and e.data.get("event") == name]


def _wait_log(path: Path, predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = bl.read_log(path) if path.exists() else []
        if predicate(log):
            return log
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_missing_model_directory_is_reported_and_waited_for(tmp_path, model_dirs):
    """No model at boot: the payload connects, sends BOOT_FAULT naming the directory, answers
    PING and takes an uplink, runs nothing; the bus sees one healthy boot (nothing to retry: its
    PAYLOAD_RETRY is NOT_HELD). Once the directory appears the task runs to its result."""
    from ground.client import GroundClient, GroundOptions
    from ground.errors import CommandRejected

    keys = str(tmp_path / "keys")
    init_keys(keys)
    model = tmp_path / "model"
    bus = BusThread(_config(tmp_path, keys, str(model))).start()
    try:
        with GroundClient(
            keys, GroundOptions(endpoints=bus.endpoints, timeout_s=60.0, retries=20, notify=lambda s: None)
        ) as ground:
            ground.ping()
            with pytest.raises(CommandRejected) as refused:
                ground.payload_retry()
            assert refused.value.code == ResponseCode.NOT_HELD and refused.value.by == "bus"
            ground.uplink([SAMPLES[0]], "count the ships", max_new_tokens=2, task_id="t-1")
            log = _wait_log(bus.log_path, lambda log: _events(log, "BOOT_FAULT"), 60, "the BOOT_FAULT event")
            assert str(model) in _events(log, "BOOT_FAULT")[0], _events(log, "BOOT_FAULT")
            ground.ping()  # still answering, still no engine
            staging = tmp_path / "model.copying"
            shutil.copytree(model_dirs["qwen3-vl"], staging)
            os.rename(staging, model)  # the model appears whole, as an operator's upload would finish
            result = ground.result("t-1", wait=True, max_wait_s=600, poll_s=2.0)
            assert len(result.token_ids) == 2
    finally:
        bus.stop()
    log = bl.read_log(bus.log_path)
    assert len([e for e in log if e.kind == bl.POWER_ON]) == 1, "one boot, never power-cycled"
    assert not [e for e in log if e.kind in (bl.PAYLOAD_EXITED, bl.FDIR_ACTION, "payload_boot_failed")]
    assert not [e for e in log if e.kind == "bus_event" and e.get("event") == "PAYLOAD_BOOT_LOOP"]
    assert len(_events(log, "BOOT_FAULT")) == 1, "reported once, not at every re-check"


@pytest.fixture
def memory_cgroup():
    """A cgroup (v1 memory controller) of our own, removed afterwards; skips where there is none
    to make (not root, or no v1 memory hierarchy)."""
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup needs root (CI runs as root)")
    if not (CGROUP_MEMORY / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    path = CGROUP_MEMORY / f"orbitweaver-test-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    yield path
    for _ in range(100):  # the bus has killed its payload; the kernel may take a moment to let go
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_an_oom_kill_while_importing_torch_is_counted_and_quarantined(tmp_path, model_dirs, memory_cgroup):
    """A memory limit that the payload's link fits in but torch's import does not (120 MiB here:
    the link is up at about 50 MiB, `import torch` reaches about 230 MiB): the kernel's OOM killer
    SIGKILLs each boot in its worker's import. Each such boot is counted against `engine:load`
    (ABNORMAL_EXIT 1/3, 2/3); the fourth boot quarantines it and stays up, answering commands
    without an engine -- three exits, not a loop."""
    from ground.client import GroundClient, GroundOptions

    (memory_cgroup / "memory.limit_in_bytes").write_text(str(120 * 2**20))
    keys = str(tmp_path / "keys")
    init_keys(keys)
    # The payload enters the cgroup before it execs the flight process, as a service manager's
    # MemoryMax= would put it there.
    command = ["sh", "-c", f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$@"', "sh", *default_payload_command()]
    bus = BusThread(_config(tmp_path, keys, model_dirs["qwen3-vl"], payload_command=command)).start()
    try:
        log = _wait_log(
            bus.log_path,
            lambda log: _events(log, "ITEM_QUARANTINED"),
            300,
            "engine:load quarantined",
        )
        with GroundClient(
            keys, GroundOptions(endpoints=bus.endpoints, timeout_s=60.0, notify=lambda s: None)
        ) as ground:
            ground.ping()
            listing = ground.quarantine()
            assert list(listing.items) == ["engine:load"] and listing.exits[0] == 3
    finally:
        bus.stop()
    log = bl.read_log(bus.log_path)
    exits = [e["status"] for e in log if e.kind == bl.PAYLOAD_EXITED]
    assert exits == [-9, -9, -9], exits  # SIGKILLed by the OOM killer, three times, then never again
    counted = _events(log, "ABNORMAL_EXIT")
    assert len(counted) == 2 and all("engine:load" in text for text in counted), counted
    assert "engine:load" in _events(log, "ITEM_QUARANTINED")[0]
    assert int((memory_cgroup / "memory.failcnt").read_text()) > 0, "the limit was hit"


def test_an_address_space_limit_at_the_torch_import_is_a_counted_engine_fault(tmp_path, model_dirs):
    """The other way memory runs out at boot: an address-space limit (RLIMIT_AS, as `ulimit -v`
    or a service's LimitAS= sets it) makes the import fail with an exception instead of a kill
    (here the dynamic loader cannot map libtorch). That is an engine-load fault like any other:
    counted against `engine:load` (ABNORMAL_EXIT 1/3; the third quarantines it), the payload up
    and answering meanwhile. (The limit: the payload's link, which imports neither torch nor
    numpy, runs in 380 MB of address space with two malloc arenas; at 500 MB torch's libraries
    map and numpy's C extensions fail instead, at 550 MB torch maps and aborts from C++.)"""
    from ground.client import GroundClient, GroundOptions

    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) not installed")
    keys = str(tmp_path / "keys")
    init_keys(keys)
    # Two malloc arenas: the address space a many-core machine's arenas would reserve is not the
    # payload's to spend.
    limit = ["env", "MALLOC_ARENA_MAX=2", "prlimit", f"--as={420 * 2**20}", "--"]
    bus = BusThread(_config(tmp_path, keys, model_dirs["qwen3-vl"], payload_command=limit + default_payload_command()))
    bus.start()
    try:
        log = _wait_log(bus.log_path, lambda log: _events(log, "ABNORMAL_EXIT"), 120, "the first engine-load fault")
        with GroundClient(
            keys, GroundOptions(endpoints=bus.endpoints, timeout_s=60.0, notify=lambda s: None)
        ) as ground:
            ground.ping()
    finally:
        bus.stop()
    counted = _events(log, "ABNORMAL_EXIT")
    assert counted[0].startswith("engine:load: engine load failed") and counted[0].endswith("(1/3)"), counted
    assert "WORKER_FAULT" in [e.data.get("event") for e in log if e.kind == bl.PAYLOAD_REPORT]
    assert not [e for e in bl.read_log(bus.log_path) if e.kind == bl.PAYLOAD_EXITED], "the payload stayed up"
