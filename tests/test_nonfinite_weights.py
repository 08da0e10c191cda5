"""No weight with NaN or infinity ships, whatever its size: an imported folder's small tensors
(norms, biases, most weights of a small model; read whole when the skeleton is traced) are checked
as the large ones are while they stream, for every kind of export, and the refusal names the
tensor. Before, they passed unchecked: --out, --out-dir, int4 and the int8 cache wrote files with
NaN logits, and int8 died in ONNX Runtime's quantizer with a traceback."""
from __future__ import annotations

import numpy as np
import pytest

from posbias_export.cli import main as cli_main

pytest.importorskip("transformers")

BAD = {"transformer.h.1.post_attention_layernorm.weight": np.nan,  # 48 values
       "transformer.h.0.self_attention.dense.weight": np.inf}  # 2304 values, far below the streamed size


@pytest.fixture(scope="module", params=list(BAD))
def bad_folder(request, tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    from posbias_export.hf.tiny import save_tiny_folder

    folder = save_tiny_folder("bloom", tmp_path_factory.mktemp("bad") / "bloom")
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors[request.param][..., 1] = BAD[request.param]
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder, request.param


@pytest.mark.parametrize("argv", [["--out", "x.onnx"], ["--out", "x.onnx", "--quantize", "int8"],
                                  ["--out", "x.onnx", "--quantize", "int4"],
                                  ["--out", "x.onnx", "--kv-cache", "--target", "ort", "--kv-dtype", "int8"],
                                  ["--out-dir", "shipped"]], ids=["out", "int8", "int4", "int8-cache", "out-dir"])
def test_a_non_finite_small_weight_is_refused_by_name(bad_folder, argv, tmp_path, capsys):
    folder, name = bad_folder
    argv = [a if a not in ("x.onnx", "shipped") else str(tmp_path / a) for a in argv]
    assert cli_main(["--model", str(folder), "--skip-growth-check", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and "NaN or infinity" in err[0], err
    assert not any(tmp_path.iterdir())  # nothing written
