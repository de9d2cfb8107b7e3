"""The local power switch with a zygote: each payload is forked from a pre-loaded process, waits
out the emulated boot, is cut with a SIGKILL of its own process group, and keeps nothing from
the payload before it (tests/bus/zygote_probe.py records what it finds in its memory)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from bus_testkit import HANG_S, wait_for

from hil.bus.power import LocalProcessSwitch, PowerSwitchError
from hil.bus.zygote import Zygote

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_forked_payload_waits_out_the_boot_and_keeps_nothing_across_a_cut(tmp_path):
    record = tmp_path / "probe.jsonl"
    zygote = Zygote(["hil.bus.power"], log_path=tmp_path / "zygote.log", env=_env(), cwd=str(ROOT)).start()
    boot_s = 0.4
    switch = LocalProcessSwitch(
        [sys.executable, "-m", "zygote_probe", str(record)],
        output_path=tmp_path / "out.log",
        env=_env(),
        zygote=zygote,
        boot_s=boot_s,
    )
    try:
        switch.prepare(120)
        info = zygote.info
        assert info["threads"] == 1 and info["pid"] == zygote.proc.pid
        seen = []
        for boot in (1, 2, 3):
            powered_at = time.monotonic()
            switch.on()
            pid = switch.pid
            first = wait_for(
                lambda boot=boot: len(_records(record)) == boot and _records(record)[-1], 30, what="probe record"
            )
            seen.append(first)
            # the emulated boot: nothing of the payload runs before power-on + boot_s
            assert first["started_monotonic"] >= powered_at + boot_s
            # its own session and process group, forked by the zygote (outside its power domain)
            assert first["pid"] == pid == first["pgid"] == first["sid"]
            assert first["ppid"] == zygote.proc.pid and os.getpgid(zygote.proc.pid) != pid
            assert first["preloaded"], "the zygote's imports are what the fork starts with"
            # nothing of the previous payload: neither the state it set nor the module it imported
            assert first["marker"] is None and not first["extra_module_loaded"]
            switch.off("thermal")
            assert not switch.is_on() and switch.session.exit_status is None
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # reaped by the zygote, not a zombie
        assert len({s["pid"] for s in seen}) == 3
        assert zygote.proc.poll() is None, "a cut never reaches the zygote"
    finally:
        switch.close()
    assert zygote.proc is None


def test_forked_payload_that_exits_is_reported_with_its_status(tmp_path):
    zygote = Zygote(["json"], env=_env(), cwd=str(ROOT)).start()
    switch = LocalProcessSwitch(
        [sys.executable, "-m", "json.tool", str(tmp_path / "missing.json")],
        output_path=tmp_path / "out.log",
        zygote=zygote,
        boot_s=0.0,
    )
    try:
        switch.on()
        assert wait_for(switch.poll, HANG_S, what="exit status") == 2  # json.tool: argparse refuses the missing file
        assert not switch.is_on()
        assert "missing.json" in (tmp_path / "out.log").read_text()
        # a command the zygote cannot run in its own interpreter is exec'd after the boot
        switch = LocalProcessSwitch(["/bin/sh", "-c", "kill -TERM $$"], zygote=zygote, boot_s=0.0)
        switch.on()
        assert wait_for(switch.poll, HANG_S, what="exit status") == -signal.SIGTERM
    finally:
        switch.close()


def test_a_zygote_that_started_a_thread_refuses_to_fork(tmp_path):
    zygote = Zygote(["zygote_threaded"], log_path=tmp_path / "zygote.log", env=_env(), cwd=str(ROOT)).start()
    switch = LocalProcessSwitch([sys.executable, "-m", "json.tool"], zygote=zygote, boot_s=1.0)
    try:
        with pytest.raises(PowerSwitchError, match="single-threaded"):
            switch.prepare(120)
    finally:
        switch.close()


def test_an_emulated_boot_needs_a_zygote():
    with pytest.raises(ValueError, match="zygote"):
        LocalProcessSwitch([sys.executable, "-c", "pass"], boot_s=1.0)


def test_a_cut_right_after_power_on_kills_the_fork(tmp_path):
    """The zygote hands out a payload's pid only once the payload leads its own process group,
    so a cut in the first instant after power-on (a one-second window at a compressed scale)
    still kills it, and the zygote reaps it."""
    record = tmp_path / "probe.jsonl"
    zygote = Zygote(["hil.bus.power"], env=_env(), cwd=str(ROOT)).start()
    switch = LocalProcessSwitch([sys.executable, "-m", "zygote_probe", str(record)], zygote=zygote, boot_s=0.0)
    try:
        switch.prepare(120)
        for _ in range(10):
            switch.on()
            pid = switch.pid
            switch.off("fdir")
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        switch.close()
