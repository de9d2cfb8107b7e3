"""`ow model ...` and `ow infer ...` (and `ow flight ...` from flight.runtime.cli).

The options and exit codes `ow infer` shares with `ow flight run` are in flight/cli_options.py.
torch, transformers and the model code are imported inside the command functions that use
them: they take seconds to import, and `ow --help` (every component's parser is built) and
`ow flight run` (which must answer the bus within a fraction of a second) need none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from common import log as owlog
from common.errors import CliError
from common.imagecheck import ProcessorLimits
from common.wire.rules import prompt_rule
from flight.events import UNIT_DONE, EngineEvent
from flight.model.config import ModelError, check_weight_files, read_model_type
from flight.runtime import cli as runtime_cli

from .cli_options import (  # noqa: F401  (EXIT_*: re-exported, the codes `ow infer` documents)
    EXIT_INPUT,
    EXIT_MODEL,
    EXIT_OK,
    EXIT_USAGE,
    add_engine_arguments,
    check_directory_option,
    check_room_for_torch,
    engine_options,
    policy_overrides,
    report_overrides,
    storage_for,
)


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
        "Exit status: 0 done, 2 bad arguments, 3 unusable model directory, 4 bad input (image, prompt),\n"
        "6 out of memory. Errors are one line on stderr.",
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
    runtime_cli.register(sub)


#: the seeds torch's generator takes (torch.manual_seed): a 64-bit integer, signed or not
SEED_RANGE = range(-(2**63), 2**64)


def cmd_build_tiny(args) -> int:
    # Checked before anything is written: a seed torch refuses would leave a half-built directory.
    if args.seed not in SEED_RANGE:
        raise CliError(f"--seed must be a 64-bit integer (-2**63 .. 2**64-1), not {args.seed}", EXIT_USAGE)
    check_directory_option(args.out, "--out")
    from flight.model.tiny import build_tiny  # torch: seconds to import (module docstring)

    try:
        summary = build_tiny(args.arch, args.size, args.seed, args.out, args.dtype)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(json.dumps(summary, indent=2))
    return EXIT_OK


def cmd_model_info(args) -> int:
    from flight.model.loader import load_model  # torch, transformers (module docstring)

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
    owlog.setup(args.log_level, component="infer")
    logger = owlog.get()
    # Every argument is checked before torch is imported and before anything is written.
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1", EXIT_USAGE)
    options = engine_options(args)
    fs, weight_hook = storage_for(args)
    broken = prompt_rule(args.prompt)  # the payload's rule (common/wire/rules.py)
    if broken is not None:
        raise CliError(f"bad input: {broken.reason}", EXIT_INPUT)
    for path in args.image:
        if not os.path.isfile(path):
            raise CliError(f"image not found: {path}", EXIT_INPUT)
    check_directory_option(args.ckpt_dir, "--ckpt-dir")
    try:  # a truncated or damaged weight file: one line now, not a library's error later
        read_model_type(args.model)
        check_weight_files(args.model)
    except ModelError as exc:
        raise CliError(str(exc), EXIT_MODEL) from None
    check_room_for_torch()

    # torch, transformers and the model code: seconds to import (module docstring).
    import torch

    from flight.engine import Engine
    from flight.model.inputs import InputError, build_inputs, load_image
    from flight.model.loader import load_model

    if options.threads:
        torch.set_num_threads(options.threads)
    try:  # decoded as the payload decodes uploads, before the model loads: bad input fails fast
        images = [load_image(p, ProcessorLimits.of_model_dir(args.model)) for p in args.image]
    except InputError as exc:
        raise CliError(str(exc), EXIT_INPUT) from None
    try:
        model = load_model(
            args.model, device=args.device, dtype=args.dtype, attn_implementation=args.attn, read_hook=weight_hook
        )
    except ModelError as exc:
        raise CliError(str(exc), EXIT_MODEL) from None
    report_overrides(
        policy_overrides(args, options, model.adapter.num_layers),
        lambda level, *a, **kw: getattr(logger, level)(*a, **kw),
    )
    try:
        inputs = build_inputs(model.tokenizer, model.image_processor, images, args.prompt, model.adapter.image_token_id)
    except (InputError, ValueError) as exc:
        raise CliError(f"bad input: {exc}", EXIT_INPUT) from None

    def events(event: EngineEvent, **fields: Any) -> None:
        level = "debug" if event == EngineEvent.CHECKPOINT_COMMITTED or event in UNIT_DONE else "info"
        getattr(logger, level)(event, **fields)

    logger.info(
        "engine_started",
        model=model.model_dir,
        arch=model.model_type,
        device=model.device.type,
        prompt_tokens=inputs.num_tokens,
        images=len(images),
        policy=options.policy,
        cadence=options.cadence,
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
                    "lifetime_bytes_written": result.lifetime_bytes_written,
                    "recoveries": result.recoveries,
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
