"""`ow vla ...` commands, in-process through the root `ow` parser."""

import json

import pytest
import structlog

from common.cli import build_parser, main


@pytest.fixture(autouse=True)
def _fresh_logging():
    # A command may point structlog at the captured stderr; do not leak that into other tests.
    yield
    structlog.reset_defaults()


def run(capsys, *argv):
    code = main(["vla", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_every_command():
    parser = build_parser()
    vla = parser._subparsers._group_actions[0].choices["vla"]
    commands = vla._subparsers._group_actions[0].choices
    assert {"serve", "cluster", "load", "bench", "plan", "profile", "simulate", "models"} <= set(commands)
    for name, sub in commands.items():
        assert sub.description, name
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings}"


def test_plan_prints_each_gpu(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--robots",
        "pi0=8,pi0-ft1=8,pi0-ft2=8,pi0-ft3=24",
        "--limits",
        "pi0=15,pi0-ft1=15,pi0-ft2=15,pi0-ft3=15",
        "--method",
        "all",
        "--check-epochs",
        "2",
        "--confirm-epochs",
        "4",
    )
    assert code == 0
    for method in ("ilp:", "smg:", "eps:", "greedy:"):
        assert method in out
    assert out.count("GPU 3: load") == 4 and "within_limits=False" in out  # SMG overloads the 24-robot model
    assert "GPU 0 simulated:" in out and "controller:" in out  # the ILP's plan is checked per GPU


def test_plan_with_groups_and_simulation(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--robots",
        "pi0=6,smolvla=10",
        "--placement",
        "pi0*:0,1;smolvla*:2,3",
        "--limits",
        "pi0=15,smolvla=58/20",
        "--simulate",
        "--epochs",
        "1",
        "--check-epochs",
        "2",
        "--confirm-epochs",
        "4",
    )
    assert code == 0 and "worst model" in out and "per model: pi0" in out and "GPU 2: load" in out


def test_simulate(capsys):
    code, out, _ = run(capsys, "simulate", "--robots", "pi0=6", "--epochs", "1", "--duration", "4")
    assert code == 0 and out.startswith("robion: 6 robots")


def test_bench_ilp_experiment_and_json(capsys, tmp_path):
    path = tmp_path / "bench.json"
    # A budget far below what these solves need: the experiment still ends, with every solve answered.
    code, out, _ = run(
        capsys, "bench", "--quick", "--experiments", "ilp", "--ilp-time-limit", "0.2", "--json", str(path)
    )
    assert code == 0 and "Traffic ILP, 8 models x 4 GPUs" in out and "bench took" in out
    ilp = json.loads(path.read_text())["ilp"]
    assert 0 <= ilp["not_proven"] <= 20 and (ilp["fit_max_ms"] or ilp["over_max_ms"]) > 0


def test_profile_derive_writes_the_shipped_format(capsys, tmp_path):
    out_file = tmp_path / "h100.json"
    code, out, _ = run(capsys, "profile", "--derive", "h100", "--out", str(out_file))
    assert code == 0 and "calibration" in out
    assert json.loads(out_file.read_text())["format"] == "orbitweaver.vla.profile/1"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["serve", "--host", "0.0.0.0"], "loopback"),
        (["serve", "--token", "short"], "at least 16"),
        (["serve", "--plan", "/nonexistent/plan.json"], "cannot use plan"),
        (["load", "--robots", "pi0=1", "--url", "http://x"], "ws://"),
        (["cluster", "--address", "127.0.0.1:1", "--host", "0.0.0.0"], "loopback"),
        (["serve", "--models", "gpt-5"], "unknown model"),
        (["plan", "--robots", "pi0=4", "--placement", "smolvla*:0"], "hosts no GPU"),
        (["bench", "--experiments", "everything"], "unknown experiment"),
        (["bench", "--acceptance", "median"], "acceptance must be one of"),
        (["bench", "--acceptance", "bootstrap,median"], "unknown acceptance"),
        (["bench", "--experiments", "calibration", "--calibration-settings", "9"], "--calibration-settings: indices"),
        (["plan", "--robots", "pi0=4", "--limits", "pi0=9", "--confirm-epochs", "0"], "confirm_epochs must be"),
        (["simulate", "--robots", "pi0=2", "--profile", "nowhere.json"], "cannot load profile"),
        (["profile"], "--out FILE is required"),
    ],
)
def test_user_errors_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
