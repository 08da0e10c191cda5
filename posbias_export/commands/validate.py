"""validate: every file on every runtime against a float64 PyTorch reference (the session
itself is posbias_export/validation.py)."""
from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from .options import int_list, name_list, parser, positive_int

VALIDATE_EXAMPLES = """examples:
  python -m posbias_export validate model.onnx
  python -m posbias_export validate model.onnx --runtimes ort-cpu,ort-cuda --lengths 1,17,4096 --batch 3
  python -m posbias_export validate model.onnx --inputs my_inputs.npz --json report.json
  python -m posbias_export validate a.onnx b.onnx --markdown benchmarks/parity.md

exit codes: 0 every runtime passed; 1 a failure, an error or an unavailable runtime; 2 bad usage
"""

def build_validate_parser() -> argparse.ArgumentParser:
    from ..parity import DEFAULT_RUNTIMES, RUNTIMES

    p = parser("validate", "Run an exported model on several runtimes and compare each with a float64 PyTorch "
                "reference rebuilt from the file's metadata.", VALIDATE_EXAMPLES)
    p.add_argument("models", nargs="+", help="ONNX files written by posbias_export (with --model: any exporter's)")
    p.add_argument("--runtimes", type=name_list, default=None,
                   help=f"comma-separated, from: {', '.join(RUNTIMES)} (default: those of {','.join(DEFAULT_RUNTIMES)} "
                   "that are installed; a runtime named here that is not installed is a failure)")
    p.add_argument("--lengths", type=int_list, default=None,
                   help="comma-separated sequence lengths to test (default 1,17 and 64x the trace length)")
    p.add_argument("--batch", type=positive_int, default=3, help="rows per generated input (default 3)")
    p.add_argument("--checkpoint", help="trained weights the model was exported from (else metadata/seed)")
    p.add_argument("--inputs", help="your own inputs (.npz) instead of generated lengths")
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face folder (BLOOM, MPT, Falcon alibi, T5): judge "
                   "the files (any exporter's) against this model, left-padded batches, real tokens compared")
    p.add_argument("--ignore-size-limits", action="store_true",
                   help="run lengths and batches whose memory estimate exceeds this machine's (refused by default)")
    p.add_argument("--skip-order-check", action="store_true",
                   help="skip the order protocol (one session running every case in ascending then descending size, "
                   "compared bit for bit with fresh sessions): a third of the runtime work")
    p.add_argument("--reference-device", choices=("cpu", "cuda"), default="cpu",
                   help="where the float64 PyTorch reference (and the per-precision floors) of our own files run "
                   "(cuda: PyTorch on the GPU, TF32 off; default cpu)")
    p.add_argument("--json", help="write the full report as JSON")
    p.add_argument("--markdown", help="write the matrix as markdown")
    return p


def run_validate(args) -> int:
    from ..export import check_outputs

    if args.json and args.markdown and args.json == args.markdown:
        raise UsageError("--json and --markdown name the same file")
    check_outputs([args.json, args.markdown], [*args.models, args.inputs, args.checkpoint])
    if args.model and (args.checkpoint or args.inputs):
        raise UsageError("--model judges generated left-padded inputs against the folder's model; drop "
                       + ("--checkpoint" if args.checkpoint else "--inputs"))
    if args.reference_device != "cpu":
        from ..parity.reference import use_reference_device

        use_reference_device(args.reference_device)
    return report_validation(args.models, args.runtimes, args.lengths, args.batch, args.checkpoint, args.inputs,
                             args.json, args.markdown, args.model, args.ignore_size_limits, not args.skip_order_check)


def report_validation(models, runtimes, lengths, batch, checkpoint=None, inputs=None, json_path=None, markdown=None,
                      model_dir=None, ignore_size_limits: bool = False, order: bool = True) -> int:
    from tqdm import tqdm

    from ..parity import format_matrix
    from ..validation import choose_runtimes, validate, write_reports

    chosen, skipped = choose_runtimes(runtimes)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    with tqdm(total=len(models) * len(chosen), desc="validate", unit="runtime", disable=None, file=sys.stderr) as bar:
        result = validate(models, runtimes, lengths, batch, checkpoint, inputs, model_dir, progress=bar.update,
                          ignore_size_limits=ignore_size_limits, order=order)
    for name, reason in result.skipped.items():
        if name not in skipped:  # decided per file (a quantized file on the reference evaluator)
            print(f"skipping {name}: {reason}", file=sys.stderr)
    for matrix in result.matrices:
        print(format_matrix(matrix))
    write_reports(result, json_path, markdown, lengths, batch)
    return 0 if result.ok else 1
