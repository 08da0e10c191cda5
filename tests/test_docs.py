"""README and docs/ stay true: the family table is the registry's, every command and family
they name exists, every registered one is documented, every page is linked and every link
resolves."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import posbias_export as pbe
from posbias_export.biases import FAMILY_TABLE_HEADER, family_row
from posbias_export.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
from posbias_export.biases.readme_blocks import BLOCKS, generated_block

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = {p: p.read_text() for p in [README, *PAGES]}
COMMAND_NAMES = {c.name for c in COMMANDS if c.name}


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 250


STALE = "README's family table is stale: run python -m posbias_export.biases.readme_blocks"


def _table_rows() -> list[str]:
    table = generated_block(README.read_text(), "family-table")
    assert table.startswith(FAMILY_TABLE_HEADER), STALE
    return table[len(FAMILY_TABLE_HEADER):].splitlines()


@pytest.mark.parametrize("name", pbe.BIASES)
def test_readme_table_shows_the_family_as_it_declares_itself(name):
    """Per family (so `pytest --family NAME` runs it): its row is what its class declares."""
    assert family_row(name) in _table_rows(), STALE


def test_readme_table_is_the_registry_in_order():
    assert _table_rows() == [family_row(name) for name in pbe.BIASES], STALE
    assert all(generated_block((ROOT / page).read_text(), key) == make() for key, (page, make) in BLOCKS.items())


def test_docs_keep_no_family_list_by_hand():
    """A line naming four or more families outside a generated block is a list someone must keep
    when a family is added: generate it (python -m posbias_export.biases.readme_blocks) or name none."""
    names = re.compile(r"\b(" + "|".join(map(re.escape, pbe.BIASES)) + r")\b")
    for path, text in TEXTS.items():
        for key, (page, _) in BLOCKS.items():
            if path == ROOT / page:
                text = text.replace(generated_block(text, key), "")
        listed = [line for line in text.splitlines() if len(set(names.findall(line))) >= 4]
        assert not listed, f"{path.name} keeps a family list by hand: {listed[0][:120]}"


def test_every_command_named_exists_and_every_command_is_in_the_readme():
    named = {(path.name, m) for path, text in TEXTS.items()
             for m in re.findall(r"python -m posbias_export ([a-z][a-z-]*)", text)}
    unknown = sorted((page, m) for page, m in named if m not in COMMAND_NAMES)
    assert not unknown, f"commands that do not exist: {unknown}"
    readme = README.read_text()
    missing = sorted(c for c in COMMAND_NAMES if f"python -m posbias_export {c} " not in readme)
    assert not missing, f"commands README does not show: {missing}"


def test_every_family_named_exists_and_every_family_is_documented():
    named = {(path.name, m) for path, text in TEXTS.items() for m in re.findall(r"--bias[ =]([a-z0-9_]+)", text)}
    unknown = sorted((page, m) for page, m in named if m not in pbe.BIASES)
    assert not unknown, f"families that do not exist: {unknown}"
    readme = README.read_text()
    assert all(f"| `{name}` |" in readme for name in pbe.BIASES)


def test_every_page_is_linked_and_every_link_resolves():
    readme = README.read_text()
    unlinked = [p.name for p in PAGES if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages README does not link: {unlinked}"
    for path, text in TEXTS.items():
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


def test_readme_examples_parse():
    """Every command line README shows is accepted by that command's parser (options exist, values parse)."""
    import shlex

    from posbias_export.cli import parser_of

    readme = README.read_text()
    lines = re.findall(r"`python -m posbias_export ([^`]*)`", readme)
    lines += [line.split("#")[0].removeprefix("python -m posbias_export ").strip() for line in readme.splitlines()
              if line.startswith("python -m posbias_export ")]
    named = {c.name: c for c in COMMANDS}
    checked = 0
    for line in lines:
        argv = shlex.split(line)
        command = named.get(argv[0], named[""])
        if command.parser is None:
            continue  # generate parses its own arguments (its runner's parser)
        parser_of(command).parse_args(argv[1:] if command.name else argv)
        checked += 1
    assert checked >= len(COMMAND_NAMES)


def test_the_capability_table_in_the_docs_is_the_code_s():
    from posbias_export.parity.capabilities import table_markdown

    assert table_markdown() in TEXTS[ROOT / "docs" / "validating.md"]


def test_layout_names_every_module():
    """docs/layout.md is the map of the house: every module of the package and of runtimes/ is named
    there (a bias family's module is "one family each": the registry names it)."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    from posbias_export.biases import bias_class

    families = {bias_class(name).__module__.rsplit(".", 1)[-1] for name in pbe.BIASES}
    modules = [p for folder in ("posbias_export", "runtimes") for p in (ROOT / folder).rglob("*.py")
               if "node_modules" not in p.parts and p.name != "__init__.py"]
    missing = [str(p.relative_to(ROOT)) for p in modules if p.name not in layout
               and not (p.parent.name == "biases" and p.stem in families)]
    assert modules and not missing, f"docs/layout.md does not name: {missing}"
