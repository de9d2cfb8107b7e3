"""Engine benchmark: the cost of crash-consistent checkpointing on an uninterrupted request.

Runs the same request with `--policy none` and `--policy orbitweaver` side by side (alternating,
each in a fresh process so peak memory is per run), on the `small` model (~100 M parameters,
>= 1,024 prompt tokens with four images), and prints:

    wall time of each, and the ratio orbitweaver / none (paper: < 5 % overhead)
    bytes written, and checkpoint write throughput against `dd` on the same disk
    peak resident memory of each, and the difference in units of one prefill block's state

CPU timings on this machine, not Jetson timings: read the ratios, not the seconds.

    python -m bench.engine_overhead [--rounds 3] [--size small] [--out runs/bench/engine.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

from flight.checkpoint.policies import Geometry

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def ensure_model(size: str, arch: str = "qwen3-vl") -> str:
    path = os.path.join(ROOT, "runs", "models", f"{arch}-{size}-bf16")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        # lazy: torch/transformers (seconds): the parent only spawns and times the children
        from flight.model.tiny import build_tiny

        print(f"building the {size} model in {path} ...", file=sys.stderr)
        build_tiny(arch, size, 0, path, dtype="bfloat16")
    return path


def ensure_images(n: int, side: int) -> list[str]:
    d = os.path.join(ROOT, "runs", "bench-images")
    os.makedirs(d, exist_ok=True)
    paths = []
    for i in range(n):
        p = os.path.join(d, f"scene{i}-{side}.png")
        if not os.path.exists(p):
            rng = np.random.default_rng(i)
            y, x = np.mgrid[0:side, 0:side]
            base = np.stack([(x * (i + 1)) % 256, (y * (i + 2)) % 256, ((x + y) * 3) % 256], -1)
            img = (base + rng.normal(0, 20, base.shape)).clip(0, 255).astype("uint8")
            Image.fromarray(img).save(p)
        paths.append(p)
    return paths


def worker(args) -> None:
    """One request in this process; prints one JSON line."""
    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    import torch

    # lazy: torch/transformers (seconds): the parent only spawns and times the children
    from flight.engine import Engine, EngineOptions
    from flight.model.inputs import inputs_from_files
    from flight.model.loader import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    inputs = inputs_from_files(model, args.image, args.prompt)
    geometry = Geometry(
        chunk=args.chunk, group=args.group, decode_every=args.decode_every, vision_every=args.vision_every
    )
    start = time.perf_counter()
    result = Engine(model, EngineOptions(geometry=geometry, policy=args.policy)).run(
        inputs, args.ckpt_dir, args.max_new_tokens
    )
    wall = time.perf_counter() - start
    cfg = model.adapter.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = model.dtype.itemsize
    block_bytes = (
        geometry.group * 2 * cfg.num_key_value_heads * head_dim * geometry.chunk * item
        + geometry.chunk * cfg.hidden_size * item
    )
    print(
        json.dumps(
            {
                "policy": args.policy,
                "wall_s": wall,
                "bytes_written": result.bytes_written,
                "records": result.records_written,
                "phase_seconds": result.phase_seconds,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "prompt_tokens": inputs.num_tokens,
                "block_state_bytes": block_bytes,
                "token_ids": result.token_ids,
                "write_s": result.write_seconds,
                "held_state_peak_bytes": result.held_state_peak_bytes,
            }
        )
    )


def dd_write_throughput(directory: str, mib: int = 256) -> float:
    path = os.path.join(directory, "dd.bin")
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mib // 4}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return mib * 2**20 / elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--image-side", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--decode-every", type=int, default=8)
    p.add_argument("--vision-every", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "engine_overhead.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--image", action="append", help=argparse.SUPPRESS)
    p.add_argument(
        "--prompt",
        default="describe every change between these four scenes and count the ships "
        "near the coast , then list the damaged buildings",
    )
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    model = ensure_model(args.size)
    images = ensure_images(args.images, args.image_side)
    runs: dict[str, list[dict]] = {"none": [], "orbitweaver": []}
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "runs")) as scratch:
        dd = dd_write_throughput(scratch)
        for r in range(args.rounds):
            order = ["none", "orbitweaver"] if r % 2 == 0 else ["orbitweaver", "none"]
            for policy in order:
                ckpt = os.path.join(scratch, f"{policy}-{r}")
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.engine_overhead",
                    "--worker",
                    "--policy",
                    policy,
                    "--model",
                    model,
                    "--prompt",
                    args.prompt,
                    "--ckpt-dir",
                    ckpt,
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                    "--chunk",
                    str(args.chunk),
                    "--group",
                    str(args.group),
                    "--decode-every",
                    str(args.decode_every),
                    "--vision-every",
                    str(args.vision_every),
                    "--threads",
                    str(args.threads),
                ]
                for im in images:
                    cmd += ["--image", im]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
                runs[policy].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}/{args.rounds} {policy:12s} {runs[policy][-1]['wall_s']:.2f} s", file=sys.stderr)
    none, ow = runs["none"], runs["orbitweaver"]
    assert all(x["token_ids"] == none[0]["token_ids"] for x in none + ow), "policies disagree on the answer"
    med = {k: statistics.median(x["wall_s"] for x in v) for k, v in runs.items()}
    ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(none, ow, strict=True)]
    written = ow[0]["bytes_written"]
    ckpt_write_s = max(ow[0]["write_s"], 1e-9)
    rss = {k: statistics.median(x["peak_rss_bytes"] for x in v) for k, v in runs.items()}
    block = ow[0]["block_state_bytes"]
    # What checkpointing itself keeps alive (exact, from the writer), per phase and at most over runs.
    held = {ph: max(x["held_state_peak_bytes"].get(ph, 0) for x in ow) for ph in ("vision", "prefill", "decode")}
    report = {
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "note": "CPU timings, not Jetson timings"},
        "model": os.path.basename(model),
        "prompt_tokens": ow[0]["prompt_tokens"],
        "geometry": {
            "chunk": args.chunk,
            "group": args.group,
            "decode_every": args.decode_every,
            "vision_every": args.vision_every,
        },
        "wall_s_median": med,
        "overhead_ratio_median": statistics.median(ratios),
        "overhead_ratios": ratios,
        "bytes_written": written,
        "dd_write_bytes_per_s": dd,
        "checkpoint_write_bytes_per_s": written / ckpt_write_s,
        "peak_rss_bytes": rss,
        "peak_rss_delta_bytes": rss["orbitweaver"] - rss["none"],
        "block_state_bytes": block,
        "peak_rss_delta_blocks": (rss["orbitweaver"] - rss["none"]) / block,
        "held_state_peak_bytes": held,
        "held_state_peak_blocks": {ph: n / block for ph, n in held.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"\nEngine checkpoint overhead ({report['model']}, {report['prompt_tokens']} prompt tokens, "
        f"C={args.chunk} G={args.group} D={args.decode_every}; CPU timings, ratios are what matter)"
    )
    print(f"  wall, median of {args.rounds}:   none {med['none']:.2f} s   orbitweaver {med['orbitweaver']:.2f} s")
    print(
        f"  orbitweaver / none:      {report['overhead_ratio_median']:.3f}  (per round: "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; paper: < 1.05, stretch < 1.03)"
    )
    print(f"  bytes written:           {written / 2**20:.1f} MiB in {ow[0]['records']} records")
    print(
        f"  write throughput:        checkpoints {report['checkpoint_write_bytes_per_s'] / 2**20:.0f} MiB/s "
        f"(write+fsync+rename, background thread)   dd conv=fsync {dd / 2**20:.0f} MiB/s   "
        f"ratio {report['checkpoint_write_bytes_per_s'] / dd:.2f}"
    )
    print(
        f"  peak RSS:                none {rss['none'] / 2**20:.0f} MiB   orbitweaver "
        f"{rss['orbitweaver'] / 2**20:.0f} MiB"
        f"   delta {report['peak_rss_delta_bytes'] / 2**20:+.1f} MiB = {report['peak_rss_delta_blocks']:+.2f} "
        f"blocks of {block / 2**20:.2f} MiB (median of the runs; allocator noise is a few MiB)"
    )
    print(
        "  state held by checkpointing, peak: "
        + "   ".join(f"{ph} {n / 2**20:.2f} MiB ({n / block:.2f} blocks)" for ph, n in held.items())
        + "   (goal <= 2 blocks)"
    )
    print(f"  report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
