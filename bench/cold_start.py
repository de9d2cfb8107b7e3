"""Cold start of the onboard process, side by side with `python -c "import torch"`.

On a real board a power-on is followed by the flight process's own start in real seconds. This
measures, in alternating rounds on the same machine (these machines are noisy, so medians of
interleaved runs):

    import torch           `python -c "import torch"`, exec to exit: the floor any payload pays
    import stack           `python -c "import torch, transformers; from transformers import
                           Qwen3VLForConditionalGeneration"`: what a naive payload pays before work
    import torch._dynamo   `python -c "import torch, torch._dynamo"`: the floor of any payload built
                           on transformers' model classes, whatever it trims: ten module-level uses
                           of torch._dynamo sit on their import chain (transformers 5.24.0:
                           masking_utils, continuous batching's cache, the deepgemm, sonicmoe, fp8
                           and flex-attention integrations; docs/flight.md "Boot"), and torch does
                           not import it itself
    ow flight run          exec to: its first packet on the bus link (heartbeat), the BOOT event,
                           the answer to a PING sent as soon as it is connected, and the first unit
                           of inference work of the task it resumes (its first PROGRESS report:
                           the end of that unit; one unit of the tiny model is milliseconds)

    optimal planner        OrbitWeaver's recovery planner, the default of `ow flight run`: its import
                           and its first plan in a fresh process (bench/recovery_planner.py's boot
                           row, the 36-layer G = 2 case, a random frontier of 32 chunks: the
                           largest plan a payload makes). The payload makes both on its engine
                           thread after the link is up (docs/flight.md "Boot"), so they are part
                           of exec-to-first-unit above and never of a PING's answer

and prints the ratios exec-to-first-unit / import torch (goal: at most 1.5), exec-to-first-unit /
import torch._dynamo (what the payload adds to that floor) and exec-to-link, and the recovery
planner's cost at boot: the payload resumes with OrbitWeaver's `optimal` planner by default, which
the inference worker imports with the engine (after torch, which brings numpy), never the thread
that answers the bus; its import is timed inside a process that has imported torch. Each round
records the 1-min load average at its start: on a shared machine the medians mean little without it.
The payload resumes the same checkpointed task in every round (its data directory is restored
from a snapshot taken after a first boot that started the task; the scripted bus tells it at
connection that the previous boot was cut, as the real bus does), with a warm page cache like
`import torch` next to it; `--cold-model` also drops the model's and the task's files from the
page cache before each round (posix_fadvise DONTNEED), as after a real power cut.

    python -m bench.cold_start [--rounds 5] [--model DIR] [--out runs/bench/cold_start.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench.recovery_latency import drop_cache
from bench.recovery_planner import boot_times
from common.wire import Apid, NodeId, PowerCause, decode, encode
from common.wire import messages as m
from common.wire.link import recv_packet
from hil.scripted_bus import BusPeer, spawn_flight
from hil.testbench import SAMPLES
from hil.testbench_cli import ensure_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

IMPORT_TORCH = "import torch"
IMPORT_STACK = "import torch, transformers; from transformers import Qwen3VLForConditionalGeneration"
IMPORT_FLOOR = "import torch, torch._dynamo"


def timed_python(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    return time.perf_counter() - start


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def timed_peer(keys_dir: str):
    """The payload tests' scripted bus, stamping each packet with its arrival time."""

    class TimedPeer(BusPeer):
        def __init__(self, keys: str) -> None:
            super().__init__(keys)
            self.arrived: list[float] = []

        def pump(self, seconds: float):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                r = recv_packet(self.sock, timeout_s=0.01)
                if r is None:
                    continue
                self.payload_id = r.routing_id
                self.received.append(decode(r.packet))
                self.arrived.append(time.perf_counter())

    return TimedPeer(keys_dir)


class Payload:
    """One `ow flight run` against the scripted bus; the measured instants are relative to exec."""

    def __init__(self, bus, data_dir: str, model: str, keys: str, log_path: str):
        self.bus = bus
        self.mark = len(bus.received)
        self.started = time.perf_counter()
        self.proc = spawn_flight(data_dir, model, keys, bus.endpoint, log_path=log_path)

    def wait(self, predicate, timeout: float = 300.0) -> float:
        """Seconds from exec to the arrival of the first packet of this boot matching `predicate`."""
        header, msg = self.bus.wait_for(predicate, timeout, start=self.mark)
        index = next(i for i in range(self.mark, len(self.bus.received)) if self.bus.received[i][1] is msg)
        return self.bus.arrived[index] - self.started

    def power_state(self) -> None:
        """What the bus sends a payload that connects after a power-up (hil/bus/relay.py): how its
        previous boot ended. The payload holds the task it was running at that end until it hears
        this (flight/runtime/health.py, at most VERDICT_WAIT_S = 5 s), so a bus that stays silent
        would make the wait, not the payload, the measured first unit."""
        state = m.PowerStateChange(trace_time_s=0.0, payload_on=True, cause=PowerCause.RESTORED, after_fault=False)
        self.bus.raw(encode(state, Apid.BUS, self.bus.counter.next(Apid.BUS), source_id=NodeId.BUS))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def prepare(bus, work: str, model: str, keys: str) -> str:
    """A data directory holding a task that has started and made some progress, then was cut."""

    data = os.path.join(work, "data")
    payload = Payload(bus, data, model, keys, os.path.join(work, "prepare.log"))
    payload.wait(lambda h, msg: isinstance(msg, m.Heartbeat))
    images = sorted(glob.glob(str(SAMPLES / "*.png")))[:2]
    for i, path in enumerate(images):
        with open(path, "rb") as f:
            content = f.read()
        for chunk in m.ImageChunk.split(f"img{i}.png", content, chunk_bytes=32 << 10):
            seq = bus.command(chunk)
            bus.wait_for(lambda h, msg, s=seq: isinstance(msg, (m.Accepted, m.Rejected)) and msg.tc_seq == s, 60)
    bus.command(
        m.UplinkTask(
            task_id="cold",
            prompt="count the ships near the coast",
            images=[f"img{i}.png" for i in range(len(images))],
            max_new_tokens=64,
            priority=1,
        )
    )
    # run into prefill, then cut: later boots resume it from its checkpoints
    payload.wait(
        lambda h, msg: (
            isinstance(msg, m.Progress) and msg.task_id == "cold" and str(msg.phase) == "prefill" and msg.done >= 2
        )
    )
    payload.kill()
    snapshot = os.path.join(work, "snapshot")
    shutil.copytree(data, snapshot)
    return snapshot


def measure_boot(bus, snapshot: str, work: str, model: str, keys: str, cold: bool) -> dict:
    data = os.path.join(work, "data")
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(snapshot, data)
    if cold:
        drop_cache([model, data])
    payload = Payload(bus, data, model, keys, os.path.join(work, "boots.log"))
    try:
        link = payload.wait(lambda h, msg: isinstance(msg, m.Heartbeat))
        payload.power_state()
        seq = bus.command(m.Ping(key=7))
        boot_event = payload.wait(lambda h, msg: isinstance(msg, m.Event) and msg.event_id.name == "BOOT")
        answered = payload.wait(lambda h, msg: isinstance(msg, (m.Accepted, m.Rejected)) and msg.tc_seq == seq)
        first_unit = payload.wait(lambda h, msg: isinstance(msg, m.Progress) and msg.task_id == "cold")
    finally:
        payload.kill()
    return {"link_s": link, "boot_event_s": boot_event, "command_answered_s": answered, "first_unit_s": first_unit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="model directory (default: the tiny model of the testbench)")
    p.add_argument(
        "--cold-model",
        action="store_true",
        help="drop the model's and the task's files from the page cache before each boot",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "cold_start.json"))
    args = p.parse_args(argv)

    model = ensure_model(args.model)
    os.makedirs(os.path.join(ROOT, "runs"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="cold-start-", dir=os.path.join(ROOT, "runs"))
    bus = timed_peer(os.path.join(work, "keys"))
    rows = []
    try:
        snapshot = prepare(bus, work, model, os.path.join(work, "keys"))
        timed_python(IMPORT_TORCH)  # one warm-up of each, not counted
        for r in range(args.rounds):
            row = {"load1": os.getloadavg()[0], "import_torch_s": timed_python(IMPORT_TORCH)}
            row.update(measure_boot(bus, snapshot, work, model, os.path.join(work, "keys"), args.cold_model))
            row["import_stack_s"] = timed_python(IMPORT_STACK)
            row["import_floor_s"] = timed_python(IMPORT_FLOOR)
            planner = boot_times(chunks=32, runs=1, frontiers=("random",))[0]
            row["planner_import_s"] = planner["import_ms"] / 1e3
            row["planner_first_plan_s"] = planner["first_plan_ms"] / 1e3
            rows.append(row)
            print(f"round {r + 1}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    finally:
        bus.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    ratios = {
        "first_unit_over_import_torch": med["first_unit_s"] / med["import_torch_s"],
        "import_stack_over_import_torch": med["import_stack_s"] / med["import_torch_s"],
        "import_floor_over_import_torch": med["import_floor_s"] / med["import_torch_s"],
        "first_unit_over_import_floor": med["first_unit_s"] / med["import_floor_s"],
        "link_s": med["link_s"],
        "command_answered_s": med["command_answered_s"],
    }
    load = os.getloadavg()
    # the machine is shared: each round's 1-minute load average, and the median of them
    loads = [row["load1"] for row in rows]
    result = {
        "rounds": rows,
        "median": med,
        "ratios": ratios,
        "model": model,
        "cold_model": args.cold_model,
        "loadavg": load,
        "load1_per_round": loads,
        "cpus": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"\nmedians over {len(rows)} rounds on {os.cpu_count()} CPUs; 1-minute load average "
        f"at each round's start: median {statistics.median(loads):.1f}, {min(loads):.1f} to {max(loads):.1f}):"
    )
    print(f"  python -c 'import torch'                  {med['import_torch_s']:.2f} s")
    print(
        f"  import torch + transformers' Qwen3-VL     {med['import_stack_s']:.2f} s "
        f"({ratios['import_stack_over_import_torch']:.2f}x import torch)"
    )
    print(
        f"  import torch + torch._dynamo              {med['import_floor_s']:.2f} s "
        f"({ratios['import_floor_over_import_torch']:.2f}x import torch: the floor with transformers' models)"
    )
    print(
        f"  optimal planner (engine thread)           import {med['planner_import_s'] * 1e3:.0f} ms, "
        f"first plan {med['planner_first_plan_s'] * 1e3:.0f} ms (inside the first unit, not the PING's answer)"
    )
    print(f"  ow flight run: first packet on the link   {med['link_s']:.2f} s (goal <= 0.5 s)")
    print(f"                 a PING answered            {med['command_answered_s']:.2f} s")
    print(f"                 first unit of work done    {med['first_unit_s']:.2f} s")
    print(
        f"  the recovery planner (optimal, the default): its import on the worker after torch "
        f"{med['planner_import_s'] * 1e3:.0f} ms (off the thread that answers the bus)"
    )
    print(f"  ratio first unit / import torch: {ratios['first_unit_over_import_torch']:.2f}x (goal <= 1.5x)")
    print(
        f"  ratio first unit / import torch + torch._dynamo: {ratios['first_unit_over_import_floor']:.2f}x "
        "(what the payload adds to the floor of transformers' model classes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
