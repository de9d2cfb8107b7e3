"""Real size on this CPU: a request at Qwen3-VL-2B's dimensions, uninterrupted and killed twice
in every phase with real SIGKILLs, bitwise; the lifecycle simulator's prediction beside it.

Everything measured so far on real processes ran the tiny or the small model; the real-size
figures came from the simulator alone. This bench runs the real dimensions (seeded random
weights, `ow model build-tiny --size qwen3-vl-2b`) with real-size inputs (two images at 768 px
and a prompt brought to exactly --prompt-tokens tokens, images included, so every prefill chunk
is whole):

1. `ow infer --policy none` in a fresh process: this machine's compute per unit of work (vision
   block, decoder layer x prefill chunk, decode step) -- the simulator's platform for this
   machine (hil/sim/platform.py `testbench_platform` with those unit times, no pace, this disk's
   measured commit latency and durable write rate). Measured again at the end: the machine is
   shared, so the prediction is a band over the two platforms.
2. `ow infer --policy orbitweaver`, uninterrupted, in a fresh process: per phase time, bytes
   written, records; peak RSS against the weights' size; exec to the request opened (the boot).
3. The same command on a fresh checkpoint directory, SIGKILLed as soon as it reports the unit at
   a third and at two thirds of each phase (six kills), and run again after each kill, as a
   payload reboots: every restart's boot, what it resumed from, its recovery plan and what the
   restore cost (the engine's `recovery_plan`, `prefill_restored`, `vision_restored`,
   `decode_restored`); the final answer's tokens and logits against step 2's, bitwise.
4. The simulator predicts steps 2 and 3 -- the same windows (each process from its exec to its
   kill) and each process's measured boot -- with each platform of step 1.

CPU timings, not Jetson timings; the machine's load is printed beside them.

    python -m bench.real_size [--size qwen3-vl-2b] [--threads 1] [--out runs/bench/real-size]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from bench.engine_overhead import ensure_images, ensure_model
from common.wire.ids import MAX_PROMPT_BYTES
from flight.checkpoint.policies import Geometry
from flight.events import EngineEvent
from hil.sim import validate as simval
from hil.sim.lifecycle import RequestModel
from hil.sim.models import spec_from_dir
from hil.sim.platform import Platform, testbench_platform

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORDS = (
    "orbit ground pass thermal battery eclipse downlink sensor image cloud coast harbor field river road ship "
    "port city farm crop snow ice water forest mountain desert bridge runway smoke flood fire dune reef glacier"
).split()
PHASES = ("vision", "prefill", "decode")
UNIT_EVENTS: dict[str, str] = {
    EngineEvent.VISION_BLOCK_DONE: "vision",
    EngineEvent.PREFILL_BLOCK_DONE: "prefill",
    EngineEvent.DECODE_STEP_DONE: "decode",
}
#: what the engine's log keeps of a restart
RESTORE_EVENTS = (
    EngineEvent.REQUEST_OPENED,
    EngineEvent.RECOVERY_PLAN,
    EngineEvent.PREFILL_RESTORED,
    EngineEvent.VISION_RESTORED,
    EngineEvent.DECODE_RESTORED,
)


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


class PeakRss(threading.Thread):
    """The largest resident set of one process, sampled."""

    def __init__(self, pid: int, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            proc = psutil.Process(self.pid)
            while not self._halt.wait(self.every_s):
                self.peak = max(self.peak, proc.memory_info().rss)
        except psutil.Error:  # the process is gone
            pass

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def fit_prompt(model_dir: str, images: list[str], tokens: int) -> tuple[str, int, int]:
    """A prompt of words that brings the request to exactly `tokens` tokens (images included):
    (prompt, visual tokens, text tokens)."""

    shapes = simval.RequestShapes(model_dir)
    files = [(os.path.basename(p), Path(p).read_bytes()) for p in images]
    lead = "Describe both images in detail, then compare them. Context:"

    def shape(words: int):
        text = " ".join([lead, *(WORDS[i % len(WORDS)] for i in range(words))])
        request = shapes(files, text, 1)
        return text, request.visual_tokens, request.text_tokens

    text, visual, txt = shape(0)
    if visual + txt > tokens:
        raise SystemExit(f"the images alone make {visual + txt} tokens, more than --prompt-tokens {tokens}")
    words = tokens - visual - txt  # each word is about one token: step towards the target
    for _ in range(40):
        text, visual, txt = shape(words)
        if visual + txt == tokens:
            if len(text.encode()) > MAX_PROMPT_BYTES:
                raise SystemExit(
                    f"a prompt of {txt} text tokens is {len(text.encode())} bytes, more than an uplink carries "
                    f"({MAX_PROMPT_BYTES}): lower --prompt-tokens or raise --image-side"
                )
            return text, visual, txt
        words += tokens - visual - txt
    raise SystemExit(f"could not bring the prompt to exactly {tokens} tokens (at {visual + txt})")


@dataclass
class Session:
    """One `ow infer` process: from its exec to its exit or its kill."""

    exec_s: float  # since the request's first exec
    opened_s: float | None = None  # exec -> request opened (model loaded, inputs built)
    first_unit_s: float | None = None  # exec -> its first unit of work done
    ended_s: float | None = None  # since the request's first exec: the process gone (exit or kill)
    completed_s: float | None = None  # since the request's first exec: the engine's request_completed
    killed_at: tuple[str, int] | None = None  # (phase, unit) it was killed after
    restore: list[dict] = field(default_factory=list)  # the engine's restart events
    answer: dict | None = None  # the JSON of a process that finished
    peak_rss: int = 0


def _stamp(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def spawn_process(cmd: list[str], env: dict):
    """`cmd` in a fresh process: what a payload's boot costs, imports included."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def infer_session(
    cmd: list[str], env: dict, t0: float, kill_at: set[tuple[str, int]] | None = None, spawn=spawn_process
) -> Session:
    """Run `cmd` (ow infer ... --log-level debug --json) and follow its log; SIGKILL it right
    after it reports a unit in `kill_at` ((phase, unit number) pairs). Returns what it did.
    `spawn(cmd, env)` starts it (a Popen, or what behaves like one: bench/gpu_check.py's smoke
    forks it from a process that has imported the engine)."""

    started = time.time()
    session = Session(exec_s=started - t0)
    proc = spawn(cmd, env)
    rss = PeakRss(proc.pid)
    rss.start()
    assert proc.stderr is not None and proc.stdout is not None
    for raw in proc.stderr:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(line, dict):
            continue
        event = line.get("event")
        if event == EngineEvent.REQUEST_COMPLETED:
            session.completed_s = _stamp(line) - t0
        if event in RESTORE_EVENTS:
            session.restore.append({k: v for k, v in line.items() if k not in ("component", "level", "timestamp")})
            if event == EngineEvent.REQUEST_OPENED:
                session.opened_s = _stamp(line) - started
        phase = UNIT_EVENTS.get(str(event))
        if phase is None:
            continue
        if session.first_unit_s is None:
            session.first_unit_s = _stamp(line) - started
        unit = int(line.get("block") or line.get("done") or line.get("step") or 0)
        if kill_at and (phase, unit) in kill_at:
            proc.kill()  # SIGKILL: the power cut
            session.killed_at = (phase, unit)
            break
    out = proc.stdout.read()
    proc.wait()
    session.peak_rss = rss.stop()
    session.ended_s = time.time() - t0
    if session.killed_at is None:
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode})")
        session.answer = json.loads(out.strip().splitlines()[-1])
    return session


def infer_cmd(model: str, images: list[str], prompt: str, args, policy: str, ckpt: str) -> list[str]:
    cmd = [sys.executable, "-m", "common.cli", "infer", "--model", model, "--prompt", prompt, "--ckpt-dir", ckpt]
    for image in images:
        cmd += ["--image", image]
    cmd += ["--max-new-tokens", str(args.new_tokens), "--policy", policy, "--threads", str(args.threads)]
    cmd += ["--chunk", str(args.chunk), "--group", str(args.group), "--decode-every", str(args.decode_every)]
    cmd += ["--vision-every", str(args.vision_every), "--cadence", args.cadence, "--planner", args.planner]
    # bench/gpu_check.py runs these on CUDA in bf16; this bench leaves both to the engine's defaults
    for option in ("device", "dtype"):
        if getattr(args, option, None):
            cmd += [f"--{option}", getattr(args, option)]
    return cmd + ["--json", "--log-level", "debug"]


def _env(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def units_per_phase(model_dir: str, prompt_tokens: int, args) -> dict[str, int]:
    """Units of work per phase, as the engine reports them: vision blocks, prefill blocks (groups x
    chunks), decode steps (the first token comes with prefill)."""
    spec = spec_from_dir(model_dir)
    chunks = math.ceil(prompt_tokens / args.chunk)
    groups = math.ceil(spec.text.layers / args.group)
    return {"vision": spec.vision.depth, "prefill": groups * chunks, "decode": max(1, args.new_tokens - 1)}


def unit_seconds(none_run: dict, model_dir: str, prompt_tokens: int, args) -> dict[str, float]:
    """This machine's compute per unit of work, from a run with no checkpoints: per vision block,
    per decoder layer x prefill chunk (the simulator's prefill unit), per decode step."""
    spec = spec_from_dir(model_dir)
    chunks = math.ceil(prompt_tokens / args.chunk)
    phase = none_run["phase_seconds"]
    return {
        "vision": phase["vision"] / spec.vision.depth,
        "prefill": phase["prefill"] / (spec.text.layers * chunks),
        "decode": phase["decode"] / max(1, args.new_tokens - 1),
    }


def write_rate(directory: str, nbytes: int = 256 << 20) -> float:
    """This disk's durable write rate (bytes/s): one file written and fsynced."""
    path = os.path.join(directory, "write-rate.tmp")
    block = os.urandom(4 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return nbytes / seconds


def platform_for(units: dict[str, float], boot_s: float, latency: float, write_bps: float) -> Platform:
    """This machine as the simulator's platform: unpaced compute at the measured unit times, this
    disk (its commit latency and write rate; reads at the testbench platform's native rate)."""
    return testbench_platform(
        0.0,
        read_mbps=None,
        write_mbps=None,
        boot_s=boot_s,
        first_start_s=0.0,
        setup_s=0.0,
        commit_latency_s=latency,
        native_write_bytes_per_s=write_bps,
        unit_s=units,
    )


def predict(model: str, request, platform: Platform, sessions: list[Session], args) -> dict:
    """The simulator's end-to-end time for the request run in `sessions`: the same windows (each
    process from its exec to its kill, the last one open) and each process's own boot."""
    geometry = Geometry(args.chunk, args.group, args.decode_every, args.vision_every)
    windows = [(s.exec_s, s.ended_s if s.killed_at else math.inf) for s in sessions]
    platform.boot_by_power_up = {s.exec_s: s.opened_s for s in sessions if s.opened_s is not None}
    spec = spec_from_dir(model)
    outcome = RequestModel(spec, request, platform, "orbitweaver", geometry, planner=args.planner).run(windows, 0.0)
    return {"completed": outcome.completed, "e2e_s": outcome.finished_at, "cuts": outcome.cuts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.real_size",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--size", default="qwen3-vl-2b", choices=("qwen3-vl-2b", "qwen3-vl-8b", "small"))
    ap.add_argument("--model", default=None, help="model directory (default: build --size in runs/models)")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="request length, images included (2048)")
    ap.add_argument("--image-side", type=int, default=768, help="each of the two images, in pixels (768)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the engine (1)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--decode-every", type=int, default=4)
    ap.add_argument("--vision-every", type=int, default=4)
    ap.add_argument("--cadence", default="fixed", choices=("fixed", "adaptive"))
    ap.add_argument("--planner", default="optimal")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "real-size"))
    ap.add_argument("--json", metavar="PATH", help="also write the results to PATH (make bench's report part)")
    ap.add_argument("--summary", metavar="JSON", help="print the summary of an earlier run's real-size.json and exit")
    args = ap.parse_args(argv)
    if args.summary:
        for line in summary(json.loads(Path(args.summary).read_text())):
            print(line)
        return 0
    # a SIGTERM unwinds like Ctrl-C (the child in flight is killed with the bench's process group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.prompt_tokens % args.chunk:
        ap.error("--prompt-tokens must be a multiple of --chunk (whole chunks: one compute rate per layer x chunk)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda line: print(line, flush=True)  # noqa: E731

    model = args.model or ensure_model(args.size)
    images = ensure_images(2, args.image_side)
    prompt, visual, text = fit_prompt(model, images, args.prompt_tokens)
    weights = sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
    say(f"model {model} ({weights / 2**30:.2f} GiB of weights); {visual} image + {text} text tokens; {machine_load()}")
    scratch = Path(tempfile.mkdtemp(prefix="real-size-", dir=out))
    env = _env(args)
    units = units_per_phase(model, args.prompt_tokens, args)
    results: dict = {"args": vars(args), "weights_bytes": weights, "visual_tokens": visual, "text_tokens": text}
    results["units_per_phase"] = units

    def platform_run(tag: str) -> dict:
        t0 = time.time()
        s = infer_session(infer_cmd(model, images, prompt, args, "none", str(scratch / f"none-{tag}")), env, t0)
        assert s.answer is not None
        rates = unit_seconds(s.answer, model, args.prompt_tokens, args)
        say(
            f"platform ({tag}, {machine_load()}): "
            + ", ".join(f"{p} {v * 1000:.1f} ms/unit" for p, v in rates.items())
            + f"; ow infer --policy none {s.ended_s:.1f} s"
        )
        return {"unit_s": rates, "phase_seconds": s.answer["phase_seconds"], "wall_s": s.ended_s}

    # 1. this machine's compute, and its disk
    platforms = {"before": platform_run("before")}
    latency = simval.commit_latency(str(scratch))
    write_bps = write_rate(str(scratch))
    say(f"disk: commit {latency * 1000:.2f} ms, durable write {write_bps / 1e6:.0f} MB/s")

    # 2. uninterrupted
    t0 = time.time()
    ref = infer_session(infer_cmd(model, images, prompt, args, "orbitweaver", str(scratch / "whole")), env, t0)
    assert ref.answer is not None
    a = ref.answer
    say(
        f"uninterrupted ({machine_load()}): {ref.ended_s:.1f} s (boot {ref.opened_s:.1f} s); phases "
        + ", ".join(f"{p} {a['phase_seconds'].get(p, 0.0):.2f} s" for p in PHASES)
        + f"; {a['bytes_written'] / 2**20:.0f} MiB in {a['records_written']} records; "
        f"peak RSS {ref.peak_rss / 2**30:.2f} GiB ({ref.peak_rss / weights:.2f}x the weights)"
    )

    # 3. killed twice in every phase
    kill_at = {(p, max(1, round(units[p] * f))) for p in PHASES for f in (1 / 3, 2 / 3)}
    sessions: list[Session] = []
    t0 = time.time()
    cmd = infer_cmd(model, images, prompt, args, "orbitweaver", str(scratch / "cut"))
    while True:
        s = infer_session(cmd, env, t0, kill_at)
        sessions.append(s)
        opened = next((r for r in s.restore if r.get("event") == EngineEvent.REQUEST_OPENED), {})
        say(
            f"  process {len(sessions)}: boot {s.opened_s or 0:.1f} s, opened {opened.get('status')} at "
            f"{opened.get('phase')} {opened.get('position')}, "
            + (f"killed after {s.killed_at[0]} unit {s.killed_at[1]}" if s.killed_at else "finished")
            + f" at {s.ended_s:.1f} s"
        )
        if s.killed_at is None:
            break
        kill_at.discard(s.killed_at)
        if len(sessions) > 3 * len(PHASES) * 2 + 3:
            raise SystemExit("the request did not finish after every kill was spent")
    final = sessions[-1].answer
    assert final is not None
    bitwise = final["token_ids"] == a["token_ids"] and final["logits_sha256"] == a["logits_sha256"]
    say(f"killed {sum(1 for s in sessions if s.killed_at)} times: answer bitwise equal to uninterrupted: {bitwise}")
    platforms["after"] = platform_run("after")
    shutil.rmtree(scratch, ignore_errors=True)

    # 4. the simulator beside both
    request = simval.RequestShapes(model)(
        [(os.path.basename(p), Path(p).read_bytes()) for p in images], prompt, args.new_tokens
    )
    sim: dict = {}
    for tag, plat in platforms.items():
        sim[tag] = {
            "uninterrupted": predict(
                model, request, platform_for(plat["unit_s"], ref.opened_s or 0, latency, write_bps), [ref], args
            ),
            "killed": predict(
                model, request, platform_for(plat["unit_s"], ref.opened_s or 0, latency, write_bps), sessions, args
            ),
        }
    results.update(
        platforms=platforms,
        disk={"commit_latency_s": latency, "write_bytes_per_s": write_bps},
        uninterrupted={**a, "session": ref.__dict__},
        killed={"sessions": [s.__dict__ for s in sessions], "bitwise": bitwise, "final": final},
        simulated=sim,
    )
    (out / "real-size.json").write_text(json.dumps(results, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    for line in summary(results):
        say(line)
    say(f"written: {out / 'real-size.json'}")
    return 0 if bitwise else 1


def _band(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if abs(hi - lo) < 0.05 else f"{lo:.1f}-{hi:.1f}"


def summary(results: dict) -> list[str]:
    whole, killed, sim = results["uninterrupted"], results["killed"], results["simulated"]
    lines = [
        "",
        "== Real size on this CPU (seconds; the simulator's band over the platform measured before and after) ==",
    ]
    # measured to the engine's request_completed (the interpreter's exit after it is no work the
    # simulator models)
    for name, measured in (
        ("uninterrupted", whole["session"]["completed_s"]),
        ("killed", killed["sessions"][-1]["completed_s"]),
    ):
        predicted = [sim[tag][name]["e2e_s"] for tag in sim if sim[tag][name]["e2e_s"] is not None]
        errors = [p / measured - 1 for p in predicted]
        err = ", ".join(f"{e * 100:+.1f} %" for e in errors) or "does not finish"
        lines.append(
            f"{name:14} measured {measured:7.1f}   simulator {_band(predicted) if predicted else '-':>11}   ({err})"
        )
    lines.append(f"bitwise after {sum(1 for s in killed['sessions'] if s['killed_at'])} kills: {killed['bitwise']}")
    for i, s in enumerate(killed["sessions"][1:], start=2):
        plans = [r for r in s["restore"] if r.get("event") != EngineEvent.REQUEST_OPENED]
        opened: dict = next((r for r in s["restore"] if r.get("event") == EngineEvent.REQUEST_OPENED), {})
        lines.append(
            f"  restart {i - 1}: resumed in {opened.get('phase')} at {opened.get('position')}; boot "
            f"{s['opened_s']:.1f} s, first unit {s['first_unit_s'] or 0:.1f} s after exec; "
            + "; ".join(json.dumps({k: v for k, v in r.items() if k not in ("task_id",)}) for r in plans)
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
