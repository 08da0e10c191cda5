"""Every architecture of the registry (hf/imported.py ARCHITECTURES) has a tiny folder in the one
factory (hf/tiny.py), and its export passes validate against the folder: a new architecture
without either fails here."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import onnx  # noqa: E402

from posbias_export.export.roles import ROLES, leading_inputs, role  # noqa: E402
from posbias_export.hf.models import ARCHITECTURES  # noqa: E402
from posbias_export.hf.tiny import VARIANTS, save_tiny_folder  # noqa: E402
from posbias_export.validation import validate  # noqa: E402


def test_every_architecture_has_a_tiny_variant():
    covered = {v.model_type for v in VARIANTS.values()}
    assert set(ARCHITECTURES) <= covered, f"no tiny folder for {sorted(set(ARCHITECTURES) - covered)}: add one to hf/tiny.py"
    assert covered <= set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_architecture_exports_and_passes_validate(tmp_path, model_type):
    from posbias_export.hf.export import export_model

    kind = next(k for k, v in VARIANTS.items() if v.model_type == model_type)  # its first variant
    folder = save_tiny_folder(kind, tmp_path / kind)
    path = tmp_path / f"{kind}.onnx"
    export_model(folder, path, block=16, check_growth=False)
    result = validate([path], ["ort-cpu"], (1, 40), batch=2, model_dir=folder, order=False)
    cells = result.matrices[0].cells
    assert result.ok, [(c.runtime, c.case, c.verdict) for c in cells if not c.ok]
    model = ARCHITECTURES[model_type]
    assert {c.runtime for c in cells} == {"ort-cpu"} | ({"transformers"} if model.transformers_class else set())
    # the file takes and gives what its architecture's role declares (export/roles.py)
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [i.name for i in graph.input] == leading_inputs(model.role, model.extra_inputs)
    assert graph.output[0].name == role(model.role).outputs[0]


def test_every_input_of_every_role_has_a_generator():
    from posbias_export.runners import runtimes_common

    generators = set(runtimes_common("inputs").GENERATORS)
    encoder_tensors = {"encoder_hidden_states", "encoder_attention_mask"}  # the encoder's, given by the case
    for r in ROLES.values():
        assert set(leading_inputs(r.name)) <= generators | encoder_tensors, r
