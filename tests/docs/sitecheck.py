"""Reads a built documentation site (HTML files on disk) and reports links that do not resolve."""
from __future__ import annotations

import posixpath
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# Attributes that point at another file of the site.
LINK_ATTRS = {("a", "href"), ("link", "href"), ("img", "src"), ("script", "src"), ("source", "src")}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if (tag, name) in LINK_ATTRS and value:
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _target_file(site: Path, page_rel: str, url_path: str) -> Path:
    """The file a site-relative URL path names, as a static server resolves it."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_rel), unquote(url_path)))
    target = site / joined
    if url_path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target


def broken_links(site: Path) -> list[str]:
    """Every link of every HTML page whose file is missing, or whose #anchor is not an id there.
    External links (with a scheme or a host) are not followed: the check needs no network."""
    site = Path(site)
    pages = {p.relative_to(site).as_posix(): _parse(p) for p in site.rglob("*.html")}
    broken = []
    for rel, page in sorted(pages.items()):
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                continue
            if parts.path:
                if parts.path.startswith("/"):
                    # The 404 page is served at any missing path, so its links start at the root.
                    if rel != "404.html":
                        broken.append(f"{rel}: {link} (absolute path: breaks when the site is not at the root)")
                        continue
                    target = _target_file(site, "", parts.path.lstrip("/"))
                else:
                    target = _target_file(site, rel, parts.path)
            else:
                target = site / rel
            if not target.is_file():
                broken.append(f"{rel}: {link} (no file {target.relative_to(site).as_posix()})")
                continue
            anchor = unquote(parts.fragment)
            if anchor and target.suffix == ".html":
                target_page = pages.get(target.relative_to(site).as_posix())
                if target_page is None or anchor not in target_page.ids:
                    broken.append(f"{rel}: {link} (no id {anchor!r} in {target.relative_to(site).as_posix()})")
    return broken
