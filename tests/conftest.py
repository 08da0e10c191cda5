"""Shared fixtures: exported models are cached per session (exports take seconds each)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import posbias_export as pbe
from posbias_export.cli import main as cli_main

TRACE_LEN = 16
SMALL = dict(num_heads=4, dim=64, num_layers=2)  # small enough for 4096-token fp64 references


def ort_session(path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_run(session: ort.InferenceSession, *arrays) -> np.ndarray:
    names = [i.name for i in session.get_inputs()]
    feeds = {n: (a.numpy() if isinstance(a, torch.Tensor) else a) for n, a in zip(names, arrays)}
    return session.run(None, feeds)[0]


def lm_inputs(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


class ExportCache:
    """Exports through the CLI entry point (in-process) once per configuration."""

    def __init__(self, root):
        self.root = root
        self.paths = {}

    def cli(self, bias: str, arch: str = "lm", causal: bool = True, extra: tuple = (), growth_check: bool = False):
        """growth_check: also the second trace (test_export.py holds every family to it); the
        other users of a file need not pay for it again."""
        key = (bias, arch, causal, extra)
        if key not in self.paths:
            path = self.root / f"{bias}_{arch}_{'causal' if causal else 'bidir'}_{len(self.paths)}.onnx"
            argv = ["--bias", bias, "--arch", arch, "--out", str(path), "--trace-len", str(TRACE_LEN),
                    "--heads", str(SMALL["num_heads"]), "--dim", str(SMALL["dim"]), "--layers", str(SMALL["num_layers"])]
            argv += [] if causal else ["--bidirectional"]
            argv += [] if growth_check else ["--skip-growth-check"]
            assert cli_main(argv + list(extra)) == 0, f"export failed: {argv}"
            self.paths[key] = path
        return self.paths[key]


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    return ExportCache(tmp_path_factory.mktemp("exports"))


def cli_model(bias: str, arch: str = "lm", causal: bool = True):
    """The PyTorch model ExportCache.cli builds for these flags (seed 0)."""
    return pbe.build_model(pbe.ModelConfig(bias=bias, causal=causal, **SMALL), seed=0, arch=arch)


# --- the default run's grid ------------------------------------------------------------------
# Tests parametrized over every family run the whole grid under `-m slow` (with the other slow
# tests); the default run (CI, ~8 minutes on 2 cores with two workers) keeps the families that take distinct
# paths through the exporters: alibi (key row, folded, features), kerple_log (distance table),
# t5 (learned buckets), window (look-back). kerple_power and sandwich share kerple_log's table
# path (their formulas are checked against the papers in test_biases.py) and none is the baseline
# every family is built on; their cells in these grids, and the repeated variants below, move to
# the slow run.
EXTENDED_FAMILIES = {"kerple_power", "sandwich", "none"}
GRID_TESTS = {
    "test_cli_export_passes_checks", "test_runtimes_run_both_forms", "test_gpu_target_matches_plain_float64",
    "test_own_attention_mask_exports_see_no_holes", "test_file_independent_of_trace_length",
    "test_ort_blocked_at_4096_bench_shape", "test_default_export_has_functions_inline_export_has_none",
    "test_padded_rows", "test_ort_cpu_opset23_attention_op", "test_plain_export_shares_fixed_bias_nodes",
    "test_runtime_matches_pytorch", "test_greedy_tokens_equal_pytorch", "test_ort_cpu_lm_causal",
    "test_ort_cpu_block", "test_ort_cpu_lm_bidirectional", "test_bidirectional_blocked_export_matches_plain_float64",
    "test_exported_loop_matches_reference_across_block_boundaries", "test_quantized_checkpoint_passes_policy",
}
EXTENDED_IDS = {  # test -> ids (or the parts of them) whose cells run under -m slow only
    "test_onnxruntime_web_generates_transformers_tokens": {"mpt", "falcon"},  # bloom stays (and the quantized cells)
    "test_greedy_tokens_equal_pytorch": {"kerple_log-prompt1", "sandwich-prompt1"},  # each prompt-1 case exports
    "test_gpu_target_matches_plain_float64": {"cuda-bidirectional"},  # cuda-ort keeps the bidirectional cells
    "test_imported_file_and_transformers_agree_under_holes": {"mpt-plain", "falcon-plain", "t5-plain"},
    "test_position_schemes_export_and_match": {"sinusoidal", "rope-linear"},
    # quantized imported files: BLOOM here, every architecture under -m slow
    "test_quantized_imported_model_passes_validate": {"mpt", "falcon"},
    # the CLI's one-line errors as a real process: two here, all of them in-process in test_bad_inputs.py
    "test_errors_are_one_line_exit_2_and_leave_no_file": {"args2", "args3", "args4", "args5"},
    # the inlined form on every runtime: alibi here, every family under -m slow
    "test_runtimes_run_both_forms": {"kerple_log-inlined", "t5-inlined", "window-inlined"},
}
# Smoke runs of the benchmark commands whose results files are committed (bench-decode,
# bench-models, extrapolation): each spends its time in subprocesses timing things; `bench` itself
# stays in the default run.
SLOW_TESTS = {"test_bench_decode_smoke", "test_bench_models_measures_each_exporter", "test_extrapolation_command_smoke"}


def _extended(item) -> bool:
    name = item.originalname
    if name in SLOW_TESTS:
        return True
    spec = getattr(item, "callspec", None)
    if spec is None:
        return False
    if name in GRID_TESTS and any(isinstance(v, str) and v in EXTENDED_FAMILIES for v in spec.params.values()):
        return True
    return any(part == spec.id or f"-{part}" in f"-{spec.id}" for part in EXTENDED_IDS.get(name, ()))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _extended(item):
            item.add_marker(pytest.mark.slow)
