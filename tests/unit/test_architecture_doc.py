"""docs/architecture.md and the package docstrings match the tree (issue 34, item 7).

Each check names what to write where when it fails: a module added without a line in the doc's
tree, an import-linter contract added to pyproject.toml without its item under "Import rules", a
pure core added to the contract without the doc's list, a test-kit module left out of its public
list. The doc is the map a new maintainer reads first; these keep it from lagging the code.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
from kit.paths import AGENT_SRC, DOCS, REPO

pytestmark = pytest.mark.pure

PKG = AGENT_SRC / "gce_watchdog"
ARCH = DOCS / "architecture.md"
PURE_CONTRACT = "pure cores"  # the contract whose source modules are the pure cores


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def tree_block(text: str) -> str:
    """The fenced block under "## The tree"."""
    return _section(text, "The tree").split("```")[1]


def tree_entries(block: str) -> dict[str, str]:
    """Each top-level entry of the tree (``wire/``, ``jobresult.py``, ``__main__.py, cli.py``) and
    its text: the entry's line and every deeper-indented line below it."""
    entries: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent == 2:  # one entry of agent/gce_watchdog/
            current = line.split("  ", 2)[1].strip() if "  " in line[2:] else line.strip()
            entries[current] = line
        elif indent > 2 and current:
            entries[current] += "\n" + line
    return entries


def modules() -> list[Path]:
    """Every module of the package, relative to it (``__init__.py`` files excepted: a package's
    docstring is its entry, checked below)."""
    return sorted(p.relative_to(PKG) for p in PKG.rglob("*.py") if p.name != "__init__.py")


def missing_from_tree(text: str) -> list[str]:
    entries = tree_entries(tree_block(text))
    out = []
    for rel in modules():
        word = re.compile(rf"(?<![\w.]){re.escape(rel.name)}\b")
        if len(rel.parts) == 1:  # a top-level module: any top-level entry naming it
            found = any(word.search(k) for k in entries)
        else:
            found = bool(word.search(entries.get(f"{rel.parts[0]}/", "")))
        if not found:
            out.append(
                f"{rel}: not in docs/architecture.md's tree: add `{rel.name}` with a few words "
                f"under `{rel.parts[0] + '/' if len(rel.parts) > 1 else 'agent/gce_watchdog/'}`"
            )
    return out


def test_every_module_is_in_the_tree() -> None:
    assert missing_from_tree(ARCH.read_text()) == []


def test_the_tree_check_notices_a_module_left_out() -> None:
    text = ARCH.read_text()
    assert "identity.py" in tree_entries(tree_block(text))["poller/"]
    broken = text.replace("identity.py", "identiti.py")
    assert any(m.startswith("poller/identity.py") for m in missing_from_tree(broken))
    # a name under another package does not count: validate/plan.py is not faults/plan.py
    assert "validate/plan.py" not in " ".join(missing_from_tree(text))


def test_the_tree_names_no_module_that_is_gone() -> None:
    entries = tree_entries(tree_block(ARCH.read_text()))
    gone = []
    for key, body in entries.items():
        if not key.endswith("/"):
            continue
        for name in set(re.findall(r"(?<![\w./])(\w+\.py)\b", body)):
            if not (PKG / key / name).is_file():
                gone.append(f"docs/architecture.md names {key}{name}, which does not exist")
    assert gone == []


# -- the import-linter contracts ----------------------------------------------------------------


def contracts() -> list[dict[str, object]]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    out: list[dict[str, object]] = doc["tool"]["importlinter"]["contracts"]
    return out


def doc_rules(text: str) -> list[str]:
    """The bold title of each numbered item under "## Import rules, and why"."""
    return re.findall(r"^\d+\. \*\*(.+?)\*\*", _section(text, "Import rules, and why"), re.M)


def test_each_contract_has_its_item_in_the_doc_and_no_more() -> None:
    names = [str(c["name"]) for c in contracts()]
    rules = doc_rules(ARCH.read_text())
    assert len(rules) == len(names), (
        f"pyproject.toml has {len(names)} import-linter contracts, docs/architecture.md "
        f"'Import rules, and why' lists {len(rules)}: one numbered item per contract, "
        f"its bold title the contract's name"
    )
    assert rules == names, "the doc's items, in order, are titled with the contracts' names"


def pure_cores_in_code() -> set[str]:
    """The pure cores: the source modules of the contract that forbids clocks, sockets etc."""
    (c,) = [c for c in contracts() if str(c["name"]).startswith(PURE_CONTRACT)]
    mods = c["source_modules"]
    assert isinstance(mods, list)
    return {m.removeprefix("gce_watchdog.") for m in mods}


def pure_cores_in_doc(text: str) -> set[str]:
    """The modules in backticks in the pure-core item of the import rules."""
    item = re.search(
        rf"^\d+\. \*\*{PURE_CONTRACT}.*?(?=^\d+\. |\Z)",
        _section(text, "Import rules, and why"),
        re.M | re.S,
    )
    assert item, "docs/architecture.md has no import rule titled 'pure cores: ...'"
    head = item.group(0).split("import no", 1)[0]  # the modules, before the forbidden list
    return set(re.findall(r"`([a-z_.]+)`", head))


def test_the_pure_cores_in_the_doc_are_those_of_the_contract() -> None:
    code, doc = pure_cores_in_code(), pure_cores_in_doc(ARCH.read_text())
    assert doc == code, (
        f"pure cores only in pyproject.toml: {sorted(code - doc)}; only in "
        f"docs/architecture.md: {sorted(doc - code)}"
    )
    assert len(code) >= 10


def test_each_pure_core_is_marked_pure_in_the_tree() -> None:
    entries = tree_entries(tree_block(ARCH.read_text()))
    unmarked = []
    for core in sorted(pure_cores_in_code()):
        pkg, _, mod = core.partition(".")
        body = entries[f"{pkg}/"]
        if not mod:  # a whole package (wire): its own line says so
            ok = "Pure." in body.splitlines()[0]
        else:
            # "pure" after the module's name, before the next module's name on its line
            ok = bool(re.search(rf"\b{mod}\.py\b(?:(?!\.py)[^\n])*\bpure\b", body))
        if not ok:
            unmarked.append(f"{core}: say '(pure)' after {mod or pkg}.py in the doc's tree")
    assert unmarked == []


# -- docstrings ---------------------------------------------------------------------------------


def test_every_module_and_package_has_a_docstring() -> None:
    bare = [
        str(p.relative_to(PKG))
        for p in sorted(PKG.rglob("*.py"))
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert bare == [], "write a module docstring (the contract, in a sentence or two)"


def test_a_package_docstring_that_lists_modules_lists_them_all() -> None:
    problems = []
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        pkg = init.parent.name
        # this package's modules only (a reference to lib.compute is not a poller module)
        listed = set(re.findall(rf":mod:`(?:gce_watchdog\.)?{pkg}\.(\w+)`", doc))
        if not listed:
            continue  # a one-line summary: the tree in docs/architecture.md is the list
        have = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        problems += [f"{pkg}/__init__.py does not list :mod:`{m}`" for m in sorted(have - listed)]
        problems += [f"{pkg}/__init__.py lists {m}, not a module" for m in sorted(listed - have)]
    assert problems == [], "\n".join(problems)


# -- the test kit's section ---------------------------------------------------------------------


def _kit_section(text: str) -> str:
    return _section(text, "The test kit (`gce_watchdog.testing`)")


def test_the_test_kit_public_list_names_every_module() -> None:
    section = _kit_section(ARCH.read_text())
    public = section.split("It is public API:", 1)[1].split("\n- ", 1)[0]
    named = set(re.findall(r"`(\w+)`", public))
    have = {p.stem for p in (PKG / "testing").glob("*.py") if p.name != "__init__.py"}
    assert have - named == set(), "add these testing modules to 'It is public API:'"
    assert named & have == have


def test_the_test_kit_size_in_the_doc_is_current() -> None:
    lines = sum(len(p.read_text().splitlines()) for p in (PKG / "testing").glob("*.py"))
    m = re.search(r"about ([\d,]+) lines of Python", _kit_section(ARCH.read_text()))
    assert m, "the test kit's section says 'about N lines of Python'"
    said = int(m.group(1).replace(",", ""))
    assert abs(said - lines) <= lines * 0.15, (
        f"docs/architecture.md says about {said} lines of Python in the test kit; it has {lines}"
    )
