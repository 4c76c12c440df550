"""Where the orchestrator keeps artifacts and how workers reach them: URLs only.

Two implementations: :class:`orchestrator.artifacts.ArtifactServer` (the orchestrator
serves a directory itself, with signed URLs) and :class:`orchestrator.s3.S3Store` (an
S3-compatible object store such as MinIO, with presigned URLs).
"""

from __future__ import annotations

import os
from typing import Protocol


class ArtifactStore(Protocol):
    def url_get(self, name: str, expires_s: float = ...) -> str: ...

    def url_put(self, name: str, expires_s: float = ...) -> str: ...

    def publish(self, name: str, source: str | os.PathLike[str]) -> str:
        """Store a local file under ``name``; returns a GET URL for workers."""
        ...

    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None:
        """Copy what is stored under ``name`` (a worker's upload) to a local file."""
        ...
