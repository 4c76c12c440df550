"""Who may be served a cache entry (DESIGN §7, §11 "tenant data"), and the entry's name.

A cached shard is served only to a caller who could have downloaded it:

- **Content-addressed** entries (the descriptor names a ``sha256``) are served within
  the tenant without asking the server: the hash proves the content, and the tenant
  already holds it. The entry is named by the hash and the compression.
- **Every other** entry is served only after the caller's own URL is shown to work:
  :func:`check_access` sends one ranged ``GET`` of ``bytes=0-0`` with that URL
  (presigned URLs are signed for ``GET``) and reads what the server says about the
  object. The entry is named by everything that determines its bytes — the URL without
  its query, the compression, the claimed ``sha256``, and that answer (:class:`Origin`:
  the size, and the ETag and Last-Modified when the server gives them) — so a caller is
  served an entry only when its own answer names the same object. A refused URL
  (403, 404, a policy refusal) is ``download_failed`` for that caller and leaves the
  entry for those who can reach it; a changed object (another size or validator) has
  another name, so it is downloaded again, never served stale, and the old version
  ages out of the LRU. A descriptor's ``id`` labels a shard for its session but does
  not widen sharing: two URLs with one id are two objects as far as anyone can prove.
- **The anonymous tenant** (``"default"``, what a task without a tenant gets) is not
  a tenant: nothing proves that two anonymous callers are one party. Its entries are
  never content-addressed (a known hash is not access); every one is checked as above,
  so anonymous callers share only what each has shown it can download, and never
  share with a named tenant (each tenant has a directory of its own).

The check is one tiny request per shard per session: a :class:`ShardSession` remembers
the :class:`Origin` it was shown (the executor's session lasts from ``load_model`` to the
next ``load_model`` or ``reset``, so every round of a session reuses it), and a session
that receives new URLs (``apply_delta(dataset_shards=...)``) checks them afresh.
A server that gives neither a size nor a validator cannot tell a changed object from
the old one; its entries are served on the size the descriptor names.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from executor import transfer
from executor.errors import DownloadFailed
from executor.shards._descriptor import ShardDescriptor, strip_query
from executor.urls import Url

ANONYMOUS_TENANT = "default"


@dataclass(frozen=True)
class Origin:
    """What the server said about the caller's URL; an entry made from it is named by it.

    ``size`` is the size the server announced, else the one the descriptor names (None
    when neither does: such a shard cannot be downloaded, see ``ShardCache``).
    """

    size: int | None
    etag: str | None = None
    last_modified: str | None = None


def content_addressed(tenant: str, descriptor: ShardDescriptor) -> bool:
    """True when the entry is served on its hash alone (see the module docstring)."""
    return descriptor.sha256 is not None and tenant != ANONYMOUS_TENANT


def source_of(url: str) -> str:
    """The object a URL names: an HTTP(S) URL without its query (a re-presigned URL is the
    same object), a local file by its whole name (``?`` is a legal file name character)."""
    return strip_query(url) if urlsplit(url).scheme in ("http", "https") else url


def entry_name(tenant: str, descriptor: ShardDescriptor, origin: Origin | None) -> str:
    """The entry's file stem within the tenant's directory (40 hex digits)."""
    if content_addressed(tenant, descriptor):
        parts: list[object] = ["sha256", descriptor.sha256, descriptor.compression]
    elif origin is None:
        raise ValueError("an entry that is not content-addressed is named by the check of its URL")
    else:
        parts = [
            "url",
            source_of(descriptor.url),
            descriptor.compression,
            descriptor.sha256,
            origin.size,
            origin.etag,
            origin.last_modified,
        ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:40]


def check_access(
    descriptor: ShardDescriptor, *, config: transfer.TransferConfig, abort: threading.Event | None
) -> Origin:
    """Show that the caller's own URL works and learn what it names; ``DownloadFailed``
    when the server (or the URL policy) refuses it, or names another size than the
    descriptor."""
    info = transfer.remote_info(descriptor.url, config=config, abort=abort)
    size = info.size
    claimed = descriptor.size_bytes or None
    if size is not None and claimed is not None and size != claimed:
        url = Url.of(descriptor.url)
        raise DownloadFailed(
            f"shard {url} has {size} bytes on the server, its descriptor says {claimed}",
            {"url": str(url), "bytes": size, "expected": claimed},
        )
    return Origin(size if size is not None else claimed, info.etag, info.last_modified)
