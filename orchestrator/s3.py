"""Artifacts in an S3-compatible object store (MinIO, S3), reached by presigned URLs.

Workers never hold credentials: the orchestrator presigns a GET (models, shards, sync
deltas) or a PUT (a worker's trained delta) for each object, with AWS Signature Version 4
in the query string — what every S3-compatible store accepts. Path-style addressing
(``endpoint/bucket/key``), which MinIO expects.

The signer is written here rather than taken from botocore: it is 3.5 × faster (20 µs a URL
against 71 µs, ``python -m bench.presign``), which counts when a sharded round signs N × N
URLs, and ``tests/unit/test_orchestrator_parts.py`` holds it equal to botocore's
``S3SigV4QueryAuth``, URL for URL, over keys with spaces, reserved and non-ASCII characters,
every method, region and lifetime it signs. ``presign`` takes the key unencoded.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

import requests

from settings import Settings

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def presign(
    method: str,
    url: str,
    *,
    access_key: str,
    secret_key: str,
    region: str = "us-east-1",
    expires_s: int = 3600,
    now: dt.datetime | None = None,
) -> str:
    """A SigV4 query-string-signed URL for ``method`` on ``url`` (signed header: host only)."""
    moment = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    day = moment[:8]
    parts = urlsplit(url)
    scope = f"{day}/{region}/s3/aws4_request"
    query = {
        "X-Amz-Algorithm": "AWS4-HMAC-SHA256",
        "X-Amz-Credential": f"{access_key}/{scope}",
        "X-Amz-Date": moment,
        "X-Amz-Expires": str(expires_s),
        "X-Amz-SignedHeaders": "host",
    }
    canonical_query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
    )
    canonical_request = "\n".join(
        [
            method,
            quote(parts.path or "/", safe="/-_.~"),
            canonical_query,
            f"host:{parts.netloc}\n",
            "host",
            UNSIGNED_PAYLOAD,
        ]
    )
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", moment, scope, hashlib.sha256(canonical_request.encode()).hexdigest()]
    )
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    path = quote(parts.path, safe="/-_.~")
    return f"{parts.scheme}://{parts.netloc}{path}?{canonical_query}&X-Amz-Signature={signature}"


@dataclass
class S3Store:
    """``ArtifactStore`` on a bucket; the orchestrator itself also talks to it by presigned URL."""

    endpoint: str  # what workers use, e.g. http://minio:9000
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    prefix: str = "roundhouse"

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Store:
        """The store that ``ROUNDHOUSE_S3_ENDPOINT``, ``_BUCKET``, ``_ACCESS_KEY``,
        ``_SECRET_KEY`` and ``_REGION`` describe."""
        if not (settings.s3_endpoint and settings.s3_access_key and settings.s3_secret_key):
            raise ValueError(
                "an S3 store needs ROUNDHOUSE_S3_ENDPOINT, ROUNDHOUSE_S3_ACCESS_KEY "
                "and ROUNDHOUSE_S3_SECRET_KEY"
            )
        return cls(
            endpoint=settings.s3_endpoint,
            bucket=settings.s3_bucket,
            access_key=settings.s3_access_key,
            secret_key=settings.s3_secret_key.get_secret_value(),
            region=settings.s3_region,
        )

    def _object_url(self, name: str) -> str:
        return f"{self.endpoint.rstrip('/')}/{self.bucket}/{self.prefix}/{name.lstrip('/')}"

    def _sign(self, method: str, url: str, expires_s: float) -> str:
        return presign(
            method, url, access_key=self.access_key, secret_key=self.secret_key, region=self.region,
            expires_s=int(expires_s),
        )  # fmt: skip

    def url_get(self, name: str, expires_s: float = 6 * 3600) -> str:
        return self._sign("GET", self._object_url(name), expires_s)

    def url_put(self, name: str, expires_s: float = 6 * 3600) -> str:
        return self._sign("PUT", self._object_url(name), expires_s)

    def ensure_bucket(self) -> None:
        url = self._sign("PUT", f"{self.endpoint.rstrip('/')}/{self.bucket}", 600)
        response = requests.put(url, timeout=30)
        if response.status_code not in (200, 409):  # 409: it exists already
            response.raise_for_status()

    def publish(self, name: str, source: str | os.PathLike[str]) -> str:
        with open(source, "rb") as body:
            response = requests.put(self.url_put(name, 600), data=body, timeout=600)
        response.raise_for_status()
        return self.url_get(name)

    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None:
        with requests.get(self.url_get(name, 600), stream=True, timeout=600) as response:
            response.raise_for_status()
            with open(dest, "wb") as out:
                for chunk in response.iter_content(4 * 1024 * 1024):
                    out.write(chunk)
