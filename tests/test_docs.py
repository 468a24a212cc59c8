"""The docs site (docs/, mkdocs.yml) and the front page (README.md): the site builds with
`mkdocs build --strict` (a broken link, a missing anchor or a page left out of the nav fails it),
every page is in the nav, the README stays a front page, and every relative link of the README and
the other guides (cluster/, the Helm chart) reaches a file, and its anchor a heading of the built
page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
GUIDES = [ROOT / "README.md", ROOT / "cluster" / "README.md", ROOT / "helm" / "raymuter" / "README.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_built_and_in_the_nav(site):
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages
    assert len(pages) >= 6  # the index and at least five task pages
    for page in pages:
        built = site / ("index.html" if page == "index.md" else page[:-3] + "/index.html")
        assert built.is_file(), page


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for heading in ("## The two commands", "## Install", "## Quick start", "## Supported models", "## Documentation"):
        assert heading in readme
    assert "make serve" in readme and "make test" in readme


def anchors_of(html: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html.read_text()))


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_a_guide_resolves(site, guide):
    targets = [t for t in LINK.findall(guide.read_text()) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        path, _, anchor = target.partition("#")
        file = (guide.parent / path).resolve() if path else guide
        assert file.exists(), f"{guide.relative_to(ROOT)}: {target}"
        if anchor and file.parent == DOCS:
            built = site / ("index.html" if file.name == "index.md" else file.stem + "/index.html")
            assert anchor in anchors_of(built), f"{guide.relative_to(ROOT)}: {target}"


def test_the_site_s_links_are_checked_by_the_build(tmp_path):
    """The strict build is what holds the pages' own links: a page with a broken one fails it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [no anchor](#nowhere)\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"), nav=[{"Home": "index.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode != 0
    assert "missing.md" in done.stderr and "nowhere" in done.stderr


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_readme_s_engine_example_runs_on_the_default_model():
    """The quick start's Python engine example, as written, with the default model's folder for
    its placeholder (the `openai` client's example needs a server: the app tests send those
    routes the same requests)."""
    from generation.default_model import default_model_path

    (example,) = [block for block in python_blocks((ROOT / "README.md").read_text()) if "import generation" in block]
    assert '"folder-or-hub-id"' in example
    scope: dict = {}
    exec(example.replace('"folder-or-hub-id"', repr(str(default_model_path()))), scope)  # noqa: S102 - our own text
    rows = scope["rows"]
    assert len(rows) == 3 and rows[2] == [] and all(0 < len(r) <= 32 for r in rows[:2])
