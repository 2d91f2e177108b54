"""Fetching an item from its source. A stand-in for HTTP, deterministic for the demo and tests.

* a URL with ``/missing/`` in its path answers 404 (permanent: dead-lettered at once);
* a URL with ``/slow/`` in its path times out (transient: retried, then dead-lettered);
* anything else answers a small page whose title is the URL's last path segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


class SourceError(Exception):
    """The source answered, and the answer is final (4xx)."""

    def __init__(self, status: int, url: str) -> None:
        self.status = status
        super().__init__(f"GET {url} answered {status}")


class SourceTimeout(Exception):
    """The source did not answer in time."""


@dataclass(frozen=True)
class Page:
    title: str
    content: str


def fetch(url: str) -> Page:
    path = urlsplit(url).path
    if "/missing/" in path:
        raise SourceError(404, url)
    if "/slow/" in path:
        raise SourceTimeout(f"GET {url} timed out")
    title = path.rstrip("/").rpartition("/")[2].replace("-", " ") or url
    return Page(title=title.capitalize(), content=f"Content of {url}")
