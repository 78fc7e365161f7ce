"""The browsable copy of the notebooks builds (`mkdocs build --strict`), holds their stored outputs, and every link,
image and table-of-contents entry in it goes somewhere."""

from __future__ import annotations

import html
import json
import posixpath
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("mkdocs_jupyter")
ROOT = Path(__file__).resolve().parents[1]


def last_stdout_line(notebook: Path) -> str:
    """The last line a code cell of the notebook printed (its stored output)."""
    cells = json.loads(notebook.read_text())["cells"]
    texts = [
        "".join(out["text"])
        for cell in cells
        if cell["cell_type"] == "code"
        for out in cell.get("outputs", [])
        if out.get("name") == "stdout"
    ]
    return [line for line in texts[-1].splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site `mkdocs build --strict` writes, built once for this module's tests."""
    workdir = tmp_path_factory.mktemp("mkdocs")
    site = workdir / "site"
    # run from workdir: mkdocs-jupyter keeps its cache in .cache/ under the working folder
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


@pytest.mark.slow
def test_mkdocs_builds_the_notebooks_with_their_outputs(site):
    assert (site / "teaching" / "index.html").is_file()
    notebooks = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        page = site / "notebooks" / notebook.stem / "index.html"
        assert page.is_file(), f"no page for {notebook.name}"
    tour = html.unescape((site / "notebooks" / "00_tour" / "index.html").read_text())
    assert last_stdout_line(ROOT / "notebooks" / "00_tour.ipynb") in tour  # a stored output, not re-run


def _text(chunks: list[str]) -> str:
    return " ".join("".join(chunks).split())


class PageParser(HTMLParser):
    """What a built page links to and shows, its ids, its headings' text and its table of contents' entries."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []  # a href
        self.images: list[str] = []  # img src
        self.headings: dict[str, str] = {}  # id -> text, without the heading's own anchor link
        self.toc: list[tuple[str, str]] = []  # (href, text) of each entry of the page's table of contents
        self.h1: str | None = None  # the text of the page's first h1
        self.title: list[str] = []  # the text of its <title>
        self._in_title = False
        self._heading: tuple[str, str, list[str]] | None = None  # (tag, id, text)
        self._skip_a = 0  # inside a heading's anchor link ("¶")
        self._nav_depth = 0  # depth of nested <nav> inside the table of contents
        self._toc_entry: tuple[str, list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {name: value or "" for name, value in attrs}
        if "id" in attributes:
            self.ids.add(attributes["id"])
        if tag == "a" and "href" in attributes:
            self.links.append(attributes["href"])
        if tag == "img":
            self.images.append(attributes.get("src", ""))
        if tag == "title":
            self._in_title = True
        if tag in {"h1", "h2", "h3", "h4", "h5", "h6"} and "id" in attributes:
            self._heading = (tag, attributes["id"], [])
        elif self._heading and tag == "a" and {"anchor-link", "headerlink"} & set(attributes.get("class", "").split()):
            self._skip_a += 1
        if tag == "nav" and (self._nav_depth or attributes.get("aria-label") == "Table of contents"):
            self._nav_depth += 1
        elif self._nav_depth and tag == "a" and "md-nav__link" in attributes.get("class", ""):
            self._toc_entry = (attributes.get("href", ""), [])

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if self._heading and tag == "a" and self._skip_a:
            self._skip_a -= 1
        elif self._heading and tag == self._heading[0]:
            self.headings[self._heading[1]] = _text(self._heading[2])
            if tag == "h1" and self.h1 is None:
                self.h1 = self.headings[self._heading[1]]
            self._heading = None
        if tag == "nav" and self._nav_depth:
            self._nav_depth -= 1
        elif tag == "a" and self._toc_entry:
            self.toc.append((self._toc_entry[0], _text(self._toc_entry[1])))
            self._toc_entry = None

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title.append(data)
        if self._heading and not self._skip_a:
            self._heading[2].append(data)
        if self._toc_entry:
            self._toc_entry[1].append(data)


def parsed_pages(site: Path) -> dict[str, PageParser]:
    """Every HTML page of the site by its path in the site ('notebooks/00_tour/index.html')."""
    pages = {}
    for page in sorted(site.rglob("*.html")):
        parser = PageParser()
        parser.feed(page.read_text())
        pages[page.relative_to(site).as_posix()] = parser
    return pages


def internal_target(page: str, url: str) -> tuple[str, str] | None:
    """The site path and fragment a relative URL on `page` points at; None for another site or a mail address."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc:
        return None
    path = posixpath.normpath(posixpath.join(posixpath.dirname(page), unquote(parts.path))) if parts.path else page
    if parts.path.endswith("/") or (parts.path and not posixpath.splitext(path)[1]):
        path = posixpath.join(path, "index.html")
    return path, unquote(parts.fragment)


def broken_links(site: Path) -> list[str]:
    """Each link or image of the site whose file, or whose anchor in it, is not in the site."""
    pages = parsed_pages(site)
    broken = []
    for name, page in pages.items():
        if name in {"404.html"}:
            continue  # served at any depth, it links from the site's root
        for kind, urls in (("link", page.links), ("image", page.images)):
            for url in urls:
                target = internal_target(name, url)
                if target is None:
                    continue
                path, fragment = target
                if path.startswith("../") or not (site / path).is_file():
                    broken.append(f"{name}: {kind} {url!r} goes to no file")
                elif fragment and path in pages and fragment not in pages[path].ids:
                    broken.append(f"{name}: {kind} {url!r} goes to no anchor")
    return list(dict.fromkeys(broken))  # the navigation repeats the page's TOC: each broken link once


def toc_mismatches(site: Path) -> list[str]:
    """Each table-of-contents entry whose anchor is no heading of its page or whose text is not that heading's,
    and each page whose title is not its h1 heading's text."""
    mismatches = []
    for name, page in parsed_pages(site).items():
        if page.h1 is not None and not _text(page.title).startswith(page.h1):
            mismatches.append(f"{name}: title {_text(page.title)!r} for the h1 heading {page.h1!r}")
        for href, text in page.toc:
            if not href.startswith("#"):
                continue  # the navigation's link to the page itself
            heading = page.headings.get(href[1:])
            if heading is None:
                mismatches.append(f"{name}: TOC entry {text!r} goes to {href}, no heading's id")
            elif heading != text:
                mismatches.append(f"{name}: TOC entry {text!r} for the heading {heading!r}")
    return list(dict.fromkeys(mismatches))  # the navigation repeats the page's TOC: each mismatch once


@pytest.mark.slow
def test_every_link_and_image_of_the_site_goes_to_a_file_of_the_site(site):
    assert broken_links(site) == []


@pytest.mark.slow
def test_every_table_of_contents_entry_is_its_heading_with_inline_code_and_goes_to_it(site):
    assert any(page.toc for page in parsed_pages(site).values())  # the parser finds the entries it checks
    assert toc_mismatches(site) == []
