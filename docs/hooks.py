"""mkdocs hooks: the repository's notebooks and figures as pages of the site, their links and TOC made right.

The folders are added as files of the site rather than linked into docs/: a symlink is lost in a checkout without
symlink support.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files, file_sort_key

# the repository's folders the site shows, each at the same path in the site as in the repository
SITE_FOLDERS = {"notebooks": "*.ipynb", "figures": "*"}


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
