"""The red team at full size: the decoder and dispatch fuzzers (1,000,000 frames each by default)
and the whole-system kill campaign (1,000 payload SIGKILLs at random instants of its working life,
the bus SIGKILLed every 40 cuts), or with --chaos the chaos campaign instead (500 faults by
default: cuts and bus kills mixed with storage spells, OOM kills and floods, a probe PINGing
throughout). Prints the numbers and writes runs/redteam/report.json.

    python -m bench.redteam [--frames N] [--kills N] [--bus-kill-every N] [--skip-fuzz] [--skip-campaign]
                            [--model DIR] [--out runs/redteam] [--nice 10]
    python -m bench.redteam --chaos [--faults 500] [--spell-s 2 5] [--stall-s 2 6] [--flood-pings 200 600]
                            [--probe-every-s 2] [--skip-fuzz] [--nice 10]

Tasks lost, run twice, answered wrong and crash loops must each be 0, and for the chaos campaign
also the payload's fault events, late PINGs and rejected PINGs (exit status 1 otherwise).
A run this size takes hours here (every payload power-up pays the interpreter and library
imports); run it in the background with nice. docs/hil.md "Red team" explains what is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from common import log
from hil.chaos import ChaosCampaign
from hil.redteam import KillCampaign, fuzz_decoder, fuzz_dispatch, to_dict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _span(parser, flag: str, kind, default, text: str) -> None:
    """An option of two values, MIN and MAX, drawn between uniformly."""
    parser.add_argument(flag, type=kind, nargs=2, default=default, metavar=("MIN", "MAX"), help=text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=1_000_000, help="frames for each fuzzer (default 1,000,000)")
    p.add_argument("--kills", type=int, default=1000, help="payload cuts in the kill campaign (default 1000)")
    p.add_argument("--bus-kill-every", type=int, default=40, help="SIGKILL the bus after every N cuts (default 40)")
    p.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="tasks uplinked during the campaign (default: as many as kills; --chaos: until the last fault)",
    )
    p.add_argument("--seed", type=int, default=0)
    _span(
        p,
        "--work-s",
        float,
        None,
        "working time of each window before its cut, drawn uniformly (default 0.1 4.0 s; --chaos: 1 10 s)",
    )
    p.add_argument(
        "--boot-s",
        type=float,
        default=1.0,
        help="emulated payload boot: each power-up forks the payload from a pre-loaded zygote and waits this "
        "long (default 1.0 s); 0 or less: exec the payload at every power-up (this machine's real cold start)",
    )
    p.add_argument(
        "--pace-ms",
        type=int,
        default=60,
        help="the payload's --pace-ms during the campaign: every block and step lasts at least this long (default 60)",
    )
    p.add_argument("--model", default=None, help="model directory (default: build the tiny Qwen3-VL under --out)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "redteam"))
    p.add_argument("--nice", type=int, default=0, help="niceness of the campaign's bus and payload processes")
    p.add_argument("--skip-fuzz", action="store_true")
    p.add_argument("--skip-campaign", action="store_true")
    chaos = p.add_argument_group("chaos campaign")
    chaos.add_argument("--chaos", action="store_true", help="run the chaos campaign instead of the kill campaign")
    chaos.add_argument("--faults", type=int, default=500, help="faults in the chaos campaign, every kind (default 500)")
    _span(chaos, "--spell-s", float, (2.0, 5.0), "length of a full, read-only or EIO spell (default 2 5 s)")
    _span(chaos, "--stall-s", float, (2.0, 6.0), "how long each fsync waits in a stall spell (default 2 6 s)")
    _span(chaos, "--flood-pings", int, (200, 600), "PINGs in one burst of the flood station (default 200 600)")
    chaos.add_argument("--probe-every-s", type=float, default=2.0, help="the probe's PING interval (default 2 s)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    log.setup("error", component="redteam")

    say = lambda s: print(s, flush=True)  # noqa: E731
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "frames": args.frames, "seed": args.seed}
    path = os.path.join(args.out, "report.json")

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)

    ok = True
    if not args.skip_fuzz:
        say(f"[redteam] decoder fuzzer: {args.frames} frames")
        decoder = fuzz_decoder(args.frames, seed=args.seed, progress=say)
        report["decoder"] = to_dict(decoder)
        say(
            f"[redteam] decoder: {decoder.frames} frames, {decoder.decoded} decoded, {len(decoder.defects)} defects, "
            f"slowest {decoder.slowest_frame_ms:.1f} ms, RSS growth {decoder.rss_growth_bytes >> 10} KiB, "
            f"{decoder.seconds:.0f} s"
        )
        save()
        say(f"[redteam] dispatch fuzzer: {args.frames} frames")
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as work:
            dispatch = fuzz_dispatch(args.frames, seed=args.seed + 1, workdir=work, progress=say)
        report["dispatch"] = to_dict(dispatch)
        say(
            f"[redteam] dispatch: {dispatch.frames} frames ({dispatch.command_frames} telecommands or undecodable), "
            f"{dispatch.accepted} accepted, {sum(dispatch.rejected.values())} rejected in {len(dispatch.rejected)} "
            f"codes, "
            f"{len(dispatch.verdict_violations)} verdict violations, {len(dispatch.escaped)} escaped, "
            f"{dispatch.command_faults} handler faults, RSS growth {dispatch.rss_growth_bytes >> 10} KiB, "
            f"{dispatch.seconds:.0f} s"
        )
        save()
        ok = ok and decoder.passed and dispatch.passed
    if not args.skip_campaign:
        model = args.model
        if model is None:
            model = os.path.join(args.out, "model")
            if not os.path.exists(os.path.join(model, "config.json")):
                # lazy: torch/transformers (seconds): the parent only spawns and times the children
                from flight.model.tiny import build_tiny

                build_tiny("qwen3-vl", "tiny", 0, model)
        common = dict(
            seed=args.seed,
            tasks=args.tasks,
            pace_ms=args.pace_ms,
            boot_s=args.boot_s if args.boot_s > 0 else None,
            say=say,
            nice=args.nice,
        )
        if args.work_s is not None:
            common["work_s"] = tuple(args.work_s)
        if args.chaos:
            out = os.path.join(args.out, "chaos")
            chaos_campaign = ChaosCampaign(
                out,
                model,
                faults=args.faults,
                spell_s=tuple(args.spell_s),
                stall_s=tuple(args.stall_s),
                flood_pings=tuple(args.flood_pings),
                probe_every_s=args.probe_every_s,
                **common,
            )
            say(f"[redteam] chaos campaign planned: {chaos_campaign.plan.describe()}")
            result = chaos_campaign.run()
            say(f"[redteam] chaos campaign: {result.summary()}")
            report["chaos"] = json.load(open(os.path.join(out, "campaign-report.json")))
        else:
            out = os.path.join(args.out, "campaign")
            say(f"[redteam] kill campaign: {args.kills} payload cuts, the bus killed every {args.bus_kill_every}")
            result = KillCampaign(out, model, kills=args.kills, bus_kill_every=args.bus_kill_every, **common).run()
            report["campaign"] = json.load(open(os.path.join(out, "campaign-report.json")))
            say(f"[redteam] campaign: {result.summary()}")
        save()
        ok = ok and result.passed
    report["passed"] = ok
    save()
    say(f"[redteam] {'PASSED' if ok else 'FAILED'}: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
