"""Downloads and uploads by URL: HTTP(S) GET/PUT, ``file://`` and plain paths.

A download only ever appears under its final name complete and verified::

    fetch(url, dest) ──▶ dest.partial (+ dest.partial.json: what it holds, how far)
                     ──▶ size and sha256 checked ──▶ os.replace ──▶ dest

The partial names are stable so that a later process resumes what a crashed one
left (callers guarantee one writer per ``dest``). Failed attempts are retried with
a ``Range`` resume; large files on range-capable servers come down over several
connections. An abort is noticed between buffer reads, and a
:class:`~executor.stopping.StopSignal` also shuts the sockets down, so a read blocked
on a stalled server returns at once. URLs reach messages and logs only through
:func:`redact_url`: presigned query strings are credentials.

Behind this surface, private modules, each importing only those listed before it::

    _config    TransferConfig (built from Settings), FetchResult, Progress
    _urls      redact_url, scrub, describe; locate: HTTP(S) or a local file
    _cancel    sessions whose sockets an abort can shut down; Cancel
    _http      one attempt's errors, the status check, the retry loop, headers
    _partial   the partial file, its sidecar (resume), the progress meter
    _body      a response body copied into the file, the speed floor
    _follower  the sha256 of a file computed just behind its writer
    _ranged    parallel ranged GETs, one segment per connection
    _stream    one sequential GET, resumed; hands over to _ranged when slow
    _local     file:// and path copies, local uploads, hashing a finished file
    _fetch     fetch and remote_size: locate, download, check, move into place
    _upload    upload: HTTP PUT or a local copy
"""

from executor.transfer._config import FetchResult, Progress, TransferConfig
from executor.transfer._fetch import fetch, remote_size
from executor.transfer._partial import partial_paths
from executor.transfer._upload import upload
from executor.transfer._urls import redact_url

__all__ = [
    "FetchResult",
    "Progress",
    "TransferConfig",
    "fetch",
    "partial_paths",
    "redact_url",
    "remote_size",
    "upload",
]
