"""`make demo`: the whole system through power cuts, as an operator sees it.

Builds the tiny model (seeded random weights) if needed, then runs the testbench on the hand-written
`demo` trace: the mock bus powers the payload, cuts it four times (thermal with a warning, FDIR,
low power with a warning, a competing payload) by SIGKILLing the payload process, and powers it
again; the ground station uplinks three tasks with the sample scenes in hil/samples/. What
happens is printed as it happens; at the end every result is compared with an uninterrupted
reference computed beforehand.

    python -m hil.demo [--out runs/demo] [--pace-ms 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from common import log as owlog
from common.wire import messages as m
from hil.testbench import BenchConfig, Testbench, default_workload
from hil.testbench_cli import ensure_model


class OperatorView:
    """Prints one line per thing that matters, with the time since the start."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.last_phase: dict[str | None, str] = {}  # by task id (a progress report may carry none)

    def say(self, line: str) -> None:
        print(f"{time.monotonic() - self.t0:6.1f}s  {line}", flush=True)

    def packet(self, msg: m.Message) -> None:
        if isinstance(msg, m.Progress):
            key = f"{msg.task_id}:{msg.phase}"
            if self.last_phase.get(msg.task_id) != str(msg.phase) or msg.done == msg.total:
                self.last_phase[msg.task_id] = str(msg.phase)
                bar = "#" * int(20 * msg.done / max(1, msg.total))
                self.say(f"[payload] {msg.task_id} {str(msg.phase):8s} {msg.done:3d}/{msg.total:<3d} {bar}")
            del key


class DemoTestbench(Testbench):
    """The testbench, also showing each payload packet on the operator view."""

    def __init__(self, cfg: BenchConfig, view: OperatorView):
        super().__init__(cfg, say=view.say)
        self.view = view

    def _show(self, msg: m.Message) -> None:
        super()._show(msg)
        self.view.packet(msg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join("runs", "demo"))
    p.add_argument("--pace-ms", type=float, default=300.0, help="per-unit pace of the payload (ms)")
    p.add_argument("--requests", type=int, default=3)
    args = p.parse_args(argv)
    owlog.setup("error")

    view = OperatorView()
    view.say("OrbitWeaver demo: ground -> bus -> payload over ZeroMQ/CurveZMQ, power cut by the bus (SIGKILL)")
    model = ensure_model(None)
    view.say(f"model: tiny Qwen3-VL with seeded random weights in {model}")
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = BenchConfig(
        trace="demo",
        model=model,
        out_dir=args.out,
        requests=args.requests,
        workload=default_workload(args.requests, 24),
        time_scale=1.0,
        pace_ms=args.pace_ms,
        chunk=8,
        group=2,
        decode_every=4,
        boot_trace_s=None,
    )  # real time: this machine's real boot
    bench = DemoTestbench(cfg, view)
    view.say(
        "computing the uninterrupted references, then starting the bus on trace 'demo' "
        "(4 cuts: thermal+warning, FDIR, power+warning, competing payload)"
    )
    report = bench.run()
    print()
    print("Results (each compared with its uninterrupted reference: same token ids, same logits hash):")
    for r in report.requests:
        verdict = "IDENTICAL" if r.correct else ("DIFFERENT" if r.correct is False else "not finished")
        print(
            f"  {r.task_id}  {verdict:12s} {r.tokens} tokens, survived {r.cuts} cut(s), end to end {r.e2e_s:.1f} s"
            if r.e2e_s is not None
            else f"  {r.task_id}  {verdict}"
        )
    print()
    print(report.summary())
    print(
        f"\nrun log of the bus: {os.path.join(args.out, 'bus', 'bus-log.jsonl')} "
        f"(replay it with: ow hil replay {os.path.join(args.out, 'bus', 'bus-log.jsonl')})"
    )
    ok = report.completion_rate == 1.0 and report.all_correct
    print(
        "demo "
        + ("passed: every task finished across the cuts with the uninterrupted answer" if ok else "FAILED: see above")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
