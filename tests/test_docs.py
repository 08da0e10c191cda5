"""README and docs/ stay true: the family table is the registry's, every command and family
they name exists, every registered one is documented, every page is linked and every link
resolves."""
from __future__ import annotations

import re
from pathlib import Path

import posbias_export as pbe
from posbias_export.biases import family_table
from posbias_export.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = {p: p.read_text() for p in [README, *PAGES]}
COMMAND_NAMES = {c.name for c in COMMANDS if c.name}


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 250


def test_readme_family_table_is_the_registry():
    text = README.read_text()
    start = text.index("<!-- generated from the registry")
    table = text[text.index("\n", start) + 1: text.index("<!-- end of generated table -->")]
    assert table == family_table(), "README's family table is stale: paste posbias_export.biases.family_table()"


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
