"""The documentation site (mkdocs.yml, docs/): every page is in the nav, README's links
reach existing pages, and, where mkdocs is installed (the ``docs`` extra, not the test
extra: .ci/run builds the site in a step of its own), the site builds with warnings as
errors."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages() -> list[str]:
    # the nav's page files: "- Title: page.md" lines (no YAML library needed, and none of
    # mkdocs.yml's python tags to resolve)
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:"):]
    return re.findall(r"^\s*- .*:\s+(\S+\.md)\s*$", nav, flags=re.MULTILINE)


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    nav = _nav_pages()
    assert sorted(nav) == pages, (sorted(set(pages) - set(nav)), sorted(set(nav) - set(pages)))


def test_readme_links_reach_existing_files() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert local, "README links to no page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers")),
    reason="mkdocs, mkdocs-material or mkdocstrings[python] not installed (pip install -e '.[docs]')",
)
def test_site_builds_strictly(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8").count("stream_weights") > 0
