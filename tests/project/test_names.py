"""One meaning per name (docs/architecture.md, "Names"): every class of ``areal_hpc`` whose CamelCase words hold
a watched stem (``Engine``, ``Group``, ...) or its plural is listed in that stem's row of the names table, so
two ideas never share a stem. The table is read from the page, so the page and the code cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE, ARCHITECTURE = ROOT / "areal_hpc", ROOT / "docs" / "architecture.md"
MUST_WATCH = {"Engine", "Group", "Server"}


def names_table(text: str) -> dict[str, set[str]]:
    """Stem -> the classes its row lists: the table under "## Names" whose header starts ``| stem |``."""
    section = text.split("\n## Names\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    in_table = False
    for line in section.splitlines():
        if line.startswith("| stem |"):
            in_table = True
        elif in_table and line.startswith("|---"):
            continue
        elif in_table and line.startswith("|"):
            stem, _meaning, classes = (cell.strip() for cell in line.strip().strip("|").split("|"))
            table[stem.strip("`")] = set(re.findall(r"`(\w+)`", classes))
        elif in_table:
            break
    return table


def words(name: str) -> list[str]:
    """``MegatronTrainEngine`` -> Megatron, Train, Engine; ``PPOActor`` -> PPO, Actor; leading ``_`` dropped."""
    return re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z0-9]*|[a-z0-9]+", name.lstrip("_"))


def holds(name: str, stem: str) -> bool:
    return any(word in (stem, stem + "s", stem + "es") for word in words(name))


def classes_in(source: str) -> list[str]:
    return [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]


def package_classes() -> dict[str, str]:
    """Class name -> the module that defines it (every class, nested ones included)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in classes_in(path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def misnamed(classes: dict[str, str], table: dict[str, set[str]]) -> list[str]:
    """One line per class holding a watched stem without being in that stem's row."""
    return [
        f"{where}: class {name} holds the stem {stem!r} but is not in its row of docs/architecture.md's names "
        f"table ({', '.join(sorted(table[stem]))}): name it with another word, or list it there"
        for name, where in classes.items()
        for stem in table
        if holds(name, stem) and name not in table[stem]
    ]


def test_words_split_camel_case():
    assert words("MegatronTrainEngine") == ["Megatron", "Train", "Engine"]
    assert words("PPOActor") == ["PPO", "Actor"]
    assert words("_CpuDeviceMesh") == ["Cpu", "Device", "Mesh"]
    assert holds("EpisodeGroups", "Group") and not holds("Grouping", "Group") and not holds("Engineer", "Engine")


def test_the_table_watches_engine_and_group():
    table = names_table(ARCHITECTURE.read_text())
    assert set(table) >= MUST_WATCH, f"docs/architecture.md's names table lacks {sorted(MUST_WATCH - set(table))}"
    assert all(table.values()), "every watched stem lists the classes that carry it"


def test_every_class_with_a_watched_stem_is_in_its_row():
    assert misnamed(package_classes(), names_table(ARCHITECTURE.read_text())) == []


def test_every_class_in_the_table_exists_and_holds_its_stem():
    classes = package_classes()
    for stem, listed in names_table(ARCHITECTURE.read_text()).items():
        assert listed <= set(classes), f"the names table's {stem!r} row lists {sorted(listed - set(classes))}: gone"
        assert all(holds(name, stem) for name in listed), f"the {stem!r} row lists a class without the stem"


def test_a_planted_class_is_caught():
    """A new class that reuses ``Group`` for another idea fails, naming itself and where it is."""
    table = names_table(ARCHITECTURE.read_text())
    planted = dict.fromkeys(classes_in("class GroupThing:\n    pass\n"), "areal_hpc/planted.py")
    assert misnamed({**package_classes(), **planted}, table) == [
        "areal_hpc/planted.py: class GroupThing holds the stem 'Group' but is not in its row of "
        f"docs/architecture.md's names table ({', '.join(sorted(table['Group']))}): name it with another word, "
        "or list it there"
    ]
    nested = dict.fromkeys(classes_in("def f():\n    class _SideEngine: ...\n"), "areal_hpc/planted.py")
    [line] = misnamed(nested, table)
    assert "class _SideEngine holds the stem 'Engine'" in line
