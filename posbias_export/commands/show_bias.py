"""show-bias: a family's bias drawn per head from its float64 reference (biases/drawing.py)."""
from __future__ import annotations

import argparse

from ..errors import UsageError
from .options import key_value, parser, positive_int

SHOW_BIAS_EXAMPLES = """examples:
  python -m posbias_export show-bias alibi --out alibi.png
  python -m posbias_export show-bias window --bias-param window=8 --length 32 --out window.png
  python -m posbias_export show-bias t5 --bidirectional --heads 8 --out t5.png
  python -m posbias_export show-bias kerple_log --checkpoint models/kerple_log.safetensors --out trained.png
"""


def build_show_bias_parser() -> argparse.ArgumentParser:
    from ..biases import BIASES
    from ..biases.drawing import MAX_HEADS, MAX_LENGTH

    p = parser("show-bias", "Draw a bias family's values per head, from its float64 reference (the paper's "
               "formula): query i down, key j across, one colour scale, masked positions grey.", SHOW_BIAS_EXAMPLES)
    p.add_argument("name", metavar="NAME", help=f"a bias family: {', '.join(BIASES)}")
    p.add_argument("--out", required=True, help="the picture to write (atomically): PNG, SVG or PDF by its suffix")
    p.add_argument("--length", type=positive_int, default=64, help=f"positions (2..{MAX_LENGTH}; default 64)")
    p.add_argument("--heads", type=positive_int, default=4, help=f"attention heads, one panel each (1..{MAX_HEADS}; "
                   "default 4)")
    p.add_argument("--bidirectional", action="store_true", help="no causal mask; the symmetric bias")
    p.add_argument("--bias-param", type=key_value, action="append", default=[], metavar="NAME=VALUE",
                   help="a hyper-parameter of the family (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="initial values of a learned family (default 0)")
    p.add_argument("--checkpoint", help="draw a trained model's first layer instead (its config decides the rest)")
    return p


def run_show_bias(args) -> int:
    from ..biases import AttentionBias, bias_class, create_bias
    from ..biases.drawing import MAX_HEADS, draw_bias, picture_format
    from ..export import check_outputs

    bias_class(args.name)  # an unknown family: one line, before anything else
    picture_format(args.out)
    if args.heads > MAX_HEADS:  # each head is a panel of L x L cells: bounded before anything is built
        raise UsageError(f"--heads must be at most {MAX_HEADS} (one panel each), got {args.heads}")
    check_outputs([args.out], [args.checkpoint])
    if args.checkpoint:
        from ..nn import load_checkpoint

        if args.bias_param or args.bidirectional:
            raise UsageError("--checkpoint brings its own hyper-parameters and mask; drop --bias-param/--bidirectional")
        model = load_checkpoint(args.checkpoint)
        bias = next(m for m in model.modules() if isinstance(m, AttentionBias))
        if bias.name != args.name:
            raise UsageError(f"{args.checkpoint} holds a {bias.name} model, not {args.name}")
    else:
        bias = create_bias(args.name, args.heads, causal=not args.bidirectional, seed=args.seed,
                           **dict(args.bias_param))
    draw_bias(bias, args.length, args.out)
    print(f"wrote {args.out}: {bias.name}, {bias.num_heads} heads, {args.length} positions "
          f"({'causal' if bias.causal else 'bidirectional'})")
    return 0
