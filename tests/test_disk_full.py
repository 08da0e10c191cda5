"""A full disk during an export: one line that names what was being written, exit 2, nothing left
(issue 49). A write() that fails with ENOSPC names no file, and ONNX Runtime's quantizer reads
back a copy the full disk cut short as a protobuf error: both become our one line."""
from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from posbias_export.cli import main


def test_enospc_names_the_output_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import onnx

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", full)
    monkeypatch.setattr(onnx, "save", full)
    out = tmp_path / "model.onnx"
    assert main(["--bias", "alibi", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err
    assert f"writing {out} (--out)" in err
    assert list(tmp_path.iterdir()) == []


def test_quantizer_reading_back_a_cut_copy_is_a_full_disk(tmp_path, monkeypatch, capsys):
    """The protobuf DecodeError the quantizer raises on its truncated copy is one line too."""
    from google.protobuf.message import DecodeError

    from posbias_export.export.quantize import schemes

    def cut(self, path, names, head=()):
        raise DecodeError("Error parsing message with type 'onnx.ModelProto': Wire format was corrupt")

    monkeypatch.setattr(schemes.Int8, "quantize", cut)
    out = tmp_path / "model.onnx"
    assert main(["--bias", "alibi", "--quantize", "int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "quantizer could not read back its own copy" in err and f"writing {out} (--out)" in err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 800 KiB tmpfs (root and mount(8) needed; skipped where the machine refuses)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=800k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()[:80]}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
def test_t5_int8_out_dir_on_a_full_disk_is_one_line(small_disk, tmp_path):
    """The measured case: a T5 int8 --out-dir on a disk that fills while the quantizer works."""
    import hf_folders

    source = tmp_path / "t5"
    hf_folders.save_tiny_model("t5_gated", source)
    out = small_disk / "out"
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "--model", str(source), "--out-dir", str(out),
                           "--quantize", "int8"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"writing {out} (--out-dir)" in lines[0]
    assert list(small_disk.iterdir()) == []


def test_a_full_disk_while_the_weights_stream_is_the_documented_line(small_disk):
    """Weights above the streamed size are written piece by piece into the data file; a full disk
    there is ENOSPC naming --out (before: numpy's "9216 requested and 0 written", no errno)."""
    out = small_disk / "model.onnx"
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "--bias", "alibi", "--dim", "512", "--heads", "8",
                           "--layers", "2", "--skip-growth-check", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and f"writing {out} (--out)" in lines[0], lines
    assert list(small_disk.iterdir()) == []
