"""`ow model ...` and `ow infer ...` (and `ow flight ...` from flight.runtime).

Heavy imports (torch, transformers) happen inside the command functions so `ow --help` is fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_OK, EXIT_USAGE, EXIT_MODEL, EXIT_INPUT = 0, 2, 3, 4


def register(sub) -> None:
    model = sub.add_parser(
        "model",
        help="build and inspect model directories",
        description="Build local model directories with seeded random weights, or inspect one.",
    )
    msub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    msub.required = True
    build = msub.add_parser(
        "build-tiny",
        help="write a complete model directory with random weights",
        description="Write config.json, model.safetensors, tokenizer and image-processor config for a "
        "Qwen3-VL or Qwen2.5-VL model with seeded random weights. The directory loads exactly "
        "like a downloaded checkpoint.",
    )
    build.add_argument("--arch", choices=["qwen3-vl", "qwen2.5-vl"], default="qwen3-vl")
    build.add_argument(
        "--size",
        choices=["tiny", "small", "qwen3-vl-2b", "qwen3-vl-8b"],
        default="tiny",
        help="tiny: ~1M parameters (tests); small: ~100M (benchmarks); qwen3-vl-2b/8b: the real "
        "dimensions (needs tens of GB of RAM)",
    )
    build.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    build.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    build.add_argument("--out", required=True, help="output directory (created)")
    build.set_defaults(func=cmd_build_tiny)
    info = msub.add_parser(
        "info",
        help="describe a model directory",
        description="Print architecture, sizes and content hash of a model directory.",
    )
    info.add_argument("model", help="model directory")
    info.set_defaults(func=cmd_model_info)

    infer = sub.add_parser(
        "infer",
        help="run one VLM request, resumably",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one vision-language request with crash-consistent checkpoints in --ckpt-dir.\n"
        "Run the same command again after a power cut (SIGKILL, reboot) and it continues from\n"
        "the last checkpoint; the answer is bitwise the one an uninterrupted run gives.\n"
        "Once a request has completed, the same command prints the stored result.",
        epilog="Logs are JSON lines on stderr; the answer goes to stdout (text, or one JSON object with --json).\n"
        "Exit status: 0 done, 2 bad arguments, 3 unusable model directory, 4 bad input (image, prompt).",
    )
    infer.add_argument("--model", required=True, help="local model directory (tiny-built or a real checkpoint)")
    infer.add_argument(
        "--image", action="append", default=[], metavar="PNG", help="input image; repeat for several (order matters)"
    )
    infer.add_argument("--prompt", required=True, help="the question or instruction")
    infer.add_argument("--max-new-tokens", type=int, default=32, help="answer length limit (default 32)")
    infer.add_argument("--ckpt-dir", required=True, help="this request's checkpoint directory")
    add_engine_arguments(infer)
    infer.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    infer.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    infer.set_defaults(func=cmd_infer)

    import importlib.util

    if importlib.util.find_spec("flight.runtime.cli") is not None:
        from flight.runtime import cli as runtime_cli

        runtime_cli.register(sub)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    from flight.checkpoint.policies import POLICIES

    g = p.add_argument_group("engine")
    g.add_argument(
        "--policy",
        default="orbitweaver",
        choices=sorted(POLICIES),
        help="checkpoint policy (default orbitweaver; none = no checkpoints)",
    )
    g.add_argument("--chunk", type=int, default=1024, metavar="C", help="prompt tokens per prefill chunk (1024)")
    g.add_argument("--group", type=int, default=4, metavar="G", help="decoder layers per prefill block (4)")
    g.add_argument("--decode-every", type=int, default=16, metavar="D", help="decode steps per record (16)")
    g.add_argument("--vision-every", type=int, default=4, metavar="K", help="vision blocks per vision checkpoint (4)")
    g.add_argument("--planner", default="chunk-first", help="recovery planner (chunk-first, layer-first, ...)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: the checkpoint's)",
    )
    g.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation (sdpa)")
    g.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's; pinned per request)")
    g.add_argument(
        "--decode-kv-compression",
        choices=["none", "int8"],
        default="none",
        help="int8: quantise the KV in decode checkpoints (smaller, faster decode-phase recovery). "
        "GIVES UP BITWISE IDENTITY: after a resume in decode the answer may differ from an "
        "uninterrupted run. Off by default",
    )
    g.add_argument(
        "--emulate-read-mbps",
        type=float,
        default=None,
        metavar="MB/S",
        help="throttle checkpoint reads to this bandwidth (emulate a target's storage)",
    )
    g.add_argument(
        "--emulate-weight-read-mbps",
        type=float,
        default=None,
        metavar="MB/S",
        help="throttle model weight reads to this bandwidth (emulate a target's storage)",
    )
    g.add_argument(
        "--emulate-write-mbps",
        type=float,
        default=None,
        metavar="MB/S",
        help="throttle checkpoint writes to this bandwidth (emulate a target's storage)",
    )
    g.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="stretch each block/step to at least this many ms (emulates a slower payload)",
    )
    g.add_argument(
        "--cadence",
        choices=["fixed", "adaptive"],
        default="fixed",
        help="fixed: a decode record every D steps, a vision state every K blocks (the paper's); "
        "adaptive: also a record early when a cut is likely before the next one, from bus "
        "warnings, telemetry trends and the window lengths seen since launch (orbitweaver only; "
        "docs/engine.md)",
    )
    g.add_argument(
        "--thermal-limit-c",
        type=float,
        default=None,
        metavar="C",
        help="adaptive cadence: payload temperature at which the bus cuts (default 55)",
    )
    g.add_argument(
        "--soc-cutoff",
        type=float,
        default=None,
        metavar="FRACTION",
        help="adaptive cadence: battery state of charge at which the bus cuts (default 0.40)",
    )


def engine_options(args):
    from common.cli import CliError
    from flight.checkpoint.policies import Geometry
    from flight.recovery.plan import PLANNERS

    for name in ("chunk", "group", "decode_every", "vision_every"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1", EXIT_USAGE)
    if args.planner not in PLANNERS:
        raise CliError(f"unknown --planner {args.planner!r}; choose from {', '.join(sorted(PLANNERS))}", EXIT_USAGE)
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be at least 1", EXIT_USAGE)
    if args.cadence == "adaptive" and args.policy != "orbitweaver":
        raise CliError(
            f"--cadence adaptive is orbitweaver's; the {args.policy} baseline keeps the cadence its "
            f"definition gives (docs/baselines.md)",
            EXIT_USAGE,
        )
    if args.soc_cutoff is not None and not 0 <= args.soc_cutoff <= 1:
        raise CliError("--soc-cutoff must be a fraction between 0 and 1", EXIT_USAGE)
    from flight.options import EngineOptions

    return EngineOptions(
        geometry=Geometry(args.chunk, args.group, args.decode_every, args.vision_every),
        policy=args.policy,
        planner=args.planner,
        pace_ms=args.pace_ms,
        threads=args.threads,
        decode_kv_compression=args.decode_kv_compression,
        cadence=args.cadence,
    )


def cadence_for(args, windows: list[float] | None = None, started: float | None = None):
    """The cadence of a process run with these arguments (limits from the command line)."""
    from flight.checkpoint import cadence as c

    return c.Cadence(
        args.cadence,
        windows,
        started=started,
        thermal_limit_c=c.DEFAULT_THERMAL_LIMIT_C if args.thermal_limit_c is None else args.thermal_limit_c,
        soc_cutoff=c.DEFAULT_SOC_CUTOFF if args.soc_cutoff is None else args.soc_cutoff,
    )


def storage_for(args):
    """(file layer, weight-read hook): plain, or throttled to emulate a target device's storage."""
    from common.cli import CliError
    from common.durable import DurableFS, ThrottledFS, TokenBucket

    read, write = getattr(args, "emulate_read_mbps", None), getattr(args, "emulate_write_mbps", None)
    weights = getattr(args, "emulate_weight_read_mbps", None)
    for name, value in (
        ("--emulate-read-mbps", read),
        ("--emulate-write-mbps", write),
        ("--emulate-weight-read-mbps", weights),
    ):
        if value is not None and value <= 0:
            raise CliError(f"{name} must be positive", EXIT_USAGE)
    fs = (
        DurableFS()
        if read is None and write is None
        else ThrottledFS(read * 1e6 if read else None, write * 1e6 if write else None)
    )
    hook = TokenBucket(weights * 1e6).take if weights else None
    return fs, hook


def cmd_build_tiny(args) -> int:
    from common.cli import CliError
    from flight.model.tiny import build_tiny

    try:
        summary = build_tiny(args.arch, args.size, args.seed, args.out, args.dtype)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(json.dumps(summary, indent=2))
    return EXIT_OK


def cmd_model_info(args) -> int:
    from common.cli import CliError
    from flight.model.loader import ModelError, load_model

    try:
        m = load_model(args.model, device="cpu")
    except ModelError as exc:
        raise CliError(str(exc), EXIT_MODEL) from None
    params = sum(p.numel() for p in m.model.parameters())
    print(
        json.dumps(
            {
                "path": m.model_dir,
                "arch": m.model_type,
                "dtype": str(m.dtype).removeprefix("torch."),
                "parameters": params,
                "layers": m.adapter.num_layers,
                "vision_blocks": m.adapter.num_vision_blocks,
                "hidden": m.adapter.text_config.hidden_size,
                "content_hash": m.content_hash,
            },
            indent=2,
        )
    )
    return EXIT_OK


def cmd_infer(args) -> int:
    from common import log as owlog
    from common.cli import CliError

    owlog.setup(args.log_level, component="infer")
    logger = owlog.get()
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1", EXIT_USAGE)
    options = engine_options(args)
    for path in args.image:
        if not os.path.isfile(path):
            raise CliError(f"image not found: {path}", EXIT_INPUT)
    if os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
        raise CliError(f"--ckpt-dir exists and is not a directory: {args.ckpt_dir}", EXIT_USAGE)

    import torch

    from flight.engine import Engine
    from flight.model.inputs import InputError, build_inputs, load_image
    from flight.model.loader import ModelError, load_model

    if options.threads:
        torch.set_num_threads(options.threads)
    from common.imagecheck import ProcessorLimits

    try:  # decoded as the payload decodes uploads, before the model loads: bad input fails fast
        images = [load_image(p, ProcessorLimits.of_model_dir(args.model)) for p in args.image]
    except InputError as exc:
        raise CliError(str(exc), EXIT_INPUT) from None
    fs, weight_hook = storage_for(args)
    try:
        model = load_model(
            args.model, device=args.device, dtype=args.dtype, attn_implementation=args.attn, read_hook=weight_hook
        )
    except ModelError as exc:
        raise CliError(str(exc), EXIT_MODEL) from None
    try:
        inputs = build_inputs(model.tokenizer, model.image_processor, images, args.prompt, model.adapter.image_token_id)
    except (InputError, ValueError) as exc:
        raise CliError(f"bad input: {exc}", EXIT_INPUT) from None

    def events(name, **fields):
        level = (
            "debug"
            if name in ("checkpoint_committed", "decode_step_done", "vision_block_done", "prefill_block_done")
            else "info"
        )
        getattr(logger, level)(name, **fields)

    logger.info(
        "engine_started",
        model=model.model_dir,
        arch=model.model_type,
        device=model.device.type,
        prompt_tokens=inputs.num_tokens,
        images=len(images),
        policy=options.policy,
    )
    result = Engine(model, options, fs=fs, events=events).run(inputs, args.ckpt_dir, args.max_new_tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": result.token_ids,
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "resumed": result.resumed,
                    "resumed_from": result.resumed_from,
                    "restarted_reason": result.restarted_reason,
                    "bytes_written": result.bytes_written,
                    "records_written": result.records_written,
                    "records_skipped": result.records_skipped,
                    "records_deferred": result.records_deferred,
                    "held_state_peak_bytes": result.held_state_peak_bytes,
                    "phase_seconds": result.phase_seconds,
                    "logits_sha256": result.logits_sha256(),
                    "prompt_tokens": inputs.num_tokens,
                    "plan": result.plan,
                }
            )
        )
    else:
        print(result.text)
    sys.stdout.flush()
    return EXIT_OK
