"""The runtime capability table (parity/capabilities.py) is measured, not asserted: for each
file feature it lists, the runtimes it names really fail such a file, and every other default
runtime installed here passes it; validate's defaults follow the table."""
from __future__ import annotations

import pytest

from posbias_export.cli import main as cli_main
from posbias_export.parity import installed_defaults
from posbias_export.parity.capabilities import FEATURES, GAPS, cannot_run, runnable
from posbias_export.parity.matrix import run_matrix
from posbias_export.parity.reference import ModelFile

SMALL = ["--heads", "4", "--dim", "64", "--layers", "2", "--skip-growth-check"]
# a file with each feature of the table (and only the features it implies)
FEATURE_FILES = {
    "quantized weights": ["--quantize", "int8"],
    "in-place cache": ["--kv-cache", "--target", "ort"],
    "com.microsoft.GroupQueryAttention": ["--kv-cache", "--target", "ort"],
    "an int4 table wider than a whole number of blocks": ["--quantize", "int4", "--dim", "48"],
}


def test_every_feature_has_a_file_and_every_gap_a_known_feature():
    assert set(FEATURE_FILES) == set(FEATURES) and {g.feature for g in GAPS} <= set(FEATURES)


@pytest.fixture(scope="module")
def feature_files(tmp_path_factory):
    made = {}
    for feature, argv in FEATURE_FILES.items():
        path = tmp_path_factory.mktemp("cap") / "m.onnx"
        assert cli_main(["--bias", "alibi", "--out", str(path), *SMALL, *argv]) == 0
        made[feature] = path
    return made


@pytest.mark.parametrize("feature", list(FEATURE_FILES))
def test_the_table_says_what_each_runtime_does_with_the_feature(feature_files, feature):
    file = ModelFile.read(feature_files[feature])
    assert FEATURES[feature](file)
    installed, _ = installed_defaults()
    listed = {r for g in GAPS if g.feature == feature for r in g.runtimes} & set(installed)
    matrix = run_matrix(feature_files[feature], installed, (1, 17), batch=2, order=False)
    for name in installed:
        cells = [c for c in matrix.cells if c.runtime == name]
        ok = all(c.ok for c in cells)
        if name in listed:
            assert not ok, f"{name} runs a file with {feature}: the table is stale"
        elif cannot_run(name, [file]) is None:
            assert ok, (name, [(c.case, c.verdict) for c in cells])


def test_validate_defaults_follow_the_table(feature_files):
    file = ModelFile.read(feature_files["in-place cache"])
    chosen, skipped = runnable(("ort-cpu", "openvino", "node", "reference"), [file])
    assert chosen == ("ort-cpu", "ort-cpu-shared", "node", "reference")  # its GroupQueryAttention with a cache
    assert set(skipped) == {"openvino"} and "GroupQueryAttention" in skipped["openvino"]
