"""The command line as a user runs it: separate processes, exit codes, one-line errors, and
files that are either complete or untouched."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

import posbias_export as pbe
import tiers
from conftest import SMALL


def run_cli(*args, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "posbias_export", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def assert_one_line_error(proc, pattern):
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert pattern in lines[0], lines[0]


def test_main_command_exactly_as_documented(tmp_path):
    proc = run_cli("--bias", "alibi", "--out", "model.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote model.onnx" in proc.stdout
    model = onnx.load(str(tmp_path / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)


def test_help_has_examples():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "examples:" in proc.stdout and "--checkpoint" in proc.stdout


# the CLI's one-line errors as a real process: two by default, all of them in-process in test_bad_inputs.py
ERRORS = [
    (["--bias", "alibx"], "unknown bias 'alibx'; choose one of: " + ", ".join(pbe.BIASES)),
    (["--bias", "alibi", "--heads", "0"], "--heads: expected a positive integer, got 0"),
    (["--bias", "alibi", "--heads", "3", "--dim", "128"], "dim (128) must be divisible by num_heads (3)"),
    (["--bias", "alibi", "--opset", "17"], "--opset: invalid choice"),
    (["--bias", "alibi", "--checkpoint", "missing.safetensors"], "checkpoint missing.safetensors does not exist"),
    (["--out", "x.onnx"], "--bias is required"),
]


@pytest.mark.parametrize("args,pattern", tiers.cases(ERRORS, [f"args{i}" for i in range(len(ERRORS))],
                                                     slow={"args2", "args3", "args4", "args5"}))
def test_errors_are_one_line_exit_2_and_leave_no_file(tmp_path, args, pattern):
    argv = args if "--out" in args else args + ["--out", "out.onnx"]
    proc = run_cli(*argv, cwd=tmp_path)
    assert_one_line_error(proc, pattern)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_location(tmp_path):
    target = "/sys/posbias_model.onnx" if os.geteuid() == 0 else "/proc/posbias_model.onnx"
    proc = run_cli("--bias", "alibi", "--out", target)
    assert_one_line_error(proc, "is not writable")
    assert not os.path.exists(target)


def test_unwritable_output_leaves_existing_file_untouched(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "model.onnx").write_bytes(b"old model")
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that ignores directory permissions")
        proc = run_cli("--bias", "alibi", "--out", str(locked / "model.onnx"))
        assert_one_line_error(proc, "is not writable")
        assert (locked / "model.onnx").read_bytes() == b"old model"
    finally:
        locked.chmod(0o700)


def test_output_into_missing_directory(tmp_path):
    proc = run_cli("--bias", "alibi", "--out", str(tmp_path / "no" / "such" / "m.onnx"))
    assert_one_line_error(proc, "does not exist")


def test_output_path_is_a_directory(tmp_path):
    proc = run_cli("--bias", "alibi", "--out", str(tmp_path))
    assert_one_line_error(proc, "it is a directory")


def test_kerple_checkpoint_with_r2_above_two_is_rejected(tmp_path):
    model = pbe.build_model(pbe.ModelConfig(bias="kerple_power", **SMALL), seed=0)
    pbe.save_checkpoint(model, tmp_path / "k.safetensors")
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    state = load_file(str(tmp_path / "k.safetensors"))
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as f:
        meta = f.metadata()
    state["blocks.1.attn.bias.r2"] = torch.tensor([0.5, 1.0, 2.5, 1.0])
    save_file(state, str(tmp_path / "bad.safetensors"), metadata=meta)
    (tmp_path / "m.onnx").write_bytes(b"keep")
    proc = run_cli("--checkpoint", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "m.onnx"))
    assert_one_line_error(proc, "0 < r2 <= 2")
    assert (tmp_path / "m.onnx").read_bytes() == b"keep"


def test_corrupt_checkpoint(tmp_path):
    (tmp_path / "c.safetensors").write_bytes(b"\x00garbage" * 10)
    proc = run_cli("--checkpoint", str(tmp_path / "c.safetensors"), "--out", str(tmp_path / "m.onnx"))
    assert_one_line_error(proc, "cannot read checkpoint")


def test_checkpoint_alone_exports_with_its_config(tmp_path):
    """`--checkpoint ck --out m.onnx` needs no other flag, and the weights are the checkpoint's."""
    cfg = pbe.ModelConfig(bias="sandwich", num_heads=2, dim=32, num_layers=1, bias_params={"sin_dim": 16})
    model = pbe.build_model(cfg, seed=5)
    pbe.save_checkpoint(model, tmp_path / "ck.safetensors")
    proc = run_cli("--checkpoint", str(tmp_path / "ck.safetensors"), "--out", str(tmp_path / "m.onnx"))
    assert proc.returncode == 0, proc.stderr
    import onnxruntime as ort

    ids = torch.randint(0, 256, (2, 70))
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(ids), rtol=1e-4, atol=1e-4)


def test_checkpoint_with_contradicting_flag(tmp_path):
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=0)
    pbe.save_checkpoint(model, tmp_path / "ck.safetensors")
    proc = run_cli("--checkpoint", str(tmp_path / "ck.safetensors"), "--heads", "8", "--out", str(tmp_path / "m.onnx"))
    assert_one_line_error(proc, "contradict the checkpoint's saved config")


def test_console_script_installed():
    script = Path(sys.executable).parent / "posbias-export"
    assert script.exists(), "pip install -e . installs the posbias-export console script"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "examples:" in proc.stdout


def test_every_option_of_every_command_has_help():
    from posbias_export import cli

    with_parsers = [c for c in cli.COMMANDS if c.parser]
    assert {c.name for c in with_parsers} >= {"", "validate", "bench", "bench-decode", "bench-models", "train",
                                              "evaluate", "extrapolation"}
    for command in with_parsers:
        parser = cli.parser_of(command)
        bare = [a.option_strings or a.dest for a in parser._actions if not a.help]
        assert not bare, f"{parser.prog}: no help for {bare}"
    top = run_cli("--help").stdout
    assert all(f"  {c.name} " in top for c in cli.COMMANDS if c.name), "top-level --help lists every command"


def test_usage_errors_of_torch_free_commands_do_not_import_torch():
    code = ("import sys; from posbias_export.cli import main; codes = [main(a) for a in "
            "(['validate'], ['evaluate'], ['validate', 'm.onnx', '--lengths', 'x'])]; "
            "print(codes, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[2, 2, 2] False", proc.stdout + proc.stderr


def test_checkpoint_is_found_from_another_folder_and_checked(tmp_path):
    """The file records the checkpoint's absolute path and sha256: validate works from anywhere,
    and refuses a different file put in its place."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "elsewhere").mkdir()
    pbe.save_checkpoint(pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=3), tmp_path / "ck" / "a.safetensors")
    proc = run_cli("--checkpoint", "ck/a.safetensors", "--out", "m.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert meta["posbias.checkpoint"] == str((tmp_path / "ck" / "a.safetensors").resolve())
    assert len(meta["posbias.checkpoint_sha256"]) == 64
    proc = run_cli("validate", "../m.onnx", "--runtimes", "ort-cpu", "--lengths", "5", cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pbe.save_checkpoint(pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=4), tmp_path / "ck" / "a.safetensors")
    proc = run_cli("validate", "../m.onnx", "--runtimes", "ort-cpu", "--lengths", "5", cwd=tmp_path / "elsewhere")
    assert_one_line_error(proc, "is not the file this model was exported from")


def test_validate_defaults_to_installed_runtimes(exports, monkeypatch, capsys):
    """Without --runtimes: what is installed runs, what is not is named on stderr; naming a
    runtime that is not installed is a failure."""
    from posbias_export.cli import main as cli_main
    from posbias_export.parity import runs, runtimes

    real = runtimes.unavailable_reason
    fake = lambda r: "python package 'openvino' is not installed" if r.name == "openvino" else real(r)
    monkeypatch.setattr(runtimes, "unavailable_reason", fake)
    monkeypatch.setattr(runs, "unavailable_reason", fake)
    model = str(exports.cli("alibi"))
    assert cli_main(["validate", model, "--lengths", "3", "--batch", "1"]) == 0
    out = capsys.readouterr()
    assert "skipping openvino: python package 'openvino' is not installed" in out.err
    assert "openvino" not in out.out and "ort-cpu" in out.out
    assert cli_main(["validate", model, "--lengths", "3", "--batch", "1", "--runtimes", "ort-cpu,openvino"]) == 1
    assert "unavailable: python package 'openvino' is not installed" in capsys.readouterr().out
