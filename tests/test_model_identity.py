"""A model is its .onnx AND the external-data files its graph names (runtimes/common/model_files.py):
no command writes a report or a model over a model's .data, and a model written with
--external-data is judged from any working folder (the checker looks beside the file)."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from test_cli import assert_one_line_error, run_cli

RUNTIMES = Path(__file__).resolve().parents[1] / "runtimes"
sys.path.insert(0, str(RUNTIMES))

from common.model_files import model_files  # noqa: E402


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def external(tmp_path_factory) -> Path:
    """A small LM written with --external-data into a folder of its own."""
    folder = tmp_path_factory.mktemp("ext") / "models"
    folder.mkdir()
    proc = run_cli("--bias", "alibi", "--out", str(folder / "m.onnx"), "--external-data")
    assert proc.returncode == 0, proc.stderr
    assert (folder / "m.onnx.data").is_file()
    return folder / "m.onnx"


@pytest.fixture
def corpus(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    words = [b"the", b"king", b"queen", b"speaks", b"of", b"love"]
    path = tmp_path / "words.txt"
    path.write_bytes(b" ".join(words[i] for i in rng.integers(0, len(words), 4000)))
    return path


def test_a_model_is_its_graph_and_its_data(external, tmp_path):
    assert model_files(external) == [external, external.with_name("m.onnx.data")]
    # a location the graph names is found whatever it is called
    proto = onnx.load(str(external))
    onnx.save_model(proto, str(tmp_path / "x.onnx"), save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    assert model_files(tmp_path / "x.onnx") == [tmp_path / "x.onnx", tmp_path / "weights.bin"]
    assert model_files(tmp_path / "notes.txt") == [tmp_path / "notes.txt"]


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_validate_does_not_write_its_report_over_the_data(external, flag):
    data = external.with_name("m.onnx.data")
    before = digest(data)
    proc = run_cli("validate", str(external), "--runtimes", "ort-cpu", "--lengths", "16", flag, str(data))
    assert_one_line_error(proc, "it is also an input (m.onnx.data)")
    assert digest(data) == before


def test_evaluate_does_not_write_its_report_over_the_data(external, corpus):
    data = external.with_name("m.onnx.data")
    before = digest(data)
    proc = run_cli("evaluate", str(external), "--corpus", str(corpus), "--lengths", "16", "--json", str(data))
    assert_one_line_error(proc, "it is also an input (m.onnx.data)")
    assert digest(data) == before


def test_export_does_not_write_over_a_checkpoint_named_like_its_data(tmp_path):
    checkpoint = tmp_path / "w.onnx.data"
    checkpoint.write_bytes(b"the user's tensors")
    proc = run_cli("--bias", "alibi", "--checkpoint", str(checkpoint), "--external-data", "--out", str(tmp_path / "w.onnx"))
    assert_one_line_error(proc, "it is also an input (w.onnx.data)")
    assert checkpoint.read_bytes() == b"the user's tensors"
    assert not (tmp_path / "w.onnx").exists()


def test_validate_and_evaluate_judge_external_data_from_any_folder(external, corpus, tmp_path):
    """Relative and absolute paths, from a working folder that holds no namesake .data."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for path in (str(external), str(Path("..") / Path(*external.parts[-2:]))):
        cwd = elsewhere if Path(path).is_absolute() else external.parent.parent / "sibling"
        cwd.mkdir(exist_ok=True)
        proc = run_cli("validate", path, "--runtimes", "ort-cpu", "--lengths", "16,48", cwd=cwd)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        assert "ALL PASS" in proc.stdout
    proc = run_cli("evaluate", str(external), "--corpus", str(corpus), "--lengths", "16", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr


def test_re_export_with_external_data_to_the_same_out(tmp_path):
    """Twice to the same --out, and to sub/x.onnx while ./x.onnx.data exists: both written."""
    for _ in range(2):
        proc = run_cli("--bias", "alibi", "--out", "x.onnx", "--external-data", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    (tmp_path / "sub").mkdir()
    proc = run_cli("--bias", "alibi", "--out", "sub/x.onnx", "--external-data", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sub" / "x.onnx.data").stat().st_size > 0


def test_an_in_memory_model_saved_with_external_data_ignores_the_working_folder(tmp_path, monkeypatch):
    """save_checked's own path for a model whose tensors are all in memory: onnx refuses a
    location that exists in the working folder; a namesake there must not matter."""
    from posbias_export.export.files import save_checked

    source = onnx.load(str(_small_model(tmp_path)))
    (tmp_path / "m.onnx.data").write_bytes(b"a namesake")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = save_checked(source, Path("sub/m.onnx"), lambda path: onnx.checker.check_model(path), external=True)
    assert saved.data_path == Path("sub/m.onnx.data") and saved.data_path.stat().st_size > 0
    assert (tmp_path / "m.onnx.data").read_bytes() == b"a namesake"


def _small_model(folder: Path) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    path = folder / "small.onnx"
    onnx.save_model(helper.make_model(graph), str(path))
    return path
