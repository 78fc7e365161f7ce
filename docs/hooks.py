"""mkdocs hooks: the repository's notebooks and figures as pages of the site, their links and TOC made right.

mkdocs rewrites and checks the links of Markdown pages, but mkdocs-jupyter hands a notebook's HTML over as it is:
a link written relative to the notebook file (`../figures/x.png`, as GitHub and Jupyter read it) then misses by one
folder under the page's directory URL, and a link to a package file goes to a page the site does not have. Its
table of contents is read from a Markdown copy with the inline code cut out, so entries lose their code and their
anchors miss the headings' ids. These hooks fix both from the page's own HTML.
"""

from __future__ import annotations

import html
import logging
import posixpath
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markdown.extensions.toc import nest_toc_tokens
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files, file_sort_key
from mkdocs.structure.pages import Page
from mkdocs.structure.toc import get_toc

log = logging.getLogger("mkdocs.hooks.nanoref")

# the repository's folders the site shows, each at the same path in the site as in the repository
SITE_FOLDERS = {"notebooks": "*.ipynb", "figures": "*"}
# the branch the links to the repository's files (at `repo_url`) show
REPO_BRANCH = "main"


def repository_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = repository_root(config)
    added = [
        File(path.relative_to(root).as_posix(), str(root), config.site_dir, config.use_directory_urls)
        for folder, pattern in SITE_FOLDERS.items()
        for path in sorted((root / folder).glob(pattern))
        if path.is_file()
    ]
    for file in added:
        if file.src_uri in files.src_uris:
            raise ValueError(f"{file.src_uri} is both in {config.docs_dir} and in the repository's {file.src_uri}")
    # the order get_files gives (index first, folders last) is the order of the navigation
    return Files(sorted([*files, *added], key=file_sort_key))


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    root = repository_root(config)
    config.watch.extend(str(root / folder) for folder in SITE_FOLDERS)  # `mkdocs serve` rebuilds on their edits
    return config


class _Headings(HTMLParser):
    """The headings a notebook's Markdown cells made (nbconvert gives each an `a.anchor-link`): level, id, text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.headings: list[tuple[int, str, str]] = []
        self._open: tuple[int, str, list[str]] | None = None
        self._in_anchor_link = 0
        self._has_anchor_link = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if re.fullmatch(r"h[1-6]", tag) and attributes.get("id"):
            self._open, self._has_anchor_link = (int(tag[1]), attributes["id"], []), False
        elif self._open and tag == "a" and "anchor-link" in (attributes.get("class") or "").split():
            self._in_anchor_link += 1
            self._has_anchor_link = True

    def handle_endtag(self, tag: str) -> None:
        if self._open and tag == "a" and self._in_anchor_link:
            self._in_anchor_link -= 1
        elif self._open and tag == f"h{self._open[0]}":
            level, id_, text = self._open
            if self._has_anchor_link:
                self.headings.append((level, id_, " ".join("".join(text).split())))
            self._open = None

    def handle_data(self, data: str) -> None:
        if self._open and not self._in_anchor_link:
            self._open[2].append(data)


def notebook_toc_tokens(content: str) -> list[dict]:
    """The nested TOC tokens of the page's headings, with the ids and the full text (inline code kept) they have."""
    parser = _Headings()
    parser.feed(content)
    flat = [{"level": level, "id": id_, "name": html.escape(text)} for level, id_, text in parser.headings]
    return nest_toc_tokens(flat)


_ANCHOR = re.compile(r'<a\b(?P<before>[^>]*?)\bhref="(?P<url>[^"]*)"(?P<after>[^>]*)>(?P<text>.*?)</a>', re.DOTALL)
_SOURCE = re.compile(r'<(?P<tag>img|source)\b(?P<before>[^>]*?)\bsrc="(?P<url>[^"]*)"')


def _relative_target(url: str) -> tuple[str, str] | None:
    """A link relative to the page's source file: its path and fragment; None for a URL, an anchor, a root path."""
    parts = urlsplit(html.unescape(url))
    if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
        return None
    return unquote(parts.path), parts.fragment


def _repository_path(page: Page, target: str) -> str:
    """The link's target as a '/'-separated path from the repository root ('..' kept where it climbs out)."""
    return posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), target))


def _site_url(file: File, page: Page, fragment: str) -> str:
    return html.escape(file.url_relative_to(page.file) + (f"#{fragment}" if fragment else ""))


def rewrite_notebook_links(content: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Links written relative to the notebook file: to the site's copy, else to the repository, else a warning.

    A file of the site (a figure, a page) gets its URL from this page's URL. A file of the repository the site does
    not hold (a module, a benchmark result, a test) links to the repository at `repo_url` when one is set, and is
    shown as its plain path when not; a target that exists nowhere is warned about (and fails `--strict`).
    """
    root = repository_root(config)

    def link(match: re.Match[str]) -> str:
        relative = _relative_target(match["url"])
        if relative is None:
            return match[0]
        target, fragment = relative
        path = _repository_path(page, target)
        if (file := files.get_file_from_path(path)) is not None:
            url = _site_url(file, page, fragment)
            return f'<a{match["before"]}href="{url}"{match["after"]}>{match["text"]}</a>'
        if path.startswith("../") or not (root / path).exists():
            log.warning(
                "%s links to '%s', which is neither in the site nor in the repository", page.file.src_uri, target
            )
            return match[0]
        if config.repo_url:
            url = html.escape(f"{config.repo_url.rstrip('/')}/blob/{REPO_BRANCH}/{path}")
            return f'<a{match["before"]}href="{url}"{match["after"]}>{match["text"]}</a>'
        # no repository to link to: the text stays, and names the file where it does not already
        text = match["text"]
        return (
            text
            if path in html.unescape(re.sub(r"<[^>]+>", "", text))
            else f"{text} (<code>{html.escape(path)}</code>)"
        )

    def source(match: re.Match[str]) -> str:
        relative = _relative_target(match["url"])
        if relative is None:
            return match[0]
        target, fragment = relative
        if (file := files.get_file_from_path(_repository_path(page, target))) is None:
            log.warning("%s shows '%s', which is not in the site", page.file.src_uri, target)
            return match[0]
        return f'<{match["tag"]}{match["before"]}src="{_site_url(file, page, fragment)}"'

    return _SOURCE.sub(source, _ANCHOR.sub(link, content))


def on_page_content(content: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return content  # mkdocs checks and rewrites the links of Markdown pages, and reads their TOC itself
    content = rewrite_notebook_links(content, page, config, files)
    tokens = notebook_toc_tokens(content)
    page.toc = get_toc(tokens)
    if tokens and tokens[0]["level"] == 1:
        page.title = html.unescape(tokens[0]["name"])
    return content
