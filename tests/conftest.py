"""Shared fixtures: exported models are cached per session (exports take seconds each)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import posbias_export as pbe
import tiers
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


@pytest.fixture
def as_built(monkeypatch):
    """Exports made in this test keep each blocked body as its builder made it (helpers called by
    name, index arithmetic inside the If branches): for the tests that read a body's design. What
    export/hoist.py then does to it (every export) is tests/test_hoist.py's."""
    from posbias_export.export import pipeline

    monkeypatch.setattr(pipeline, "hoist_functions", lambda proto: proto)


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    return ExportCache(tmp_path_factory.mktemp("exports"))


def cli_model(bias: str, arch: str = "lm", causal: bool = True):
    """The PyTorch model ExportCache.cli builds for these flags (seed 0)."""
    return pbe.build_model(pbe.ModelConfig(bias=bias, causal=causal, **SMALL), seed=0, arch=arch)


# The default run's tiers are data (tests/tiers.py): a family's `test_tier`, the slow ids named at a
# parametrize site, the tests measured long (slow_by_time.txt); each checked to exist at collection.


def pytest_addoption(parser):
    parser.addoption("--family", action="append", default=[], metavar="NAME",
                     help="run every cell parametrized by this bias family, default and slow alike (repeatable)")


def pytest_configure(config):
    families = config.getoption("family")
    unknown = [f for f in families if f not in pbe.BIASES]
    if unknown:
        raise pytest.UsageError(f"--family {unknown[0]!r}: choose from {', '.join(pbe.BIASES)}")
    explicit = any(a == "-m" or a.startswith("-m") and len(a) > 2 for a in config.invocation_params.args)
    if families and not explicit:
        config.option.markexpr = ""  # a family's slow cells too (unless -m is given): the whole contract


def item_families(item) -> set[str]:
    """The registered families an item is parametrized by (a parameter that names one)."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return set()
    values = [v for value in spec.params.values() for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return {v for v in values if isinstance(v, str) and v in pbe.BIASES}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    tiers.mark_measured(items, tiers.measured_slow(), config.args)
    families = set(config.getoption("family"))
    if families:
        keep = [item for item in items if item_families(item) & families]
        config.hook.pytest_deselected(items=[item for item in items if not item_families(item) & families])
        items[:] = keep
