"""One imported-model file at one length in its own process, so its peak RSS is its own.

Run by path with onnxruntime and numpy only (no torch, no posbias_export). Feeds whatever the
file asks (input_ids, attention_mask, position_ids, empty past tensors), warms up once, times
`repeats` forwards, saves the first output of the last run (float32 .npy) for the error column
and prints one JSON line: times, peak RSS, RSS after loading; or {"error": one line}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from pathlib import Path

import numpy as np

from worker import peak_rss, rss_now  # same folder: run by path

# the inputs by name (runtimes/common/inputs.py: beside the package in a checkout, inside it installed)
_PACKAGE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_PACKAGE / "runtimes" if (_PACKAGE / "runtimes").is_dir() else _PACKAGE.parent / "runtimes"))
from common.inputs import Case, feeds_for as feeds_for_inputs  # noqa: E402


def feeds_for(session, length: int, vocab: int, seed: int = 0, batch: int = 1) -> dict[str, np.ndarray]:
    """`batch` rows of `length` random tokens, each input made by its name's generator (an empty
    cache: a prefill); rows after the first right-padded to lengths down to half (texts of
    different lengths in one batch, as embedding servers send them)."""
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int64)
    mask = np.ones_like(ids)
    for row in range(1, batch):
        mask[row, length - row * length // (2 * batch):] = 0
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    declared = [(v.name, v.shape, dtypes.get(v.type, np.int64)) for v in session.get_inputs()]
    return feeds_for_inputs(declared, Case(ids, mask))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="rows, right-padded to lengths down to half")
    p.add_argument("--save", help="where to save the first output (.npy)")
    args = p.parse_args(argv)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
        feeds = feeds_for(session, args.length, args.vocab, batch=args.batch)
        loaded_rss = rss_now()
        session.run(None, feeds)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = session.run(None, feeds)[0]
            times.append(time.perf_counter() - start)
    except Exception as err:  # the verdict of this cell: one line
        print(json.dumps({"error": str(err).strip().splitlines()[0][:300]}))
        return 0
    if args.save:
        np.save(args.save, out.astype(np.float32))
    print(json.dumps({"times": times, "peak_rss": peak_rss(), "loaded_rss": loaded_rss}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
