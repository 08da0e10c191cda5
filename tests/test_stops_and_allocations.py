"""A stop or an allocation too large keeps its one line: Ctrl-C or SIGTERM during the first
`import onnxruntime` reaches Python as pybind11's ImportError("initialization failed") raised
from the KeyboardInterrupt (before: a 52-line traceback, exit 1, or "onnxruntime is not
installed"), and generate's in-place buffer, allocated whole before the first step, is asked of
the machine first (before: std::bad_alloc from inside ONNX Runtime)."""
from __future__ import annotations

import builtins

import pytest

from posbias_export import cli
from posbias_export.parity import load_runner
from posbias_export.runners import atomic, runtimes_common


def wrapped_stop(stop: KeyboardInterrupt) -> ImportError:
    """What pybind11 raises when a signal lands while its module initialises."""
    try:
        try:
            raise stop
        except KeyboardInterrupt as err:
            raise ImportError("initialization failed") from err
    except ImportError as err:
        return err


@pytest.mark.parametrize("stop, code, word", [(atomic().Terminated(), 143, "terminated"),
                                              (KeyboardInterrupt(), 130, "interrupted")])
def test_a_stop_during_an_extension_import_is_one_line(monkeypatch, capsys, stop, code, word):
    def dispatch(argv):
        raise wrapped_stop(stop)

    monkeypatch.setattr(cli, "dispatch", dispatch)
    assert cli.main(["--bias", "alibi", "--out", "x.onnx"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [f"posbias-export: {word}"]


def test_an_import_error_that_is_not_a_stop_still_raises(monkeypatch):
    def dispatch(argv):
        raise ImportError("libfoo.so: cannot open shared object file")

    monkeypatch.setattr(cli, "dispatch", dispatch)
    with pytest.raises(ImportError, match="libfoo"):
        cli.main(["--bias", "alibi", "--out", "x.onnx"])


def test_the_runner_says_stopped_not_missing(monkeypatch):
    run = load_runner("ort/run.py")
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "onnxruntime":
            raise wrapped_stop(atomic().Terminated())
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(KeyboardInterrupt):
        run.create_session("any.onnx")


def test_an_inplace_cache_larger_than_the_machine_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "kv.onnx"
    assert cli.main(["--bias", "alibi", "--kv-cache", "--target", "ort", "--out", str(path), "--heads", "2",
                     "--dim", "32", "--layers", "1", "--skip-growth-check"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(runtimes_common("memory"), "available_bytes", lambda: 1 << 20)  # a 1 MB machine
    generate = load_runner("ort/generate.py")
    # 2 tensors x 2 heads x 16 x 4 bytes = 256 bytes a token: 8192 tokens are 2 MB
    assert generate.main([str(path), "--prompt", "hi", "--max-new-tokens", "8190"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the in-place cache (1 rows of 8192 tokens) needs 0.0021 GB" in err[0], err
    monkeypatch.setattr(runtimes_common("memory"), "available_bytes", lambda: 1 << 30)
    assert generate.main([str(path), "--prompt", "hi", "--max-new-tokens", "8"]) == 0
