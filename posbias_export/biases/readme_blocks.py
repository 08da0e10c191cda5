"""Write the family lists the README shows, from the registry, after adding or changing a
family (docs/adding-a-family.md): each lives between `<!-- generated: KEY ... -->` and
`<!-- end generated -->`. tests/test_docs.py checks them, family by family, so
`pytest --family NAME` says when one is stale.

    python -m posbias_export.biases.readme_blocks          # rewrite the generated blocks
    python -m posbias_export.biases.readme_blocks --check  # exit 1 if one is stale
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import family_table

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose README this writes

END = "<!-- end generated -->"
# key -> (page, generator): every generated block of the docs
BLOCKS = {"family-table": ("README.md", family_table)}


def block_pattern(key: str) -> re.Pattern:
    return re.compile(rf"(<!-- generated: {re.escape(key)}[^\n]*-->\n)(.*?)({re.escape(END)})", re.S)


def generated_block(text: str, key: str) -> str:
    """The content of block `key` in a page (ValueError if the page has none)."""
    found = block_pattern(key).search(text)
    if not found:
        raise ValueError(f"no generated block {key!r}")
    return found.group(2)


def rewrite(root: Path = ROOT) -> list[Path]:
    """Every block made anew; the pages that changed."""
    changed = []
    for key, (page, make) in BLOCKS.items():
        path = root / page
        text = path.read_text()
        new = block_pattern(key).sub(lambda m: m.group(1) + make() + m.group(3), text, count=1)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m posbias_export.biases.readme_blocks", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether a block is stale (exit 1)")
    args = p.parse_args(argv)
    stale = [key for key, (page, make) in BLOCKS.items() if generated_block((ROOT / page).read_text(), key) != make()]
    if args.check:
        print("\n".join(f"stale: {key}" for key in stale) or "up to date")
        return 1 if stale else 0
    print("\n".join(f"wrote {p.relative_to(ROOT)}" for p in rewrite()) or "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
