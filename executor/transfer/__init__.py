"""Downloads and uploads by URL: HTTP(S) GET/PUT, and ``file://`` under the operator's roots.

A download only ever appears under its final name complete and verified::

    fetch(url, dest) ──▶ URL policy ──▶ dest.partial (+ dest.partial.json: what it holds, how far)
                     ──▶ byte cap, head check, size and sha256 ──▶ os.replace ──▶ dest

Every URL goes through one policy (DESIGN §11, :mod:`._policy`) before anything is
fetched or written, and every connection, redirects included, is checked after DNS
resolution against its deny list. Every download has a byte cap known before it starts.

The partial names are stable so that a later process resumes what a crashed one
left (callers guarantee one writer per ``dest``). Failed attempts are retried with
a ``Range`` resume; large files on range-capable servers come down over several
connections. An abort is noticed between buffer reads, and a
:class:`~executor.stopping.StopSignal` also shuts the sockets down, so a read blocked
on a stalled server returns at once. Presigned query strings are credentials: every entry
point takes a ``str`` or an :class:`executor.urls.Url` and carries a ``Url`` from there on,
whose every rendering (a message, a log line, an error's details, the sidecar) is redacted;
its raw form is asked for (``Url.reveal()``) only where a request goes out and where the
policy reads a host or a file path. ``redact_url`` is the same redaction for a plain ``str``.

Behind this surface, private modules, each importing only those listed before it::

    _policy    the URL policy: schemes, file roots (opened without following links),
               the address deny list and allow list, this host's own addresses
    _config    TransferConfig (with the policy; built by executor.configs), FetchResult, Progress, Head
    _cancel    the sockets an abort shuts down; Cancel
    _session   HTTP sessions whose connections the policy checks at connect time; urllib3's
               log lines scrubbed of query strings
    _http      send (redirects by hand, each hop checked), one attempt's errors, the
               status check, the retry loop, headers
    _limits    a download's byte cap and head check
    _partial   the partial file, its sidecar (resume), the progress meter
    _body      a response body copied into the file, the speed floor
    _follower  the sha256 of a file computed just behind its writer
    _ranged    parallel ranged GETs, one segment per connection
    _stream    one sequential GET, resumed; hands over to _ranged when slow
    _local     file:// copies and uploads, hashing a finished file
    _fetch     fetch, remote_size and remote_info: the policy, download, check, move into place
    _upload    upload: HTTP PUT or a file:// copy; check_url: the policy's verdict before any I/O
"""

from executor.transfer._config import FetchResult, Head, Progress, RemoteInfo, TransferConfig
from executor.transfer._fetch import fetch, remote_info, remote_size
from executor.transfer._partial import partial_paths
from executor.transfer._policy import UrlPolicy
from executor.transfer._upload import check_url, upload
from executor.urls import redact_url

__all__ = [
    "FetchResult",
    "Head",
    "Progress",
    "RemoteInfo",
    "TransferConfig",
    "UrlPolicy",
    "check_url",
    "fetch",
    "partial_paths",
    "redact_url",
    "remote_info",
    "remote_size",
    "upload",
]
