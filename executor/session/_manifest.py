"""The session manifest: what a replacement process needs to carry on with a session.

A worker child that dies (the OOM killer, a segfault in a CUDA library) is replaced by one
that finds ``session.json`` and the model file where the old one left them. The manifest is
a frozen value serialised beside its dataclass (``to_json`` / ``from_json``); what it names is
checked again on the way back in, as the request it came from was.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from executor.delta import ErrorFeedback
from executor.errors import InvalidRequest
from executor.fileio import atomic_write_json, read_json
from executor.session._requests import LoadRequest
from executor.session._state import Session
from executor.workdir import SessionDir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Manifest:
    """One session as ``session.json`` holds it (version ``v``)."""

    VERSION: ClassVar[int] = 1

    tenant: str
    model_url: str  # raw: the session's own file in the work dir, which only the worker reads
    code: str
    params: dict[str, Any]
    batch_size: int
    shards: list[dict[str, Any]]
    model_hash: str
    fingerprint: list[Any]
    model_path: str = ""
    bundle_root: str | None = None
    preprocessor_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, session: Session) -> Manifest:
        return cls(
            tenant=session.tenant,
            model_url=session.model_url.reveal(),  # the worker's own file: a replacement fetches again
            code=session.code,
            params=session.params,
            batch_size=session.batch_size,
            shards=[asdict(d) for d in session.dataset.descriptors],
            model_hash=session.model_hash,
            fingerprint=list(session.model.fingerprint),
            model_path=session.model_path,
            bundle_root=session.bundle_root,
            preprocessor_config=dict(session.preprocessor_config),
        )

    def to_json(self) -> dict[str, Any]:
        return {"v": self.VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """The manifest ``data`` holds; ``InvalidRequest`` for another version or shape."""
        if not isinstance(data, dict) or data.get("v") != cls.VERSION:
            raise InvalidRequest("not a version-1 session manifest")
        known = {f.name for f in fields(cls)}
        try:
            manifest = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:  # a field missing
            raise InvalidRequest(f"session manifest: {exc}") from None
        if not isinstance(manifest.model_hash, str) or not isinstance(manifest.fingerprint, list):
            raise InvalidRequest("session manifest: model_hash or fingerprint of the wrong type")
        if not isinstance(manifest.preprocessor_config, dict):
            raise InvalidRequest("session manifest: preprocessor_config is not an object")
        return manifest

    def request(self, *, max_script_bytes: int) -> LoadRequest:
        """The load this session came from, checked again (the file is data, like a message)."""
        return LoadRequest.parse(
            self.model_url,
            self.shards,
            self.code,
            self.batch_size,
            self.params,
            0,
            tenant=self.tenant,
            max_script_bytes=max_script_bytes,
        )


def write_manifest(session: Session, work_dir: str) -> None:
    """Keep what a replacement process needs beside the model (atomically)."""
    try:
        atomic_write_json(SessionDir(work_dir).manifest, Manifest.of(session).to_json())
    except (TypeError, ValueError):
        # Library callers may pass params JSON cannot hold; the manifest is then skipped.
        logger.warning("session manifest not written: params are not JSON-serialisable")


def read_manifest(work_dir: str) -> Manifest | None:
    """The manifest in ``work_dir``; None when there is none or it is not usable."""
    try:
        return Manifest.from_json(read_json(SessionDir(work_dir).manifest))
    except (OSError, ValueError, InvalidRequest) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("session manifest not usable: %s", exc)
        return None


def drop_manifest(work_dir: str) -> None:
    """The session is over: no process may resume it, and its error feedback goes with it
    (a new model must not get the residual of the old one's deltas)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SessionDir(work_dir).manifest)
    ErrorFeedback(work_dir).drop()
