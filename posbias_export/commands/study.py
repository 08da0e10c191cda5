"""train, evaluate, extrapolation: train short, test long (posbias_export/study/)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import int_list, parser, positive_int


def build_train_parser() -> argparse.ArgumentParser:
    from ..biases import BIASES
    from ..study.train import SCHEMES

    p = parser("train", "Train a byte-level decoder on a text corpus (CPU, deterministic for a seed); writes "
                "OUT.safetensors and OUT.md (model card).", "example:\n  python -m posbias_export train --bias alibi "
                "--corpus ../shared/data/tinyshakespeare.txt --train-len 64 --steps 600 --out models/alibi")
    p.add_argument("--bias", required=True, help=f"a bias ({', '.join(BIASES)}) or a scheme ({', '.join(SCHEMES)})")
    p.add_argument("--corpus", required=True, help="a text file (read as bytes); its last 10%% is held out")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--train-len", type=positive_int, default=64, help="training sequence length (default 64)")
    p.add_argument("--steps", type=positive_int, default=600, help="optimizer steps (default 600)")
    p.add_argument("--batch", type=positive_int, default=32, help="sequences per step (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="init and data order seed (default 0)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--dim", type=positive_int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer layers (default 2)")
    return p


def run_train(args) -> int:
    from ..study.train import train_to_files

    path, card = train_to_files(args.bias, args.corpus, args.out, train_len=args.train_len, steps=args.steps,
                                batch=args.batch, lr=args.lr, seed=args.seed, heads=args.heads, dim=args.dim,
                                layers=args.layers, command="python -m posbias_export train " + " ".join(args.argv))
    print(f"wrote {path} and .md: final loss {card['final_loss']:.4f}")
    return 0


def _perplexity_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--corpus", required=True, help="a text file; perplexity is measured on its last 10%%")
    p.add_argument("--lengths", type=int_list, default=(64, 128, 256, 512, 1024),
                   help="comma-separated evaluation lengths (default 64,128,256,512,1024)")
    p.add_argument("--max-tokens", type=positive_int, default=16384, help="held-out tokens per length (default 16384)")
    return p


def build_evaluate_parser() -> argparse.ArgumentParser:
    p = parser("evaluate", "Perplexity vs evaluation length through ONNX Runtime over non-overlapping windows of the "
                "corpus's held-out split (its last 10%), checked against PyTorch.")
    p.add_argument("model", help="an lm export (e.g. python -m posbias_export --checkpoint models/alibi.safetensors "
                   "--out m.onnx)")
    _perplexity_options(p)
    p.add_argument("--checkpoint", help="weights for the PyTorch cross-check (default: the file's metadata)")
    p.add_argument("--json", help="write the results as JSON")
    return p


def run_evaluate(args) -> int:
    from tqdm import tqdm

    from ..study.evaluate import evaluate_to_files, format_results

    with tqdm(total=len(args.lengths), desc="evaluate", unit="length", disable=None, file=sys.stderr) as bar:
        results = evaluate_to_files(args.model, args.corpus, args.lengths, args.max_tokens, args.checkpoint,
                                    args.json, progress=bar.update)
    print(format_results(results))
    return 0


def build_extrapolation_parser() -> argparse.ArgumentParser:
    p = parser("extrapolation", "Export every checkpoint in --models, evaluate perplexity vs length on ONNX Runtime "
                "(checked against PyTorch); write extrapolation.md/.json/.png.")
    p.add_argument("--models", default="models", help="a folder of .safetensors checkpoints (default models)")
    _perplexity_options(p)
    p.add_argument("--out-dir", default="benchmarks", help="where the results files go (default benchmarks)")
    return p


def run_extrapolation(args) -> int:
    from tqdm import tqdm

    from ..study.extrapolation import run

    count = len(list(Path(args.models).glob("*.safetensors")))
    with tqdm(total=count, desc="extrapolation", unit="model", disable=None, file=sys.stderr) as bar:
        run(args.models, args.corpus, args.lengths, args.max_tokens, args.out_dir, progress=bar.update)
    print((Path(args.out_dir) / "extrapolation.md").read_text())
    return 0
