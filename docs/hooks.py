"""MkDocs hooks (mkdocs.yml: ``hooks``): the pages link to benchmark records and configs the way GitHub
shows them, by their path in the repository (``../bench/results/X.md`` from ``docs/``). The site carries
a copy of those files under ``repo/`` and such links are pointed at the copy. A link to anything else
outside ``docs/`` is left as written, so the strict build fails on it and names the page.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
MIRRORED = ("bench/README.md", "bench/results", "configs")  # repository paths the site carries
PREFIX = "repo/"
LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def _mirrored() -> list[str]:
    found = []
    for entry in MIRRORED:
        path = ROOT / entry
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [f.relative_to(ROOT).as_posix() for f in files if "__pycache__" not in f.parts]
    return found


def on_files(files, config):
    for path in _mirrored():
        files.append(
            File.generated(config, PREFIX + path, abs_src_path=str(ROOT / path), inclusion=InclusionLevel.NOT_IN_NAV)
        )
    return files


def _repository_path(src_uri: str) -> str:
    return src_uri[len(PREFIX) :] if src_uri.startswith(PREFIX) else "docs/" + src_uri


def _site_uri(repository_path: str) -> str:
    return repository_path[len("docs/") :] if repository_path.startswith("docs/") else PREFIX + repository_path


def on_page_markdown(markdown, page, config, files):
    here = page.file.src_uri
    folder = posixpath.dirname(_repository_path(here))

    def point(match):
        target = match.group(2)
        path, hash_, anchor = target.partition("#")
        if not path or "://" in path or path.startswith(("/", "mailto:")):
            return match.group(0)
        uri = _site_uri(posixpath.normpath(posixpath.join(folder, path)))
        if files.get_file_from_path(uri) is None:  # not in the site: mkdocs reports the link as written
            return match.group(0)
        relative = posixpath.relpath(uri, posixpath.dirname(here) or ".")
        return f"{match.group(1)}{relative}{hash_}{anchor}{match.group(3)}"

    return LINK.sub(point, markdown)
