"""The one Settings object: read once from the environment (prefix ``ROUNDHOUSE_``) and ``.env``.

Everything configurable lives here and is passed in; no other module reads
``os.environ`` for configuration. Tests build their own ``Settings(...)`` or
patch the object returned by :func:`get_settings`.
"""

from __future__ import annotations

import json
import os
import socket
import zlib
from functools import lru_cache
from typing import Annotated, Literal
from urllib.parse import quote

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

SandboxMode = Literal["auto", "bwrap", "unshare", "off"]


def queue_name(host_id: str) -> str:
    """The Celery queue of one worker: every task of a session goes to its host's own queue.

    Defined here, the lowest layer, because :attr:`Settings.queue` needs it too;
    ``tasks.names`` lists it with the other names on the wire.
    """
    return f"roundhouse.{host_id}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ROUNDHOUSE_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    # Identity and placement
    host_id: str = Field(default_factory=lambda: socket.gethostname().split(".")[0] or "host")
    gpu: int | None = None

    # The control plane (DESIGN §11): task and control messages signed (Celery's auth
    # serializer). A worker trusts only the certificates in trusted_certs (a PEM file, a
    # directory of them, or a glob); a client signs with signing_key + signing_cert. A signed
    # message older than message_max_age_s is refused. tls_ca_file: the CA that rediss://
    # servers are checked against. insecure: run unsigned on a non-loopback broker anyway.
    # keys_dir: a development key directory (`roundhouse keys init`), made when missing,
    # that supplies whichever of the paths here is unset. control_certs: signers a worker
    # obeys for control commands (inspect, revoke …) but never for a task (Flower's).
    trusted_certs: str | None = None
    control_certs: str | None = None
    signing_key: str | None = None
    signing_cert: str | None = None
    message_max_age_s: float = Field(default=3600.0, gt=0)
    tls_ca_file: str | None = None
    insecure: bool = False
    keys_dir: str | None = None

    # Broker, results, events (used by tasks/; the engine does not touch them)
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str | None = None
    events_url: str | None = None

    # Celery and events
    visibility_timeout_s: int = 7 * 24 * 3600
    # Results are small JSON, but 16 workers' worth of rounds add up in a noeviction Redis.
    result_expires_s: int = 7 * 24 * 3600
    events_stream_maxlen: int = 10_000
    # Broker memory per worker (DESIGN §5, §12): the events stream holds at most this many MiB
    # of messages (and events_stream_maxlen entries), trimmed oldest first; each event is cut
    # to events_max_event_bytes where it is published (a tenant's stats message is at most
    # 64 KiB); the stream expires events_stream_ttl_s after its last event.
    events_stream_max_mb: int = Field(default=32, ge=1)
    events_max_event_bytes: int = Field(default=128 << 10, ge=4096)
    events_stream_ttl_s: int = Field(default=24 * 3600, ge=1)
    events_buffer_size: int = 10_000
    heartbeat_interval_s: float = 5.0
    heartbeat_ttl_s: float = 20.0
    revoke_poll_s: float = 0.2
    soft_time_limit_s: float | None = None
    metrics_port: int = 9808  # 0: no metrics endpoint
    # The metrics show tenant activity: loopback unless set (0.0.0.0 for a Prometheus elsewhere,
    # with metrics_token set: then a scrape must present it, bearer or basic auth's password).
    metrics_address: str = "127.0.0.1"
    metrics_token: SecretStr | None = None
    worker_lost_retries: int = 1

    # Disk
    work_dir: str = Field(default_factory=lambda: os.path.join(os.getcwd(), "var", "work"))
    cache_dir: str = Field(default_factory=lambda: os.path.join(os.getcwd(), "var", "cache"))
    shard_cache_max_mb: int = 4096
    cache_wait_timeout_s: float = 120.0
    stage_first_shard: bool = True

    # Transfers
    download_retries: int = 3
    download_backoff_s: float = 2.0
    connect_timeout_s: float = 30.0
    read_timeout_s: float = 300.0
    download_buffer_bytes: int = 4 << 20  # 4 MiB
    parallel_min_bytes: int = 64 << 20
    parallel_connections: int = 8
    # Split a download into parallel ranges only when its first connection ran slower than
    # this over its first 16 MiB (0: always split). 400 MB/s is far above what one connection
    # to an object store gets and far below one to a nearby server.
    parallel_below_bytes_s: int = 400_000_000
    # The data plane's trust boundary (DESIGN §11): what a URL in a task may name.
    # file:// only under these directories (none by default); http(s) to any address but the
    # deny list (loopback, link-local, cloud metadata, this host's own addresses), which these
    # hosts or networks ("10.0.0.0/8", "minio", "127.0.0.1") open again. Lists: JSON or commas.
    file_roots: Annotated[list[str], NoDecode] = Field(default_factory=list)
    url_allow: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Proxies and .netrc from the environment are ignored; a proxy is used only when named here.
    http_proxy: str | None = None
    # Byte caps known before a transfer starts. A body of unknown length (no Content-Length) is
    # capped by max_unknown_download_mb unless the task names the size.
    max_model_mb: int = 64 << 10
    max_shard_mb: int = 16 << 10
    max_unknown_download_mb: int = 1024
    download_low_speed_bytes_s: int = 1024
    download_low_speed_time_s: float = 60.0

    # User code and artifacts
    sandbox: SandboxMode = "auto"
    # A uid (and gid) of its own for each worker's sandbox, so that limits counted per uid
    # (RLIMIT_NPROC) and files a tenant leaves behind never cross to another GPU's tenant.
    # Unset: sandbox_uid_base + the GPU index, or + 100 + a hash of the host id without a GPU.
    sandbox_uid: int | None = None
    sandbox_gid: int | None = None
    sandbox_uid_base: int = 61000
    sandbox_max_procs: int = 4096
    sandbox_max_open_files: int = 4096
    sandbox_memory_mb: int | None = None
    sandbox_tmp_mb: int = 1024
    sandbox_disk_mb: int | None = None
    sandbox_stop_grace_s: float = 5.0
    sandbox_wall_time_s: float | None = None
    # Where the sandbox's limits are enforced from outside: its own cgroup (v2, else v1 memory +
    # pids + freezer), else its pid namespace; auto picks the strongest this host allows.
    sandbox_confinement: Literal["auto", "cgroup2", "cgroup1", "pidns"] = "auto"
    # A spare runner (torch imported, frozen, no tenant code yet) kept ready for the next
    # session, so that load_model does not wait for a sandboxed interpreter to start.
    sandbox_spare: bool = True
    # What one round may send through Redis, counted in the worker (tenant code cannot lift it).
    round_stats_max_events: int = 20_000
    round_stats_max_mb: int = 16
    round_log_max_mb: int = 4
    max_script_bytes: int = 1 << 20
    bundle_max_bytes: int = 64 << 30  # 64 GiB
    bundle_max_files: int = 10_000
    stop_join_timeout_s: float = 30.0
    default_delta_dtype: str = "float16"
    # Quantised trained deltas ("int8", "int4"): values in blocks of this many, each block with
    # its absmax scale stored as this dtype (issue 16). A block of at least 2 keeps a quantised
    # delta within the float32 cap of every delta decode.
    quant_block_size: int = Field(default=128, ge=2, le=1 << 20)
    quant_scale_dtype: Literal["float32", "float16"] = "float32"
    # Error feedback: what quantising a round's delta dropped is added to the next round's.
    quant_error_feedback: bool = True

    # The reference orchestrator (orchestrator/): an S3-compatible store when an endpoint is
    # set, else its own artifact server, reachable by workers at demo_public_host.
    s3_endpoint: str | None = None
    s3_bucket: str = "roundhouse"
    s3_access_key: str | None = None
    # SecretStr: ``roundhouse settings``, a repr of Settings or a traceback's locals never
    # show it; the store reads it once, with get_secret_value().
    s3_secret_key: SecretStr | None = None
    s3_region: str = "us-east-1"
    demo_bind: str = "127.0.0.1"
    demo_public_host: str | None = None

    @field_validator("file_roots", "url_allow", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        # A JSON list, or the plain "a,b" operators write.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [item.strip() for item in text.split(",") if item.strip()]
        return value

    @model_validator(mode="before")
    @classmethod
    def _from_keys_dir(cls, values: object) -> object:
        # keys_dir names files of a `roundhouse keys init` directory; explicit paths win.
        if not isinstance(values, dict):
            return values
        root = values.get("keys_dir")
        if root:
            for name, relative in (
                ("trusted_certs", "trusted"),
                ("control_certs", os.path.join("worker", "control")),
                ("signing_key", "orchestrator.key"),
                ("signing_cert", "orchestrator.crt"),
                ("tls_ca_file", "ca.crt"),
            ):
                values.setdefault(name, os.path.join(str(root), relative))
        return values

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.download_retries < 1:
            raise ValueError("download_retries must be at least 1")
        if self.parallel_connections < 1:
            raise ValueError("parallel_connections must be at least 1")
        if self.download_buffer_bytes < 64 * 1024:
            raise ValueError("download_buffer_bytes must be at least 64 KiB")
        return self

    @property
    def sandbox_ids(self) -> tuple[int, int]:
        """The (uid, gid) this worker's sandbox runs as."""
        if self.sandbox_uid is not None:
            uid = self.sandbox_uid
        elif self.gpu is not None:
            uid = self.sandbox_uid_base + self.gpu
        else:
            uid = self.sandbox_uid_base + 100 + zlib.crc32(self.host_id.encode()) % 900
        return uid, self.sandbox_gid if self.sandbox_gid is not None else uid

    @property
    def shard_cache_max_bytes(self) -> int:
        return self.shard_cache_max_mb << 20

    @property
    def queue(self) -> str:
        return queue_name(self.host_id)

    @property
    def results_url(self) -> str:
        return self.result_backend or self.broker_url

    @property
    def redis_events_url(self) -> str:
        """Events, heartbeats and stop requests need Redis, even when the broker is not Redis."""
        url = self.events_url or self.broker_url
        if url.split("://", 1)[0] not in ("redis", "rediss", "redis+socket", "unix"):
            raise ValueError(
                f"events need a Redis URL: set ROUNDHOUSE_EVENTS_URL (the broker is {url.split('://', 1)[0]})"
            )
        return with_tls_ca(url, self.tls_ca_file)

    @property
    def signed(self) -> bool:
        """Whether this process takes part in the signed control plane (it verifies or signs)."""
        return bool(self.trusted_certs or self.signing_key)


def with_tls_ca(url: str, ca_file: str | None) -> str:
    """A ``rediss://`` URL that redis-py checks against ``ca_file`` (certificate required);
    other URLs unchanged. redis-py reads ``ssl_*`` from the query string."""
    if not url.startswith("rediss://"):
        return url
    query = "ssl_cert_reqs=required" + (f"&ssl_ca_certs={quote(ca_file)}" if ca_file else "")
    if "ssl_cert_reqs=" in url or "ssl_ca_certs=" in url:
        return url  # the operator said it in the URL
    return url + ("&" if "?" in url else "?") + query


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment exactly once."""
    return Settings()
