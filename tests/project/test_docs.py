"""The documentation: the generated reference pages match the code, cover every config key and every
subcommand and flag, the site builds strictly (and a broken link fails it), and README.md stays a short
product page. Every check runs the real generator and the real MkDocs in subprocesses."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hpc.cli import build_parser
from areal_hpc.config import LEAF_TYPES

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = "docs/gen_reference.py"
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def run(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def copy_of_the_docs(to: Path) -> Path:
    """What the site and the generator read, copied: mkdocs.yml, docs/, README.md and the repository files
    the site carries (benchmark records, configs)."""
    shutil.copy(ROOT / "mkdocs.yml", to / "mkdocs.yml")
    shutil.copy(ROOT / "README.md", to / "README.md")
    shutil.copytree(ROOT / "docs", to / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", to / "configs")
    (to / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "README.md", to / "bench" / "README.md")
    shutil.copytree(ROOT / "bench" / "results", to / "bench" / "results")
    return to


def test_committed_references_equal_fresh_ones_and_the_docs_name_only_real_keys():
    checked = run([sys.executable, GENERATOR, "--check"])
    assert "stale" not in checked.stdout, f"regenerate the reference pages: {checked.stdout}"
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout == ""


def test_check_names_a_stale_page_and_an_unknown_config_key(tmp_path):
    copy = copy_of_the_docs(tmp_path)
    with open(copy / "docs" / "reference" / "config.md", "a") as page:
        page.write("| `actor.lr` | float | `1.0` | edited by hand |\n")
    with open(copy / "docs" / "tutorials" / "proxy.md", "a") as page:
        page.write("\nTrain faster with `areal-hpc train actor.lrr=1e-3 rollout.max_head_offpolicyness=4`.\n")
    checked = run([sys.executable, str(copy / GENERATOR), "--check"], cwd=copy)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert "docs/reference/config.md is stale: refresh it with .venv/bin/python docs/gen_reference.py" in lines
    assert not any("cli.md" in line for line in lines)
    unknown = [line for line in lines if "config key" in line]
    assert len(unknown) == 1 and unknown[0].startswith("docs/tutorials/proxy.md:") and "'actor.lrr'" in unknown[0]


def test_every_config_key_is_in_the_config_reference():
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    missing = [key for key in LEAF_TYPES if f"| `{key}` |" not in page]
    assert not missing, f"config keys missing from docs/reference/config.md: {missing}"


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ("areal-hpc",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*words, name), sub
                yield from _commands(sub, (*words, name))


def test_every_subcommand_and_flag_is_in_the_cli_reference():
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    sections = dict(re.findall(r"^#{2,3} (areal-hpc[^\n]*)\n(.*?)(?=^#{2,3} |\Z)", page, re.M | re.S))
    commands = list(_commands(build_parser()))
    assert len(commands) > 20
    for words, parser in commands:
        heading = " ".join(words)
        assert heading in sections, f"no section for '{heading}' in docs/reference/cli.md"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for flag in action.option_strings or [action.metavar or action.dest]:
                assert f"`{flag}`" in sections[heading], f"'{heading}' lacks {flag} in docs/reference/cli.md"


def test_readme_is_short_and_undated():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    prose = re.sub(r"\]\([^)]*\)", "]()", text)  # a record's file name carries its date; the text must not
    dates = re.findall(r"\b\d{4}-\d{2}-\d{2}\b", prose)
    assert not dates, f"README.md names dates: {dates}"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    built = _build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    assert not (tmp_path / "site" / "gen_reference.py").exists()


def _build(copy: Path, site: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=copy)


@pytest.mark.slow
def test_a_broken_link_fails_the_build_naming_the_page(tmp_path):
    copy = copy_of_the_docs(tmp_path)
    with open(copy / "docs" / "tutorials" / "slurm.md", "a") as page:
        page.write("\nSee [the old page](../no-such-page.md).\n")
    built = _build(copy, tmp_path / "site")
    output = built.stdout + built.stderr
    assert built.returncode != 0, output
    assert "'tutorials/slurm.md' contains a link '../no-such-page.md'" in output, output


@pytest.mark.slow
def test_a_page_missing_from_the_nav_fails_the_build(tmp_path):
    copy = copy_of_the_docs(tmp_path)
    (copy / "docs" / "orphan.md").write_text("# A page nobody lists\n")
    built = _build(copy, tmp_path / "site")
    output = built.stdout + built.stderr
    assert built.returncode != 0, output
    assert 'not included in the "nav"' in output and "orphan.md" in output, output
