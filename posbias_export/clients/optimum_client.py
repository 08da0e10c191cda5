"""Optimum (ORTModelForCausalLM / ORTModelForSeq2SeqLM) on the folders bench-clients wrote, and
on Optimum's own export of the same source folders, in Optimum's side environment (see
optimum_env.sh): no posbias_export import. argv: a JSON file of cases; prints one JSON line per
case: the greedy tokens and the prefill logits' max abs error against the reference logits the
case names (transformers in the project's environment)."""
from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.simplefilter("ignore")


def load(seq2seq: bool, folder: str):
    from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForSeq2SeqLM

    return (ORTModelForSeq2SeqLM if seq2seq else ORTModelForCausalLM).from_pretrained(folder)


def measure(model, case: dict) -> dict:
    ids = torch.tensor([case["prompt"]])
    mask = torch.ones_like(ids)
    kwargs = {"decoder_start_token_id": case["start"]} if case["seq2seq"] else {}
    with torch.no_grad():
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=case["new"], do_sample=False,
                                pad_token_id=case["pad"], **kwargs)[0].tolist()
        if case["seq2seq"]:
            logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.tensor([[case["start"]]])).logits
        else:
            logits = model(input_ids=ids, attention_mask=mask).logits
    reference = np.load(case["reference_logits"])
    return {"tokens": tokens, "logit_error": float(np.abs(logits[0].numpy().astype(np.float64) - reference).max())}


def optimum_export(case: dict, out: Path) -> str:
    from optimum.exporters.onnx import main_export

    task = "text2text-generation-with-past" if case["seq2seq"] else "text-generation-with-past"
    main_export(case["source"], output=str(out), task=task)
    return str(out)


def first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)[:200]


def main() -> int:
    import optimum.onnxruntime  # noqa: F401  (fails here, not per case, when the environment is broken)
    import transformers

    cases = json.loads(Path(sys.argv[1]).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        exports: dict[str, str] = {}
        for case in cases:
            row = {"case": case["id"], "transformers": transformers.__version__}
            # quantized folders: only ours (Optimum's own export of the source is the float rows' cell)
            for which in ("ours", "optimum") if case.get("own_export", True) else ("ours",):
                try:
                    if which == "ours":
                        folder = case["shipped"]
                    else:
                        if case["source"] not in exports:
                            exports[case["source"]] = optimum_export(case, Path(tmp) / case["model_type"])
                        folder = exports[case["source"]]
                    row[which] = measure(load(case["seq2seq"], folder), case)
                except Exception as err:  # noqa: BLE001 - a client that fails is a result
                    row[which] = {"error": first_line(err)}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
