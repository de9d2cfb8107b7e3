"""`ow infer` / `ow model` from the outside: bad input gives one line and a non-zero exit."""

import json
import os
import random
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from common.record import Kind, decode


def ow(*args, timeout=900):  # bounds a hang only: `ow infer` takes minutes on a saturated machine
    return subprocess.run(
        [sys.executable, "-m", "common.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _one_line_error(proc, code, fragment):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ow ")]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def base(model_dirs, image_files, tmp_path):
    return [
        "infer",
        "--model",
        model_dirs["qwen3-vl"],
        "--prompt",
        "count the ships",
        "--max-new-tokens",
        "3",
        "--ckpt-dir",
        str(tmp_path / "ck"),
    ]


def test_help_explains_resume():
    proc = ow("infer", "--help")
    assert proc.returncode == 0 and "continues from" in proc.stdout and "--ckpt-dir" in proc.stdout


def test_help_gives_the_cadence_default_per_policy():
    for command in (("infer",), ("flight", "run")):
        proc = ow(*command, "--help")
        text = " ".join(proc.stdout.split())  # argparse wraps the help
        assert proc.returncode == 0, proc.stderr
        assert "Default: the policy's, adaptive for orbitweaver, fixed for the baselines" in text


def test_adaptive_cadence_on_a_baseline_is_refused(base, image_files):
    # refused before the model loads, with the exit status of a bad argument
    proc = ow(*base, "--image", image_files[0], "--policy", "sonic-layer", "--cadence", "adaptive")
    _one_line_error(proc, 2, "--cadence adaptive is orbitweaver's")


def test_missing_image(base, tmp_path):
    _one_line_error(ow(*base, "--image", str(tmp_path / "nope.png")), 4, "image not found")


def test_unreadable_image(base, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
    _one_line_error(ow(*base, "--image", str(bad)), 4, "not a decodable picture")


def test_model_dir_of_another_architecture(base, tmp_path, image_files):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    args = list(base)
    args[args.index("--model") + 1] = str(other)
    _one_line_error(ow(*args, "--image", image_files[0]), 3, "'llama' model")


def test_not_a_model_dir(base, tmp_path, image_files):
    args = list(base)
    args[args.index("--model") + 1] = str(tmp_path)
    _one_line_error(ow(*args, "--image", image_files[0]), 3, "no config.json")


def test_bad_numbers(base, image_files):
    _one_line_error(ow(*base, "--image", image_files[0], "--chunk", "0"), 2, "--chunk")


def test_ckpt_dir_is_a_file(base, tmp_path, image_files):
    f = tmp_path / "file"
    f.write_text("x")
    args = list(base)
    args[args.index("--ckpt-dir") + 1] = str(f)
    _one_line_error(ow(*args, "--image", image_files[0]), 2, "not a directory")


def test_json_output_fields_and_stored_result(base, image_files):
    first = ow(*base, "--image", image_files[0], "--json", "--chunk", "16", "--group", "2")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    for key in ("token_ids", "text", "resumed", "resumed_from", "bytes_written", "phase_seconds"):
        assert key in out
    assert out["resumed"] is False and out["bytes_written"] > 0 and len(out["token_ids"]) == 3
    assert set(out["phase_seconds"]) >= {"vision", "prefill", "decode"}
    again = json.loads(ow(*base, "--image", image_files[0], "--json", "--chunk", "16", "--group", "2").stdout)
    assert again["resumed"] is True and again["resumed_from"]["phase"] == "done"
    assert again["token_ids"] == out["token_ids"] and again["logits_sha256"] == out["logits_sha256"]


def test_build_tiny_and_info(tmp_path):
    proc = ow(
        "model", "build-tiny", "--arch", "qwen2.5-vl", "--size", "tiny", "--seed", "3", "--out", str(tmp_path / "m")
    )
    assert proc.returncode == 0, proc.stderr
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "preprocessor_config.json",
        "generation_config.json",
    ):
        assert (tmp_path / "m" / f).exists()
    info = json.loads(ow("model", "info", str(tmp_path / "m")).stdout)
    assert info["arch"] == "qwen2_5_vl" and info["layers"] == 4


def _overrides(stderr: str) -> dict[str, dict]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return {line["option"]: line for line in lines if line.get("event") == "option_overridden"}


def test_a_policy_override_is_reported(base, image_files, tmp_path):
    """sonic-layer fixes G = K = D = 1: the typed --group is reported as a warning, the defaults
    it replaces as info, each with the policy's value and why; the MANIFEST has what ran."""
    proc = ow(*base, "--image", image_files[0], "--chunk", "16", "--group", "2", "--policy", "sonic-layer")
    assert proc.returncode == 0, proc.stderr
    seen = _overrides(proc.stderr)
    assert set(seen) == {"--group", "--decode-every", "--vision-every"}, proc.stderr
    group = seen["--group"]
    assert (group["given"], group["explicit"], group["policy_value"], group["level"]) == (2, True, 1, "warning")
    assert "sonic-layer" in group["message"] and "definition fixes it" in group["message"]
    every = seen["--decode-every"]
    assert (every["given"], every["explicit"], every["policy_value"], every["level"]) == (16, False, 1, "info")
    stored, _ = decode((tmp_path / "ck" / "MANIFEST").read_bytes(), expect_kind=Kind.MANIFEST)
    manifest = stored.meta["manifest"]
    assert (manifest["group"], manifest["decode_every"], manifest["vision_every"]) == (1, 1, 1)


def test_no_override_no_report(base, image_files):
    proc = ow(*base, "--image", image_files[0], "--chunk", "16", "--group", "2")
    assert proc.returncode == 0, proc.stderr
    assert _overrides(proc.stderr) == {}


def test_flight_run_reports_an_override(model_dirs, tmp_path):
    """`ow flight run` reports it at boot, before anything else can stop it (here: no keys)."""
    proc = ow(
        "flight",
        "run",
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        model_dirs["qwen3-vl"],
        "--keys",
        str(tmp_path / "no-keys"),
        "--policy",
        "hcache",
        "--decode-every",
        "8",
    )
    assert proc.returncode == 2 and "no payload key" in proc.stderr, proc.stderr
    seen = _overrides(proc.stderr)
    assert set(seen) == {"--group", "--decode-every"}, proc.stderr
    assert (seen["--decode-every"]["given"], seen["--decode-every"]["policy_value"]) == (8, 64)
    assert seen["--decode-every"]["explicit"] is True and seen["--group"]["explicit"] is False


# ---- issue 27, finding 8: tracebacks instead of one-line errors ---------------------------------


def _only_line(proc, code: int, *fragments: str) -> str:
    """stderr is exactly one `ow ...: error: ...` line naming the problem; no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ow ") and ": error: " in lines[0], proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _model_copy(source: str, target) -> str:
    import shutil

    shutil.copytree(source, target)
    return str(target)


def test_damaged_weight_files_are_one_line_errors_before_anything_is_read(model_dirs, image_files, tmp_path):
    """A truncated copy, a file of random bytes, a header length claiming 8 GiB (nothing that
    size is allocated: the check reads 8 bytes), a file shorter than its header: exit 3, one
    line naming the file and what is wrong, no checkpoint directory made."""
    weights = (Path(model_dirs["qwen3-vl"]) / "model.safetensors").read_bytes()
    damaged = {
        "truncated": (weights[: len(weights) // 2], "is truncated"),
        "random": (random.Random(27).randbytes(64 << 10), "not a safetensors file"),
        "8 GiB header": (struct.pack("<Q", 8 << 30) + weights[8:], "header length field says 8589934592 bytes"),
        "short": (weights[:5], "shorter than its header"),
    }
    for name, (content, problem) in damaged.items():
        model = _model_copy(model_dirs["qwen3-vl"], tmp_path / name)
        (Path(model) / "model.safetensors").write_bytes(content)
        ckpt = tmp_path / f"ck-{name}"
        proc = ow(
            "infer", "--model", model, "--image", image_files[0], "--prompt", "q", "--ckpt-dir", str(ckpt), timeout=300
        )
        _only_line(proc, 3, "model.safetensors", problem)
        assert not ckpt.exists()


def test_negative_and_non_finite_numbers_are_refused(base, image_files, tmp_path):
    """`--pace-ms -1` was taken silently; nan and inf reached the engine. Exit 2, one line."""
    for option, value in (
        ("--pace-ms", "-1"),
        ("--pace-ms", "nan"),
        ("--emulate-read-mbps", "inf"),
        ("--thermal-limit-c", "nan"),
    ):
        _only_line(ow(*base, "--image", image_files[0], option, value), 2, option, value)
    assert not (tmp_path / "ck").exists()
    # a prompt with no visible character is blank (finding 9), refused before the model loads
    blank = list(base)
    blank[blank.index("--prompt") + 1] = "\u200b\u202e\u2060"
    _only_line(ow(*blank, "--image", image_files[0]), 4, "no visible character")


def _address_space_limit(mib: int):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (mib << 20, mib << 20))

    return limit


def test_out_of_memory_is_one_line_with_its_exit_status(base, image_files, tmp_path):
    """Under an address-space limit `ow infer` raised MemoryError (or an ImportError from a
    library it could not map, or aborted inside torch's start-up) with a traceback. Exit 6, one
    line saying out of memory: below what torch needs to start, checked before it is imported;
    above it, where the run itself runs out (the limit set once the libraries are loaded)."""
    command = [sys.executable, "-m", "common.cli", *base, "--image", image_files[0], "--log-level", "error"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    small = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, preexec_fn=_address_space_limit(256)
    )
    _only_line(small, 6, "out of memory")
    # The engine's libraries loaded, then a limit 8 MiB above what is mapped: the run's own
    # allocations fail (8 MiB is less than any library still to be mapped, so the failure is a
    # Python-level one, not a library's start-up).
    late = (
        "import resource, sys\n"
        "import torch, transformers, flight.engine, flight.model.loader, flight.model.inputs\n"
        "from common.cli import main\n"
        "mapped = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + (8 << 20), mapped + (8 << 20)))\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run_out = subprocess.run(
        [sys.executable, "-c", late, *command[3:]], capture_output=True, text=True, timeout=600, env=env
    )
    _only_line(run_out, 6, "out of memory")


def test_build_tiny_bad_values_leave_nothing_behind(tmp_path):
    huge = ow("model", "build-tiny", "--seed", str(2**80), "--out", str(tmp_path / "m"))
    _only_line(huge, 2, "--seed")
    assert not (tmp_path / "m").exists()  # was: a half-written directory and torch's overflow message
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _only_line(ow("model", "build-tiny", "--out", str(a_file / "m")), 2, "is a regular file")
