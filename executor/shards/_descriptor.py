"""What a ``dataset_shards`` item parses into, and the tenant names the cache is keyed by.

``ShardDescriptor.key`` names a shard within a session: the descriptor's ``id`` or
``sha256``, else its URL without the query string (a re-presigned URL is the same
shard), so new URLs for the same shards keep their pins. Which cache entry a caller is
served is decided by ``_access``, which trusts less than a name. A tenant name becomes
a directory of the cache, hence its strict pattern.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from executor.errors import InvalidRequest
from executor.urls import redact_url

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise InvalidRequest(f"invalid tenant name {tenant!r}: use 1-64 of [A-Za-z0-9_.-]")
    return tenant


def strip_query(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


@dataclass(frozen=True)
class ShardDescriptor:
    # Raw, as presigned: it is fetched, and kept in the session's manifest. Shown only redacted
    # (``__repr__``, ``to_json``), so a request or a session that holds it prints no credential.
    url: str
    compression: Literal["none", "zstd"] = "none"
    size_bytes: int = 0
    sha256: str | None = None
    id: str | None = None

    @classmethod
    def parse(cls, item: object) -> ShardDescriptor:
        """A URL string or ``{"url", "compression", "size_bytes", "sha256"?, "id"?}``."""
        if isinstance(item, str):
            item = {"url": item}
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"a dataset shard must be a URL or an object, got {type(item).__name__}")
        url = item.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest("a dataset shard descriptor needs a non-empty 'url'")
        compression = item.get("compression") or "none"
        if compression not in ("none", "zstd"):
            raise InvalidRequest(f"unsupported shard compression {compression!r} (use 'none' or 'zstd')")
        size = item.get("size_bytes") or 0
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequest("shard size_bytes must be a non-negative integer")
        sha = item.get("sha256")
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)):
            raise InvalidRequest("shard sha256 must be 64 hex digits")
        ident = item.get("id")
        if ident is not None and (not isinstance(ident, str) or not ident):
            raise InvalidRequest("shard id must be a non-empty string")
        kind: Literal["none", "zstd"] = "zstd" if compression == "zstd" else "none"
        return cls(url, kind, size, sha.lower() if sha else None, ident)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.to_json().items() if k != "url")
        return f"ShardDescriptor(url={redact_url(self.url)!r}, {shown})"

    @property
    def key(self) -> str:
        if self.id:
            return "id:" + self.id
        if self.sha256:
            return "sha256:" + self.sha256
        return "url:" + strip_query(self.url)

    def to_json(self) -> dict[str, Any]:
        """Without the URL's query: descriptors appear in status and events."""
        out: dict[str, Any] = {"url": strip_query(self.url), "compression": self.compression}
        out.update(
            {
                k: v
                for k, v in (("size_bytes", self.size_bytes), ("sha256", self.sha256), ("id", self.id))
                if v
            }
        )
        return out
