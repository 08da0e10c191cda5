"""What users export these models with today, for comparison (benchmarks, tests): a plain
torch.onnx.export(dynamo=True) of the transformers model, and Optimum's exporter where it is
installed. Their files are judged by validate --model like any other."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

import torch

from ..hf.models import architecture
from ..hf.validate import transformers_model


def optimum_cli() -> Path | None:
    """optimum-cli of the side environment clients/optimum_env.sh makes (it pins transformers
    < 4.58), if it has been made; None otherwise."""
    cli = Path(os.environ.get("OPTIMUM_VENV", ".optimum-venv")) / "bin" / "optimum-cli"
    return cli if cli.is_file() else None


class _FirstOutput(torch.nn.Module):
    """transformers model -> its logits (LMs) or last_hidden_state (the T5 encoder)."""

    def __init__(self, model, encoder: bool):
        super().__init__()
        self.model, self.encoder = model, encoder

    def forward(self, input_ids, attention_mask):
        if self.encoder:
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def dynamo_export(folder: str | Path, path: str | Path, model_type: str) -> Path:
    """input_ids, attention_mask [batch, seq] -> logits / last_hidden_state, dynamic axes."""
    encoder = architecture(model_type).arch == "encoder"
    module = _FirstOutput(transformers_model(Path(folder), model_type), encoder)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    args = (torch.randint(0, 100, (2, 16)), torch.ones(2, 16, dtype=torch.int64))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=({0: batch, 1: seq},) * 2,
                                    input_names=["input_ids", "attention_mask"],
                                    output_names=["last_hidden_state" if encoder else "logits"], verbose=False)
    program.save(str(path))
    return Path(path)


def optimum_export(folder: str | Path, out_dir: str | Path, model_type: str) -> Path:
    """Optimum's model.onnx for the folder (raises ImportError when optimum-onnx is missing)."""
    from optimum.exporters.onnx import main_export

    task = architecture(model_type).optimum_task
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        main_export(str(folder), output=str(out_dir), task=task, no_post_process=True)
    candidates = sorted(Path(out_dir).glob("*.onnx"))
    encoder = [p for p in candidates if "encoder" in p.name]
    path = (encoder or candidates)[0]
    import onnx

    names = {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}
    if "decoder_input_ids" in names:  # Optimum 2.1 writes T5 as one encoder-decoder file
        raise ValueError(f"Optimum wrote {path.name} as one encoder-decoder file (it needs decoder_input_ids); "
                         "there is no encoder-only file to compare")
    return path
