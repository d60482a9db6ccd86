"""mkdocs hook: links from the docs to files of the repository outside docs/.

The pages link to source files the way a reader browsing the repository follows them, with
relative paths such as `../examples/judge_loop.py` or `../../tests/conformance/`. mkdocs only knows
the files under docs/, so this hook publishes every file such a link names under `_repo/` in the
site (as plain text; a folder as a generated page listing its files) and points the link there.
A link to a path that does not exist is a warning, so `mkdocs build --strict` fails on it.

examples.md also gets the list of what examples/ holds, written at build time.
"""
from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

log = logging.getLogger("mkdocs.hooks.repo_links")
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "_repo"
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
EXAMPLES_MARKER = "<!-- examples: listed at build time -->"
# Text files are published under their own name; these suffixes would be read as pages or
# templates by mkdocs, so they get ".txt" appended.
RENAME = (".md", ".html", ".htm")

_published: dict[str, str] = {}     # repository path -> site path (a folder: its listing page)


def _repo_target(page_src: str, target: str) -> str | None:
    """The repository path a relative link from docs/<page_src> names, or None inside docs/."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_src), target))
    if joined == "docs" or joined.startswith("docs/"):
        return None
    if joined.startswith(".."):
        return ""
    return joined


def _examples_list() -> str:
    folder = ROOT / "examples"
    if not folder.is_dir():
        return "*The examples/ folder is not in this checkout.*\n"
    rows = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith((".", "__")):
            continue
        rows.append(f"- [`examples/{entry.name}{'/' if entry.is_dir() else ''}`](../examples/{entry.name}"
                    f"{'/' if entry.is_dir() else ''}){_summary(entry)}")
    return "\n".join(rows) + "\n" if rows else "*examples/ is empty in this checkout.*\n"


def _summary(entry: Path) -> str:
    """The first line of a Python file's docstring or a folder's README, where there is one."""
    path = entry / "README.md" if entry.is_dir() else entry
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        m = re.search(r'^\s*(?:#[^\n]*\n\s*)*[rb]?"""\s*(.+)', text)
        line = m.group(1).strip() if m else ""
    else:
        line = next((l.strip("# ").strip() for l in text.splitlines() if l.strip()), "")
    return f": {line}" if line else ""


def _publish(path: str, files, config) -> bool:
    if path in _published:
        return True
    full = ROOT / path
    if full.is_file():
        site = f"{PREFIX}/{path}" + (".txt" if path.endswith(RENAME) else "")
        files.append(File.generated(config, site, abs_src_path=str(full)))
        _published[path] = site
        return True
    if full.is_dir():
        site = f"{PREFIX}/{path}/index.md"
        _published[path] = site
        lines = [f"# {path}/\n", "Files of this folder of the repository:\n"]
        for child in sorted(full.iterdir()):
            if child.name.startswith((".", "__pycache__")):
                continue
            rel = f"{path}/{child.name}"
            if _publish(rel, files, config):
                target = _published[rel]
                href = posixpath.relpath(target, posixpath.dirname(site))
                lines.append(f"- [`{child.name}{'/' if child.is_dir() else ''}`]({href})")
        files.append(File.generated(config, site, content="\n".join(lines) + "\n",
                                    inclusion=InclusionLevel.NOT_IN_NAV))
        return True
    return False


def on_files(files, config):
    _published.clear()
    docs = Path(config["docs_dir"])
    for f in list(files):
        if not f.src_uri.endswith(".md") or f.abs_src_path is None:
            continue
        text = Path(f.abs_src_path).read_text()
        if f.src_uri == "examples.md":
            text += _examples_list()
        for m in LINK.finditer(text):
            path = _repo_target(f.src_uri, m.group(2))
            if path:
                _publish(path.rstrip("/"), files, config)
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "examples.md":
        markdown = markdown.replace(EXAMPLES_MARKER, _examples_list())

    def fix(m):
        path = _repo_target(page.file.src_uri, m.group(2))
        if path is None:
            return m.group(0)
        site = _published.get(path.rstrip("/"))
        if not path or site is None:
            log.warning("%s links to %r, which is not a file or folder of the repository",
                        page.file.src_uri, m.group(2))
            return m.group(0)
        href = posixpath.relpath(site, posixpath.dirname(page.file.src_uri))
        return f"{m.group(1)}{href}{m.group(3) or ''}{m.group(4)}"

    return LINK.sub(fix, markdown)
