"""`ow infer` / `ow model` from the outside: bad input gives one line and a non-zero exit."""

import json
import os
import subprocess
import sys

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
