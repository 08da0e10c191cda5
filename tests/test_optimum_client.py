"""Optimum (ORTModelForCausalLM / ORTModelForSeq2SeqLM, in its side environment: side_env.py) on
the folders `--out-dir` writes, as bench-clients runs it (clients/checks.py run_optimum): greedy
tokens equal transformers' generate and prefill logits within float32 rounding of transformers',
for a causal LM and both seq2seq architectures (T5, UMT5: the role decides, not the name)."""
from __future__ import annotations

import numpy as np
import pytest

from side_env import SIDE_ENV, side_python

pytest.importorskip("transformers")

from posbias_export.clients import checks  # noqa: E402
from posbias_export.hf.ship import ship  # noqa: E402

# float32 on both sides (transformers' logits in float64 from float32 weights): the tiny models'
# logits are O(1-10), their float32 rounding differences O(1e-5); 1e-3 leaves room for the
# different kernels' summation orders and nothing for a wrong position, mask or weight
LOGIT_TOLERANCE = 1e-3


@pytest.mark.parametrize("kind", ["bloom", "t5", "umt5"])
def test_optimum_runs_our_folder_like_transformers(kind, tmp_path, monkeypatch):
    side_python()
    monkeypatch.setenv("OPTIMUM_VENV", str(SIDE_ENV))
    source = checks.make_folder(kind, tmp_path / kind)
    shipped = tmp_path / f"{kind}_out"
    ship(source, shipped, check_growth=False)
    prompt = np.random.default_rng(3).integers(3, checks.VOCAB, 12).tolist()
    tokens, logits = checks.reference(kind, source, prompt)
    np.save(tmp_path / "reference.npy", logits)
    case = {"id": f"{kind}/short", "model_type": kind, "seq2seq": checks.seq2seq(kind), "source": str(source),
            "shipped": str(shipped), "prompt": prompt, "new": checks.NEW_TOKENS, "pad": checks.PAD,
            "start": checks.PAD, "own_export": False, "reference_logits": str(tmp_path / "reference.npy"),
            "reference_tokens": tokens}
    rows = checks.run_optimum([case], tmp_path)
    row = next(r for r in rows if r["client"] == "Optimum, this folder")  # its own export: bench-clients' row
    assert "error" not in row, row
    assert row["tokens_equal"], row
    assert row["logit_error"] < LOGIT_TOLERANCE, row


def test_bench_clients_refuses_an_embedder_in_one_line(tmp_path):
    from posbias_export.cli import main

    assert main(["bench-clients", "--models", "jina_bert", "--out-dir", str(tmp_path / "o"), "--no-optimum"]) == 2
    assert not (tmp_path / "o").exists()
    assert checks.SUPPORTED == ("bloom", "falcon", "mpt", "t5", "umt5")


def test_the_side_environment_is_not_the_projects():
    """Optimum's pin (transformers < 4.58) lives in its side environment, not in ours."""
    import subprocess

    import transformers

    def minor(version: str) -> tuple[int, int]:
        return tuple(int(x) for x in version.split(".")[:2])

    side = subprocess.run([str(side_python()), "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert minor(side) < (4, 58) <= minor(transformers.__version__), (side, transformers.__version__)
