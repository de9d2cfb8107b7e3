"""`ow vla ...`: the Robion-style VLA edge scheduler's commands.

Top-level imports stay light (argparse only) so that `ow --help` is fast; torch, scipy and the
engine are imported inside the command functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading

from common import log
from common.cliargs import Command, add_commands, arg
from common.errors import CliError
from common.vla.config import ARCHS, MODELS
from common.vla.profiles import load_profile, shipped_profiles

DEFAULT_PROFILE = "rtx-pro-6000x4"
DEFAULT_ILP_TIME_LIMIT_S = 2.0  # = management.DEFAULT_ILP_TIME_LIMIT_S (not imported: `ow --help` stays light)


def _cli_error(message: str, code: int = 2):
    return CliError(message, code)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _robot_mix(text: str) -> dict[str, int]:
    """'pi0=8,smolvla=4' -> {'pi0': 8, 'smolvla': 4}"""
    out = {}
    for part in _csv(text):
        name, _, count = part.partition("=")
        try:
            out[name.strip()] = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected MODEL=COUNT pairs, got {part!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no MODEL=COUNT pairs given")
    return out


def _limit_mix(text: str) -> dict[str, float | tuple[float, ...]]:
    """'pi0=11/6/6,smolvla=51' -> {'pi0': (11.0, 6.0, 6.0), 'smolvla': 51.0}"""
    out: dict[str, float | tuple[float, ...]] = {}
    for part in _csv(text):
        name, _, values = part.partition("=")
        try:
            limits = tuple(float(v) for v in values.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected MODEL=L or MODEL=L1/L2/..., got {part!r}") from None
        if not limits or any(v <= 0 for v in limits[:1]):
            raise argparse.ArgumentTypeError(f"{part!r}: the limit for one model alone must be positive")
        out[name.strip()] = limits if len(limits) > 1 else limits[0]
    if not out:
        raise argparse.ArgumentTypeError("no MODEL=LIMIT pairs given")
    return out


def _known_models(names) -> list[str]:
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise _cli_error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    return list(names)


def _load_profile(name: str):
    try:
        return load_profile(name)
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise _cli_error(f"cannot load profile {name!r}: {exc}") from None


def _setup_log(args) -> None:
    log.setup(level=getattr(args, "log_level", "info"), component="vla")


# ---------------------------------------------------------------- serve


def _robot_keys(args) -> dict[str, str] | None:
    """key -> robot name from --token / --keys / OW_VLA_TOKEN (None: no authentication)."""

    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    from common.vla.server import load_keys

    keys: dict[str, str] = {}
    if args.keys:
        try:
            keys.update(load_keys(args.keys))
        except (OSError, ValueError) as exc:
            raise _cli_error(f"cannot read robot keys: {exc}") from None
    token = args.token or os.environ.get("OW_VLA_TOKEN")
    if token:
        if len(token) < 16:
            raise _cli_error("the shared token must have at least 16 characters")
        keys[token] = "robot"
    return keys or None


def _gpu_layout(args, models: list[str]) -> tuple[list[list[str]], list[dict[str, int]] | None]:
    """Which models each GPU (engine) serves and its robot places: from --plan, from the controller
    (--robots), or every model on one GPU."""
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from common.vla.controller import read_plan

    if args.plan:
        try:
            gpus = read_plan(args.plan)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _cli_error(f"cannot use plan {args.plan!r}: {exc}") from None
        order = sorted(gpus)
        return [sorted(gpus[g]) for g in order], [gpus[g] for g in order]
    if args.robots:
        # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
        from common.vla.controller import format_plan
        from common.vla.management import Placement

        robot_models = _known_models(list(args.robots))
        try:
            placement = Placement.parse(args.placement, robot_models, args.gpus)
        except ValueError as exc:
            raise _cli_error(str(exc)) from None
        profile = _load_profile(args.plan_profile)
        plan = _controller(args, profile, robot_models).plan(placement, args.robots)
        print(format_plan(plan, placement), flush=True)
        if not plan.feasible:
            print(f"warning: serving a plan that is not within limits: {plan.note}", flush=True)
        used = [g for g in range(placement.n_gpus) if plan.assignment.robots_on(g)]
        return [sorted(plan.assignment.robots_on(g)) for g in used], [plan.assignment.robots_on(g) for g in used]
    return [models], None


def _endpoint_setup(args):
    """What `serve` and `cluster` share: models, robot keys (else loopback only), the GPU layout
    and its robot places, the models served, the profile and the SLOs."""
    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    from common.vla.server import require_loopback

    models = _known_models(_csv(args.models))
    keys = _robot_keys(args)
    if keys is None:
        try:
            require_loopback(args.host)
        except ValueError as exc:
            raise _cli_error(str(exc)) from None
    profile = _load_profile(args.profile) if args.profile else None
    layout, quotas = _gpu_layout(args, models)
    served = sorted({m for gpu in layout for m in gpu})
    slo = {m: args.slo_ms for m in served} if args.slo_ms is not None else None
    if profile is None and slo is None:
        slo = {m: 500.0 for m in served}
    return models, keys, layout, quotas, served, profile, slo


def cmd_serve(args) -> int:
    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    from common.vla.engine import ServingEngine
    from common.vla.server import PolicyServer, ServerConfig

    models, keys, layout, quotas, served, profile, slo = _endpoint_setup(args)
    _setup_log(args)
    threads = max(1, (args.threads or _cpu_threads()) // len(layout))
    engines = []
    try:
        for gpu_models in layout:
            engines.append(
                ServingEngine.build(
                    gpu_models,
                    system=args.system,
                    policy=args.policy,
                    max_batch=args.max_batch,
                    profile=profile,
                    slo_ms=slo,
                    backend=args.backend,
                    threads=threads,
                    batch_sizes=args.batch_sizes,
                )
            )
    except (ValueError, KeyError) as exc:
        raise _cli_error(str(exc)) from None
    if not args.no_warm_up:
        print(f"warming up {len(engines)} engine(s) ...", flush=True)
        for e in engines:
            e.warm_up()
    for e in engines:
        e.start()
    default = models[0] if models[0] in served else served[0]
    server = PolicyServer(engines, ServerConfig(args.host, args.port, default, args.max_request_bytes, keys), quotas)
    try:
        server.start()
    except OSError as exc:
        for e in engines:
            e.stop()
        raise _cli_error(f"cannot listen on {args.host}:{args.port}: {exc}", 1) from None
    print(
        f"serving {server.url} models={','.join(served)} gpus={len(engines)} system={args.system} "
        f"policy={args.policy} backend={engines[0].backend.name} auth={'keys' if keys else 'none (loopback)'}",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.stop()
        for e in engines:
            e.stop()
        served_n = sum(e.stats.served for e in engines)
        met = sum(e.stats.slo_met for e in engines)
        print(
            f"stopped: served={served_n} slo_met={met} rejected={server.rejected} refused={server.refused}", flush=True
        )
    return 0


def _cpu_threads() -> int:
    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------- cluster


def cmd_cluster(args) -> int:
    models, keys, layout_models, quotas, served, profile, slo = _endpoint_setup(args)
    try:
        # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
        from common.vla import cluster
    except ImportError as exc:
        raise _cli_error(
            f"ow vla cluster needs Ray Serve ({exc.name} is missing): pip install 'orbitweaver[cluster]'"
        ) from None
    layout = {g: (quotas[g] if quotas else {m: 1 << 30 for m in ms}) for g, ms in enumerate(layout_models)}
    engine_options = {
        "system": args.system,
        "policy": args.policy,
        "max_batch": args.max_batch,
        "profile": profile,
        "slo_ms": slo,
        "backend": args.backend,
        "threads": args.threads_per_gpu,
        "batch_sizes": args.batch_sizes,
        "warm_up": not args.no_warm_up,
        "max_request_bytes": args.max_request_bytes,
    }
    gateway_resources = {args.gateway_resource: 0.001} if args.gateway_resource else None
    default = models[0] if models[0] in served else served[0]
    location = {"head": "HeadOnly", "every-node": "EveryNode"}[args.proxy_location]
    print(f"deploying {len(layout)} GPU deployment(s) to the Ray cluster at {args.address} ...", flush=True)
    try:
        cluster.deploy(
            args.address,
            layout,
            host=args.host,
            port=args.port,
            proxy_location=location,
            node_ip_address=args.node_ip_address,
            engine_options=engine_options,
            keys=keys,
            default_model=default,
            gpu_resource=args.gpu_resource,
            gateway_resources=gateway_resources,
            request_timeout_s=args.request_timeout,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise _cli_error(f"cannot deploy to the Ray cluster at {args.address}: {exc}", 1) from None
    seen: dict[str, tuple[object, object]] = {}

    def report():
        now = cluster.placements()
        for name, where in sorted(now.items()):
            if seen.get(name) != (where.get("node"), where.get("pid")):
                seen[name] = (where.get("node"), where.get("pid"))
                place = f"node {where['node'][:12]} pid {where['pid']}" if "node" in where else where.get("error")
                print(f"{name}: {','.join(where.get('models', layout_models[int(name[3:])]))} on {place}", flush=True)

    report()
    print(
        f"serving ws://{args.host}:{args.port} models={','.join(served)} gpus={len(layout)} via Ray Serve "
        f"auth={'keys' if keys else 'none (loopback)'}",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(args.watch_interval):
            try:
                report()
            except Exception as exc:  # the cluster may be in the middle of losing a node
                print(f"status unavailable: {type(exc).__name__}: {exc}", flush=True)
    finally:
        cluster.shutdown()
        print("stopped: application deleted", flush=True)
    return 0


# ---------------------------------------------------------------- load


def cmd_load(args) -> int:
    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    from common.vla.load import run_load
    from common.vla.sim import NetworkModel

    robots = args.robots
    _known_models([m for m in robots])
    if not args.url.startswith(("ws://", "wss://")):
        raise _cli_error(f"--url must be a ws:// or wss:// address, got {args.url!r}")
    if args.rate <= 0 or args.duration <= 0:
        raise _cli_error("--rate and --duration must be positive")
    network = None if args.network == "none" else NetworkModel()
    token = args.token or os.environ.get("OW_VLA_TOKEN")
    report = run_load(
        args.url,
        robots,
        rate_hz=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        network=network,
        seed=args.seed,
        token=token,
        slo_ms=args.slo_ms,
    )
    for line in report.lines():
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    if args.fail_below is not None and report.worst_attainment < args.fail_below:
        print(f"worst model attainment {report.worst_attainment:.1%} is below {args.fail_below:.1%}")
        return 1
    return 0


# ---------------------------------------------------------------- bench


def cmd_bench(args) -> int:
    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    from common.vla.bench import EXPERIMENTS, BenchSettings, fit_to_profile, run_bench
    from common.vla.controller import ACCEPTANCE_RULES

    profile = _load_profile(args.profile)
    experiments = _csv(args.experiments) if args.experiments else list(EXPERIMENTS)
    bad = [e for e in experiments if e not in EXPERIMENTS]
    if bad:
        raise _cli_error(f"unknown experiment(s) {', '.join(bad)}; choose from {', '.join(EXPERIMENTS)}")

    settings = BenchSettings.quick() if args.quick else BenchSettings()
    changes = {
        k: v
        for k, v in (
            ("epochs", args.epochs),
            ("duration_s", args.duration),
            ("seed", args.seed),
            ("seeds", args.seeds),
            ("slo_factors", args.slo_factors),
        )
        if v is not None
    }
    if args.seed is not None and args.seeds is None:
        changes["seeds"] = (args.seed,) + tuple(s for s in settings.seeds if s != args.seed)[: len(settings.seeds) - 1]
    controller = settings.controller
    if args.ilp_time_limit is not None:
        controller = dataclasses.replace(controller, time_limit_s=args.ilp_time_limit)
    if args.acceptance:
        rules = _csv(args.acceptance)
        try:
            controller = dataclasses.replace(controller, acceptance=rules[0])
        except ValueError as exc:
            raise _cli_error(str(exc)) from None
        bad = [r for r in rules if r not in ACCEPTANCE_RULES]
        if bad:
            raise _cli_error(f"unknown acceptance rule(s) {', '.join(bad)}; choose from {', '.join(ACCEPTANCE_RULES)}")
        changes["compare_acceptance"] = tuple(rules)
    if args.calibrated_factors is not None:
        changes["calibrated_factors"] = tuple(args.calibrated_factors)
    if args.calibration_settings is not None:
        from common.vla import calibrate

        bad = [i for i in args.calibration_settings if not 0 <= i < len(calibrate.GRID)]
        if bad or not args.calibration_settings:
            raise _cli_error(
                f"--calibration-settings: indices 0-{len(calibrate.GRID) - 1} into the unpinned settings, "
                f"got {','.join(map(str, args.calibration_settings)) or 'none'}"
            )
        changes["calibration_settings"] = tuple(args.calibration_settings)
    changes["controller"] = controller
    settings = dataclasses.replace(settings, **changes)
    try:
        fit_to_profile(profile, settings)
    except ValueError as exc:
        raise _cli_error(str(exc)) from None
    report = run_bench(profile, settings, experiments, emit=lambda line: print(line, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.data, f, indent=1, default=str)
    return 0


# ---------------------------------------------------------------- plan


def _controller(args, profile, models):
    """The traffic controller for `plan` and `serve`: given limits, or co-location limits measured now."""
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from common.vla.controller import ControllerSettings, TrafficController

    try:
        settings = ControllerSettings(
            epochs=args.check_epochs, confirm_epochs=args.confirm_epochs, time_limit_s=args.ilp_time_limit
        )
    except ValueError as exc:
        raise _cli_error(str(exc)) from None
    if getattr(args, "limits", None):
        missing = [m for m in models if m not in args.limits]
        if missing:
            raise _cli_error(f"--limits lacks {', '.join(missing)}")
        return TrafficController(profile, args.limits, args.max_batch, settings)
    print(f"measuring co-location limits in the simulator ({settings.epochs} epochs per point) ...", flush=True)
    return TrafficController.calibrate(profile, models, args.max_batch, settings, progress=print)


def cmd_plan(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from common.vla import sim
    from common.vla.controller import format_plan, write_plan
    from common.vla.management import ASSIGNERS, Placement, format_assignment

    robots = args.robots
    models = _known_models(list(robots))
    try:
        placement = Placement.parse(args.placement, models, args.gpus)
    except ValueError as exc:
        raise _cli_error(str(exc)) from None
    profile = _load_profile(args.profile)
    controller = _controller(args, profile, models)
    methods = [m for m in ASSIGNERS if m != "brute-force"] if args.method == "all" else [args.method]
    for method in methods:
        print(f"placement {placement.name} on {placement.n_gpus} GPUs")
        try:
            if method == "ilp":  # the controller: the ILP with co-location limits, each GPU checked
                plan = controller.plan(placement, robots)
                a = plan.assignment
                print(format_plan(plan, placement))
                if args.json:
                    write_plan(args.json, plan, placement, robots, profile.name)
                    print(f"wrote {args.json}")
            else:
                a = ASSIGNERS[method](placement, robots, controller.limits)
                print(format_assignment(a, placement))
        except (ValueError, RuntimeError) as exc:
            raise _cli_error(f"{method}: {exc}", 1) from None
        if args.simulate:
            r = sim.simulate(
                sim.robion(max_batch=args.max_batch),
                sim.Workload(robots, epochs=args.epochs, seed=args.seed),
                profile,
                assignment=a.counts,
            )
            print(
                f"  simulated (seed {args.seed}): worst model {r.worst_attainment:.3%} ({r.worst_model}), "
                f"pooled {r.attainment:.3%}, p99 {r.p99_ms:.1f} ms over {r.requests} requests"
            )
            print(f"  per model: {r.per_model_text()}")
    return 0


# ---------------------------------------------------------------- profile


def cmd_profile(args) -> int:
    if args.derive:
        # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
        from common.vla import analytic

        prof = analytic.derive_profile(args.derive)
        # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
        from common.vla.profiles import PROFILE_DIR

        path = prof.save(args.out or PROFILE_DIR / f"{prof.name}.json")
        print(f"wrote {path} (derived from public numbers; {len(prof.locksteps)} lockstep entries)")
        for row in prof.calibration:
            print(f"  calibration: {row['what']}: model {row['model_ms']} ms vs public {row['public_ms']} ms")
        return 0
    if not args.out:
        raise _cli_error("--out FILE is required when measuring the CPU backend")
    # lazy: torch (seconds); `ow --help` imports this module, the subcommand loads its own
    from common.vla.profiler import measure_cpu_profile

    archs = _csv(args.archs)

    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise _cli_error(f"unknown architecture(s) {', '.join(bad)}; known: {', '.join(ARCHS)}")
    prof = measure_cpu_profile(
        archs, args.batch_sizes, args.threads, args.repeats, args.slo_factor, progress=lambda s: print(s, flush=True)
    )
    path = prof.save(args.out)
    print(f"wrote {path} ({len(prof.locksteps)} lockstep entries, shares {list(prof.vlm_shares)})")
    return 0


# ---------------------------------------------------------------- simulate


def cmd_simulate(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from common.vla import sim

    _known_models(list(args.robots))
    profile = _load_profile(args.profile)
    kind = args.system
    if kind == "robion":
        system = sim.robion(policy=args.policy, max_batch=args.max_batch, sm_mode=args.sm_mode)
    elif kind == "monolithic":
        system = sim.monolithic(policy=args.policy, max_batch=args.max_batch)
    elif kind == "vllm-omni":
        system = sim.vllm_omni(max_batch=args.max_batch)
    elif kind.startswith("dis-"):
        try:
            k, m = (int(x) for x in kind[4:].split(":"))
        except ValueError:
            raise _cli_error(f"bad system {kind!r}; expected dis-K:M, e.g. dis-3:1") from None
        system = sim.disaggregated(k, m, max_batch=args.max_batch)
    else:
        raise _cli_error(f"unknown system {kind!r}")
    try:
        r = sim.simulate(
            system, sim.Workload(args.robots, epochs=args.epochs, duration_s=args.duration, seed=args.seed), profile
        )
    except (KeyError, ValueError) as exc:
        raise _cli_error(str(exc)) from None
    print(
        f"{r.system}: {r.robots} robots, {r.requests} requests, SLO attainment {r.attainment:.3%}, "
        f"p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms"
    )
    for model, stats in r.per_model.items():
        print(f"  {model}: {stats.attainment:.3%} of {stats.requests}, p99 {stats.p99_ms:.1f} ms")
    return 0


# ---------------------------------------------------------------- models


def cmd_models(args) -> int:
    print(f"{'model':14} {'arch':8} {'cams':>4} {'tok/img':>7} {'prefix':>6} {'horizon':>7} {'steps':>5}")
    for spec in MODELS.values():
        a = spec.arch_config
        print(
            f"{spec.name:14} {a.name:8} {a.cameras:4} {a.tokens_per_image:7} {a.prefix_tokens:6} "
            f"{a.action_horizon:7} {a.denoise_steps:5}"
        )
    print("\nshipped profiles:")
    for name in shipped_profiles():
        p = load_profile(name)
        slos = ", ".join(f"{a} SLO {ap.slo_ms:.1f} ms" for a, ap in p.archs.items())
        print(f"  {name}: {p.device.get('count')} x {p.device.get('name')} ({p.backend}); {slos}")
    return 0


# ---------------------------------------------------------------- the command line, declared

_MAX_BATCH_ARG = arg(
    "--max-batch", type=int, default=2, help="largest fixed stage batch (one of the profile's batch sizes; default 2)"
)
#: the queue policy and batch options of the commands that serve or simulate
_POLICY_ARGS = (
    arg(
        "--policy",
        choices=("esf", "rr", "lqf"),
        default="esf",
        help="queue served at each lockstep: esf = least remaining SLO time (default), "
        "rr = round robin, lqf = longest queue",
    ),
    _MAX_BATCH_ARG,
)
#: the traffic controller's options
_CONTROLLER_ARGS = (
    arg(
        "--ilp-time-limit",
        type=float,
        default=DEFAULT_ILP_TIME_LIMIT_S,
        help=f"seconds for all stages of the traffic ILP (default {DEFAULT_ILP_TIME_LIMIT_S:g}); when "
        "they run out the best assignment found so far is used, flagged as not proven optimal",
    ),
    arg(
        "--check-epochs",
        type=int,
        default=30,
        help="simulated 10 s epochs per point when measuring co-location limits and screening a plan (default 30)",
    ),
    arg(
        "--confirm-epochs",
        type=int,
        default=1000,
        help="fresh simulated 10 s epochs on which a plan that passed the screen is confirmed before it is "
        "accepted (default 1000; docs/vla.md, the two-stage acceptance)",
    ),
)

#: `ow vla ...` (common/cliargs.py)
VLA_COMMANDS: tuple[Command, ...] = (
    Command(
        "serve",
        help="run the robot policy endpoint (openpi websocket protocol)",
        description="Serve LIBERO-style observations (two 224x224 images, 8-d state, prompt) over "
        "the openpi websocket policy protocol (loopback, or any address with robot "
        "keys). Warms up, then accepts robots. Robots using "
        "openpi-client's WebsocketClientPolicy connect unchanged; choose a model with "
        "the URL path ws://HOST:PORT/MODEL (default: the first --models entry). "
        "Requests go through the lockstep scheduler. Stops on SIGINT/SIGTERM.",
        handler=cmd_serve,
        args=(
            arg(
                "--models",
                default="pi0",
                help="comma-separated models to co-locate on one GPU (default pi0); see `ow vla models`",
            ),
            arg(
                "--host",
                default="127.0.0.1",
                help="address to bind (default 127.0.0.1); beyond loopback only with --token or --keys",
            ),
            arg(
                "--token",
                help="shared robot token (or env OW_VLA_TOKEN, at least 16 characters): robots send "
                "'Authorization: Api-Key TOKEN' (openpi-client's api_key); others get HTTP 401",
            ),
            arg(
                "--keys",
                help="file of robot keys, one 'NAME KEY' per line: only these robots are served, logged by name",
            ),
            arg(
                "--plan",
                help="serve this plan file (`ow vla plan --json`): one engine per GPU, robots "
                "routed to the GPUs the controller chose for their model",
            ),
            arg(
                "--robots",
                type=_robot_mix,
                help="instead of --plan: plan now for this robot mix (with --placement, --gpus) and serve it",
            ),
            arg("--placement", default="mix", help="with --robots: 'mix' or groups 'GLOB:GPU,GPU;...' (default mix)"),
            arg("--gpus", type=int, default=2, help="with --robots: GPUs (engines) to plan for (default 2)"),
            arg(
                "--plan-profile",
                default=DEFAULT_PROFILE,
                help=f"with --robots: the profile the controller plans with (default {DEFAULT_PROFILE})",
            ),
            arg("--limits", type=_limit_mix, help="with --robots: robot limits instead of measuring them"),
            *_CONTROLLER_ARGS,
            arg(
                "--no-warm-up",
                action="store_true",
                help="accept robots at once instead of first running every stage at every batch size",
            ),
            arg("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free port, printed)"),
            arg(
                "--system",
                choices=("robion", "monolithic"),
                default="robion",
                help="robion: VLM and ADiT executors in lockstep (default); monolithic: one pipeline",
            ),
            *_POLICY_ARGS,
            arg(
                "--batch-sizes",
                type=_ints,
                default=(1, 2, 4),
                help="fixed batch sizes the executors run, comma-separated (default 1,2,4)",
            ),
            arg(
                "--profile",
                help="profile file or shipped name: SLOs and per-pair VLM thread/SM share "
                "(default: no profile, half the threads to the VLM)",
            ),
            arg("--slo-ms", type=float, help="SLO for every model in ms (default: the profile's, else 500)"),
            arg(
                "--backend",
                choices=("auto", "cpu", "cuda"),
                default="auto",
                help="cuda when a GPU is visible (auto, default), else cpu",
            ),
            arg("--threads", type=int, help="intra-op threads shared by the two CPU executors (default: torch's)"),
            arg(
                "--max-request-bytes",
                type=int,
                default=1 << 20,
                help="larger requests are refused with an error reply (default 1 MiB)",
            ),
            arg(
                "--log-level",
                default="info",
                choices=("debug", "info", "warning", "error"),
                help="JSON-lines log level on stderr (default info)",
            ),
        ),
    ),
    Command(
        "cluster",
        help="serve robots from a Ray cluster of edge servers (Ray Serve), same endpoint",
        description="Deploy the controller's plan to a running Ray cluster: one Ray Serve deployment "
        "per GPU of the plan, each with its models and their lockstep scheduler, and a "
        "gateway that speaks the same openpi websocket protocol as `ow vla serve`. Ray "
        "Serve restarts a lost server's deployments on free GPUs elsewhere. Prints where "
        "each GPU runs, and every change. Stops (and deletes the application) on "
        "SIGINT/SIGTERM.",
        handler=cmd_cluster,
        args=(
            arg(
                "--address", required=True, help="Ray cluster address (HEAD_IP:PORT, as given to `ray start --address`)"
            ),
            arg(
                "--node-ip-address",
                help="this machine's address in the Ray cluster, when Ray cannot tell (several nodes on one host)",
            ),
            arg("--models", default="pi0", help="without --plan/--robots: models on one GPU (default pi0)"),
            arg(
                "--host",
                default="127.0.0.1",
                help="address Ray Serve's proxy binds (default 127.0.0.1); beyond loopback only with --token/--keys",
            ),
            arg("--port", type=int, default=8000, help="proxy port (default 8000)"),
            arg("--token", help="shared robot token (or env OW_VLA_TOKEN); robots send 'Authorization: Api-Key TOKEN'"),
            arg("--keys", help="file of robot keys, one 'NAME KEY' per line"),
            arg("--plan", help="plan file from `ow vla plan --json`: one deployment per GPU in it"),
            arg("--robots", type=_robot_mix, help="instead of --plan: plan now for this robot mix"),
            arg("--placement", default="mix", help="with --robots: placement (default mix)"),
            arg("--gpus", type=int, default=2, help="with --robots: GPUs in the cluster to plan for (default 2)"),
            arg(
                "--plan-profile",
                default=DEFAULT_PROFILE,
                help=f"with --robots: planning profile (default {DEFAULT_PROFILE})",
            ),
            arg("--limits", type=_limit_mix, help="with --robots: robot limits instead of measuring them"),
            *_CONTROLLER_ARGS,
            arg("--system", choices=("robion", "monolithic"), default="robion", help="serving engine (default robion)"),
            *_POLICY_ARGS,
            arg("--batch-sizes", type=_ints, default=(1, 2, 4), help="fixed batch sizes (default 1,2,4)"),
            arg("--profile", help="profile for SLOs and VLM shares inside each GPU deployment"),
            arg("--slo-ms", type=float, help="SLO for every model in ms (default: the profile's, else 500)"),
            arg("--backend", choices=("auto", "cpu", "cuda"), default="auto", help="engine backend (default auto)"),
            arg(
                "--threads-per-gpu",
                type=int,
                default=1,
                help="CPU backend: intra-op threads per GPU deployment (default 1)",
            ),
            arg(
                "--gpu-resource",
                default="GPU",
                help="Ray resource one GPU deployment takes one unit of (default GPU, i.e. num_gpus=1; a custom "
                "resource stands in on CPU-only clusters)",
            ),
            arg("--gateway-resource", help="custom Ray resource to pin the gateway to (e.g. one on the head node)"),
            arg(
                "--proxy-location",
                choices=("head", "every-node"),
                default="every-node",
                help="where Ray Serve runs HTTP proxies: every node (default; robots may use any server's "
                "address) or the head only",
            ),
            arg(
                "--request-timeout",
                type=float,
                default=60.0,
                help="seconds the gateway waits for a GPU deployment before answering an error (default 60)",
            ),
            arg("--max-request-bytes", type=int, default=1 << 20, help="larger requests are refused (default 1 MiB)"),
            arg("--no-warm-up", action="store_true", help="skip each GPU deployment's warm-up"),
            arg("--watch-interval", type=float, default=5.0, help="seconds between placement checks (default 5)"),
        ),
    ),
    Command(
        "load",
        help="drive a real endpoint with N robots at 2 Hz and report per-model SLO attainment",
        description="Robots as openpi clients: one websocket per robot to URL/MODEL, LIBERO "
        "observations at --rate from a random phase, network delays emulated per "
        "request; prints per model: requests, answered, errors, SLO attainment, p50, "
        "p99 and the GPUs that served them.",
        handler=cmd_load,
        args=(
            arg("--url", default="ws://127.0.0.1:8000", help="endpoint (default ws://127.0.0.1:8000)"),
            arg("--robots", type=_robot_mix, required=True, help="robots per model, e.g. pi0=4,smolvla=2"),
            arg("--rate", type=float, default=2.0, help="requests per robot per second (default 2)"),
            arg("--duration", type=float, default=10.0, help="seconds of traffic (default 10)"),
            arg(
                "--warmup",
                type=float,
                default=1.0,
                help="requests sent before this many seconds are not counted (default 1)",
            ),
            arg(
                "--network",
                choices=("wifi7", "none"),
                default="wifi7",
                help="emulated network delay per request and reply (default wifi7, the simulator's model)",
            ),
            arg("--slo-ms", type=float, help="SLO for every model (default: the server's, from its metadata)"),
            arg("--token", help="robot key (or env OW_VLA_TOKEN), sent as 'Authorization: Api-Key KEY'"),
            arg("--seed", type=int, default=0, help="seed of phases, images and delays (default 0)"),
            arg("--json", help="also write the report to this JSON file"),
            arg("--fail-below", type=float, help="exit 1 when some model's attainment is below this (e.g. 0.98)"),
        ),
    ),
    Command(
        "bench",
        help="load sweeps: max robots at 98%% SLO per system, beside the paper's numbers",
        description="Run the paper's experiments on the simulator with a profile: single-model "
        "max robots at 98%% SLO attainment (Robion-style vs Monolithic vs "
        "vLLM-Omni-style), queue policies, traffic controllers (ILP vs SMG vs EPS), "
        "ILP solve time, 8 models x 4 GPUs, and intra- vs inter-GPU disaggregation.",
        handler=cmd_bench,
        args=(
            arg("--profile", default=DEFAULT_PROFILE, help=f"profile name or file (default {DEFAULT_PROFILE})"),
            arg("--quick", action="store_true", help="short setting: 5 epochs x 6 s per load point"),
            arg("--epochs", type=int, help="epochs (resampled robot phases) per load point (default 20)"),
            arg("--duration", type=float, help="simulated seconds per epoch (default 10)"),
            arg("--seed", type=int, help="random seed of the single-seed parts (default 0)"),
            arg("--seeds", type=_ints, help="seeds of the bands (default 0,1,2; --quick: 0,1)"),
            arg(
                "--slo-factors",
                type=_floats,
                help="SLO factors of the single-model bands (default 2,2.5,3,3.5; SLO = factor x batch-1 latency)",
            ),
            arg(
                "--ilp-time-limit",
                type=float,
                help=f"seconds for the traffic ILP's stages together (default {DEFAULT_ILP_TIME_LIMIT_S:g}); past it "
                "the best assignment found is used",
            ),
            arg(
                "--experiments",
                help="comma-separated subset of: single, policies, traffic, ilp, multi, inter-gpu, calibration "
                "(the SLO factor fitted to the paper's 18-robot anchor for each unpinned setting, then 8 x 4 at each), "
                "early-release (actions released when their ADiT ends, not at the lockstep barrier); "
                "default: all",
            ),
            arg(
                "--acceptance",
                help="the controller's plan acceptance: bootstrap (default: screen, then confirm on fresh draws), "
                "bootstrap-once (the screen alone), prediction or worst-draw (docs/vla.md); "
                "several, comma-separated, are compared side by side in the calibration experiment (the first "
                "is used elsewhere)",
            ),
            arg(
                "--calibration-settings",
                type=_ints,
                help="calibration: run only these unpinned settings (indices 0-8 in the order the report lists "
                "them: kernel floor 8, 9, 10 us, each with co-run slowdown 0, 5, 10 %%), e.g. to run them in "
                "parallel processes",
            ),
            arg(
                "--calibrated-factors",
                type=_floats,
                help="calibration: use these fitted SLO factors (one per unpinned setting, in the order the "
                "report lists them, e.g. from an earlier run) instead of fitting them again",
            ),
            arg("--json", help="also write the measured numbers to this JSON file"),
        ),
    ),
    Command(
        "plan",
        help="assign robots to GPUs for a placement (traffic-control ILP and baselines)",
        description="Solve the traffic controller's integer program for a placement and robot mix; "
        "print each GPU's robots and load. Limits default to robot limits simulated "
        "from the profile.",
        handler=cmd_plan,
        args=(
            arg("--robots", type=_robot_mix, required=True, help="robot mix, e.g. pi0=8,pi0-ft1=8,smolvla=12"),
            arg(
                "--placement",
                default="mix",
                help="'mix' (every model on every GPU) or disjoint groups 'GLOB[,GLOB]:GPU,GPU;...', "
                "e.g. 'pi0*:0,1;smolvla*:2,3'",
            ),
            arg("--gpus", type=int, default=4, help="GPUs in the server (default 4)"),
            arg(
                "--limits",
                type=_limit_mix,
                help="robot limits per GPU instead of measuring them: MODEL=L or MODEL=L1/L2/L3 (L_k: k models "
                "share the GPU), e.g. pi0=11/6/6/4,smolvla=51/18",
            ),
            arg(
                "--method",
                choices=("ilp", "smg", "eps", "brute-force", "all"),
                default="ilp",
                help="ilp (Robion, default), smg (one GPU per model), eps (even split), brute-force, or all",
            ),
            arg(
                "--profile",
                default=DEFAULT_PROFILE,
                help=f"profile for limits and --simulate (default {DEFAULT_PROFILE})",
            ),
            arg("--max-batch", type=int, default=2, help="max batch when simulating (default 2)"),
            arg(
                "--simulate",
                action="store_true",
                help="also replay the assignment in the simulator and print every model's SLO attainment",
            ),
            arg("--epochs", type=int, default=5, help="epochs when replaying (default 5)"),
            arg(
                "--seed", type=int, default=0, help="seed of the replay (default 0; the controller checks with its own)"
            ),
            arg("--json", help="write the controller's plan to this file (input of `ow vla serve --plan`)"),
            *_CONTROLLER_ARGS,
        ),
    ),
    Command(
        "profile",
        help="measure the CPU backend's latency table, or derive the GPU profiles",
        description="Measure every stage alone and every co-running batch pair under every thread "
        "split on the CPU backend, writing a profile file the scheduler and simulator "
        "accept; or, with --derive, regenerate a shipped GPU profile from public numbers.",
        handler=cmd_profile,
        args=(
            arg("--out", help="profile file to write (required when measuring)"),
            arg("--archs", default="pi0,smolvla", help="architectures to measure (default pi0,smolvla)"),
            arg("--batch-sizes", type=_ints, default=(1, 2, 4), help="batch sizes (default 1,2,4)"),
            arg("--threads", type=int, help="intra-op threads to split (default: torch's)"),
            arg("--repeats", type=int, default=3, help="timed runs per entry, median kept (default 3)"),
            arg("--slo-factor", type=float, default=3.0, help="SLO = factor x batch-1 VLM+ADiT time (default 3)"),
            arg(
                "--derive",
                choices=("rtx-pro-6000", "h100"),
                help="instead of measuring, derive this GPU server's profile from public numbers",
            ),
        ),
    ),
    Command(
        "simulate",
        help="simulate one system at one load and print SLO attainment and latency",
        description="Discrete-event simulation of robots at 2 Hz, WiFi 7-like network and one GPU "
        "(or the stage GPUs of dis-K:M), driven by the shared scheduler code.",
        handler=cmd_simulate,
        args=(
            arg("--robots", type=_robot_mix, required=True, help="robot mix, e.g. pi0=12,smolvla=20"),
            arg("--system", default="robion", help="robion, monolithic, vllm-omni, or dis-K:M (default robion)"),
            *_POLICY_ARGS,
            arg(
                "--sm-mode",
                choices=("dynamic", "static"),
                default="dynamic",
                help="robion: per-pair VLM share from the profile (dynamic) or always 50%% (static)",
            ),
            arg("--profile", default=DEFAULT_PROFILE, help=f"profile name or file (default {DEFAULT_PROFILE})"),
            arg("--epochs", type=int, default=5, help="epochs with resampled robot phases (default 5)"),
            arg("--duration", type=float, default=10.0, help="simulated seconds per epoch (default 10)"),
            arg("--seed", type=int, default=0, help="random seed (default 0)"),
        ),
    ),
    Command(
        "models",
        help="list the served model catalogue and the shipped profiles",
        description="List model names, their architecture shapes, and shipped profiles with SLOs.",
        handler=cmd_models,
    ),
)


def register(subparsers) -> None:
    vla = subparsers.add_parser(
        "vla",
        help="Robion-style VLA edge scheduler: serve robots, simulate, plan, benchmark",
        description="Serve vision-language-action (VLA) requests from many robots under latency SLOs: "
        "a lockstep VLM/ADiT serving engine, profiles, placement and traffic control, and a "
        "simulator driven by the same scheduler.",
    )
    sub = vla.add_subparsers(dest="vla_command", metavar="VLA_COMMAND")
    sub.required = True
    add_commands(sub, VLA_COMMANDS)


if __name__ == "__main__":  # pragma: no cover - handy for `python -m common.vla.cli`
    root = argparse.ArgumentParser(prog="ow")
    register(root.add_subparsers(dest="command"))
    a = root.parse_args()
    sys.exit(a.func(a))
