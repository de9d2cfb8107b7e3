"""The GPU check: what a lent GPU should measure, in one run of at most --budget-s seconds.

Specified in docs/benchmarks.md ("The GPU check"). On CUDA, for Qwen3-VL-2B's dimensions (random
weights, bf16) and requests of 8K and 32K tokens (two images sized to bring the request there, the
text the rest: an uplink's prompt is at most 8,192 bytes):

  interrupted   `ow infer --policy orbitweaver` uninterrupted, then SIGKILLed once in every phase
                (the middle unit of vision, prefill and decode) and run again after each kill, as
                a payload reboots; the answer bitwise equal to the uninterrupted one (tokens and
                the SHA-256 of every step's logits). bench/real_size.py's processes and kills.
  overhead      the same request with `--policy none`: phase times and bytes written against it
  plans         the checkpoint cut mid-prefill, resumed with each planner (chunk-first,
                layer-first, optimal): the engine's recovery plan and restore events, and exec to
                the first unit of new work

  vla           the VLA backend of the device (CUDA streams and green contexts) running the real
                models' lockstep plans, recorded as a measured lockstep table (docs/vla.md,
                "Measured lockstep tables"; --vla-profile-out): each stage alone per batch size,
                every VLM/ADiT pair (cross-model too) under every VLM share; `ow vla bench
                --profile FILE` runs the paper's experiments from it

A stage that would start past --budget-s is skipped and named in the JSON. `--cpu-smoke` runs the
same stages on CPU with the tiny model and a 256-token request, so that the script is known to
work before a GPU sees it (tests/bench/test_gpu_check.py, in make test); it imports the engine
once and forks its runs from there (ForkedProcess), where on CUDA each run is a fresh process.

    python -m bench.gpu_check [--budget-s 480] [--out runs/bench/gpu_check.json]
                              [--vla-profile-out runs/bench/vla_profile.json]
    python -m bench.gpu_check --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import real_size
from bench.engine_overhead import ensure_images, ensure_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLANNERS = ("chunk-first", "layer-first", "optimal")

#: (requests as (prompt tokens, image side in px), model size, device, dtype, engine geometry)
GPU: dict[str, Any] = {
    # the 2B processor: (side / 32)^2 tokens per image; 2 x 2,016 px = 7,938, 2 x 4,064 px = 32,258
    "requests": [(8192, 2016), (32768, 4064)],
    "size": "qwen3-vl-2b",
    "device": "cuda",
    "dtype": "bfloat16",
    "engine": {"chunk": 2048, "group": 4, "decode_every": 4, "vision_every": 4, "new_tokens": 32},
    # the lockstep table: both architectures, cross-model pairs, the derived profiles' share candidates
    "vla": {
        "archs": ("pi0", "smolvla"),
        "batch_sizes": (1, 2, 4),
        "repeats": 5,
        "shares": (0.25, 0.375, 0.5, 0.625, 0.75, 0.875),
    },
}
SMOKE: dict[str, Any] = {
    "requests": [(256, 224)],
    "size": "tiny",
    "device": "cpu",
    "dtype": "bfloat16",
    "engine": {"chunk": 64, "group": 2, "decode_every": 2, "vision_every": 1, "new_tokens": 8},
    "vla": {"archs": ("smolvla",), "batch_sizes": (1,), "repeats": 1, "shares": (0.5,)},
}


class ForkedProcess:
    """`ow infer` forked from this process, which has imported torch, transformers and the engine
    already (the CPU smoke's runs, without each paying the imports again): a real process, with
    its own output pipes, killed with a real SIGKILL; what bench/real_size.py's infer_session
    reads of a Popen. Never on CUDA (a forked child cannot use a CUDA its parent initialised)."""

    def __init__(self, cmd: list[str], env: dict):
        argv = cmd[cmd.index("common.cli") + 1 :]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: ow infer, then out without the parent's exit handlers
            code = 1
            try:
                os.close(out_r)
                os.close(err_r)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                os.environ.clear()
                os.environ.update(env)
                from common.cli import main as ow

                code = ow(argv)
            except BaseException:  # noqa: BLE001 - the child reports and leaves, whatever happened
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.stdout = os.fdopen(out_r, "r")
        self.stderr = os.fdopen(err_r, "r")
        self.returncode: int | None = None

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            self.stdout.close()
            self.stderr.close()
        return self.returncode


def preload_engine() -> None:
    """What `ow infer` imports before its first unit, imported once here so that forked runs
    start from it (the smoke measures nothing of the boot)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: F401

    import flight.cli  # noqa: F401
    import flight.engine.request  # noqa: F401
    import flight.model.loader  # noqa: F401


def engine_args(setup: dict, planner: str = "optimal") -> SimpleNamespace:
    """What bench/real_size.py's infer_cmd reads, with the device and dtype of this run."""
    e = setup["engine"]
    return SimpleNamespace(
        new_tokens=e["new_tokens"],
        threads=1,
        chunk=e["chunk"],
        group=e["group"],
        decode_every=e["decode_every"],
        vision_every=e["vision_every"],
        cadence="fixed",
        planner=planner,
        device=setup["device"],
        dtype=setup["dtype"],
    )


def _answer_key(answer: dict) -> tuple:
    return (answer["token_ids"], answer["logits_sha256"])


def interrupted(model: str, images: list[str], prompt: str, tokens: int, setup: dict, scratch: Path, spawn) -> dict:
    """Uninterrupted, --policy none, then killed once in every phase: bitwise, overhead, and the
    checkpoint directory as the prefill kill left it (for the plans stage)."""
    args = engine_args(setup)
    env = real_size._env(args)
    t0 = time.time()
    none = real_size.infer_session(
        real_size.infer_cmd(model, images, prompt, args, "none", str(scratch / "none")), env, t0, spawn=spawn
    )
    whole = real_size.infer_session(
        real_size.infer_cmd(model, images, prompt, args, "orbitweaver", str(scratch / "whole")), env, t0, spawn=spawn
    )
    assert none.answer is not None and whole.answer is not None
    units = real_size.units_per_phase(model, tokens, args)
    kill_at = {(phase, max(1, units[phase] // 2)) for phase in real_size.PHASES}
    ckpt = scratch / "cut"
    template = scratch / "cut-in-prefill"
    sessions = []
    while True:
        s = real_size.infer_session(
            real_size.infer_cmd(model, images, prompt, args, "orbitweaver", str(ckpt)), env, t0, kill_at, spawn
        )
        sessions.append(s)
        if s.killed_at is None:
            break
        kill_at.discard(s.killed_at)
        if s.killed_at[0] == "prefill":
            shutil.copytree(ckpt, template)
        if len(sessions) > 2 * len(real_size.PHASES) + 2:
            raise SystemExit("the request did not finish after every kill was spent")
    final = sessions[-1].answer
    assert final is not None
    none_s = sum(none.answer["phase_seconds"].get(p, 0.0) for p in real_size.PHASES)
    whole_s = sum(whole.answer["phase_seconds"].get(p, 0.0) for p in real_size.PHASES)
    return {
        "prompt_tokens": tokens,
        "bitwise": _answer_key(final) == _answer_key(whole.answer),
        # the same answer without checkpoints (the engine's arithmetic does not depend on them)
        "none_same_answer": _answer_key(none.answer) == _answer_key(whole.answer),
        "kills": [list(s.killed_at) for s in sessions if s.killed_at],
        "uninterrupted": {
            "phase_seconds": whole.answer["phase_seconds"],
            "bytes_written": whole.answer["bytes_written"],
            "records_written": whole.answer["records_written"],
            "boot_s": whole.opened_s,
            "peak_rss": whole.peak_rss,
        },
        "none": {"phase_seconds": none.answer["phase_seconds"], "boot_s": none.opened_s},
        "overhead": whole_s / none_s - 1 if none_s > 0 else None,
        "restarts": [
            {"boot_s": s.opened_s, "first_unit_s": s.first_unit_s, "killed_at": s.killed_at, "restore": s.restore}
            for s in sessions[1:]
        ],
        "template": str(template) if template.exists() else None,
        "answer": _answer_key(whole.answer),
    }


def plans(model: str, images: list[str], prompt: str, template: str, setup: dict, scratch: Path, spawn) -> list[dict]:
    """The checkpoint cut mid-prefill, resumed with each planner in its own process."""
    rows = []
    for planner in PLANNERS:
        args = engine_args(setup, planner)
        ckpt = scratch / f"resume-{planner}"
        shutil.copytree(template, ckpt)
        s = real_size.infer_session(
            real_size.infer_cmd(model, images, prompt, args, "orbitweaver", str(ckpt)),
            real_size._env(args),
            time.time(),
            spawn=spawn,
        )
        assert s.answer is not None
        rows.append(
            {
                "planner": planner,
                "boot_s": s.opened_s,
                "restore_to_first_unit_s": (s.first_unit_s or 0.0) - (s.opened_s or 0.0),
                "prefill_s": s.answer["phase_seconds"].get("prefill"),
                "restore": s.restore,
                "answer": _answer_key(s.answer),
            }
        )
    return rows


def vla(
    device: str,
    archs: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    repeats: int,
    shares: tuple[float, ...],
    out: Path | None = None,
) -> dict:
    """The VLA backend of this device (common/vla/engine.py select_backend: CUDA streams and green
    contexts on a GPU) running the real models' lockstep plans, recorded as a measured lockstep
    table (docs/vla.md, "Measured lockstep tables"; common/vla/profiler.py measure_profile): each
    stage alone per batch size and every (VLM arch, batch, ADiT arch, batch) pair, cross-model
    ones too, under every VLM share; the median of `repeats` runs after one warm-up. Written to
    `out` (what `ow vla bench --profile` runs from) and summarised in the check's JSON."""
    import torch

    from common.vla.engine import select_backend
    from common.vla.profiler import measure_profile

    backend = select_backend(device, threads=1 if device == "cpu" else None)
    info: dict[str, Any] = {"name": "CPU", "threads": 1}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info = {
            "name": props.name,
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
        }
    try:
        table = measure_profile(
            backend,
            device,
            archs,
            torch.bfloat16 if device == "cuda" else torch.float32,
            batch_sizes,
            shares,
            repeats,
            network_rtt_ms=7.0 if device == "cuda" else 0.0,
            name=f"measured-{device}",
            device_info=info,
            tool="bench/gpu_check.py",
        )
    finally:
        backend.close()
    if out is not None:
        table.save(out)
    return {
        "backend": backend.name,
        "repeats": repeats,
        "table": str(out) if out is not None else None,
        "archs": {a: {"slo_ms": p.slo_ms, "vlm_ms": p.vlm_ms, "adit_ms": p.adit_ms} for a, p in table.archs.items()},
        "lockstep_rows": len(table.locksteps),
    }


def device_info(device: str) -> dict:
    info: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    import torch  # the device's own build: what it is, in the JSON

    info["torch"] = torch.__version__
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-smoke on a CPU machine")
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="every stage on CPU with the tiny model (make test)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="no stage starts past this many seconds (480)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "gpu_check.json"))
    ap.add_argument(
        "--vla-profile-out",
        default=os.path.join(ROOT, "runs", "bench", "vla_profile.json"),
        help="the measured VLA lockstep table (docs/vla.md; ow vla bench --profile FILE runs from it)",
    )
    args = ap.parse_args(argv)
    setup = SMOKE if args.cpu_smoke else GPU
    start = time.monotonic()
    result: dict = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "setup": setup, "stages": {}}
    result["device"] = device_info(setup["device"])
    model = ensure_model(setup["size"])
    # on CUDA each run is a fresh process, its boot measured; the smoke forks them (ForkedProcess)
    spawn = real_size.spawn_process
    if args.cpu_smoke:
        preload_engine()
        spawn = ForkedProcess
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=out.parent))
    ok = True
    try:
        for i, (tokens, side) in enumerate(setup["requests"]):
            name = f"{tokens}-tokens"
            if time.monotonic() - start > args.budget_s:
                result["stages"][name] = {"skipped": "budget"}
                continue
            images = ensure_images(2, side)
            prompt, visual, text = real_size.fit_prompt(model, images, tokens)
            stage_start = time.monotonic()
            work = scratch / name
            work.mkdir()
            stage = interrupted(model, images, prompt, tokens, setup, work, spawn)
            stage["visual_tokens"], stage["text_tokens"] = visual, text
            ok = ok and stage["bitwise"]
            # the plans from the first request's prefill cut (the 32K one would not fit the budget)
            template, answer = stage.pop("template"), stage.pop("answer")
            if i == 0 and template and time.monotonic() - start <= args.budget_s:
                stage["plans"] = plans(model, images, prompt, template, setup, work, spawn)
                for row in stage["plans"]:
                    row["bitwise"] = row.pop("answer") == answer
                    ok = ok and row["bitwise"]
            stage["wall_s"] = time.monotonic() - stage_start
            result["stages"][name] = stage
            shutil.rmtree(work, ignore_errors=True)
            print(
                f"{name}: bitwise {stage['bitwise']}, {len(stage['kills'])} kills, overhead "
                f"{(stage['overhead'] or 0) * 100:.1f} % against --policy none, {stage['wall_s']:.0f} s",
                flush=True,
            )
        if time.monotonic() - start > args.budget_s:
            result["stages"]["vla"] = {"skipped": "budget"}
        else:
            vla_start = time.monotonic()
            result["stages"]["vla"] = vla(setup["device"], **setup["vla"], out=Path(args.vla_profile_out))
            result["stages"]["vla"]["wall_s"] = time.monotonic() - vla_start
            print(f"vla: {result['stages']['vla']['backend']} backend, {result['stages']['vla']['wall_s']:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["wall_s"] = time.monotonic() - start
    result["ok"] = ok
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"written: {out} ({result['wall_s']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
