"""`ow infer` / `ow model` from the outside: bad input gives one line and a non-zero exit."""

import json
import os
import subprocess
import sys

import pytest


def ow(*args, timeout=120):
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
