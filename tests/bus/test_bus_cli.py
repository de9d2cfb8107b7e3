"""`ow bus run` as the lead wires it (register_bus) and as `python -m hil.bus.cli`: help text,
configuration errors, and BusConfig <-> argv for BusProcess."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from bus_testkit import LOOPBACK, window, write_trace

from common.wire.link import Endpoints
from hil.bus import Bus, BusConfig, BusConfigError, config_to_argv
from hil.bus.cli import config_from_args, register_bus

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ow")
    register_bus(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bus", "run", *argv])


def test_cli_help_and_configuration_errors(tmp_path, keys):
    help_text = subprocess.run(
        [sys.executable, "-m", "hil.bus.cli", "run", "--help"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert "--time-scale X" in help_text and "one trace second lasts X wall seconds" in help_text
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hil.bus.cli",
            "run",
            "--trace",
            str(tmp_path / "missing.jsonl"),
            "--data-dir",
            str(tmp_path / "bus"),
            "--keys",
            str(keys.root),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2 and "missing.jsonl" in result.stderr
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hil.bus.cli",
            "run",
            "--trace",
            "trace-a",
            "--data-dir",
            str(tmp_path / "bus"),
            "--keys",
            str(keys.root),
            "--commands-endpoint",
            "tcp://127.0.0.1:*",
            "--payload-endpoint",
            "tcp://127.0.0.1:*",
            "--telemetry-endpoint",
            "tcp://127.0.0.1:*",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2 and "{model}" in result.stderr, "the default flight command needs --model"


def test_bus_process_arguments_round_trip_through_the_cli(tmp_path):
    config = BusConfig(
        trace="sat1-like",
        data_dir=str(tmp_path / "bus"),
        keys_dir=str(tmp_path / "keys"),
        time_scale=0.01,
        start_at_s=120.0,
        stop_at_end=True,
        endpoints=Endpoints(
            commands="tcp://127.0.0.1:6550", payload="tcp://0.0.0.0:6551", telemetry="tcp://127.0.0.1:6552"
        ),
        payload_connect_endpoint="tcp://192.168.1.10:6551",
        power_driver="ssh",
        payload_command=["ow", "flight", "run", "--data-dir", "{payload_data_dir}", "--model", "{model}"],
        model="/opt/models/qwen3-vl-2b",
        flight_args=["--pace-ms", "5", "--chunk=64"],
        payload_data_dir="/var/lib/ow",
        payload_keys_dir="/etc/ow/keys",
        ssh_host="jetson.local",
        ssh_user="ow",
        ssh_port=2222,
        ssh_identity="/home/op/.ssh/bench",
        ssh_options=["StrictHostKeyChecking=accept-new"],
        ssh_mode="reboot",
        ssh_pidfile="/run/ow.pid",
        ssh_reboot_command="sudo reboot -f",
        heartbeat_timeout_s=4.0,
        boot_timeout_s=90.0,
        fdir_off_s=1.5,
        confirm_after_s=3.0,
        max_in_flight=8,
        boot_loop_limit=3,
        boot_loop_backoff_s=30.0,
        boot_settle_s=5.0,
        telemetry_max_hz=5.0,
        bus_temp_c=18.5,
        ground_clients=["ground", "station2"],
        log_packets=False,
        ready_file=str(tmp_path / "ready.json"),
    )
    assert asdict(config_from_args(parse(config_to_argv(config)))) == asdict(config)


def test_one_bus_per_data_directory(tmp_path, keys):
    trace = write_trace(tmp_path / "t.jsonl", 10, [window(5, 10, None)], telemetry=False)
    config = BusConfig(
        trace=str(trace), data_dir=tmp_path / "bus", keys_dir=keys.root, endpoints=LOOPBACK, payload_command=["true"]
    )
    first = Bus(config)
    first.start()
    try:
        with pytest.raises(BusConfigError, match="another bus"):
            Bus(config).start()
    finally:
        first.request_stop()
        first.run()
    second = Bus(config)  # the lock went with the first bus
    second.start()
    second.request_stop()
    second.run()
