"""The session's requests, each one typed value checked once where it enters.

``load_model``, ``run_round`` and ``apply_delta`` arrive as loose JSON arguments (from a task
message, or from a seed caller's positional arguments). Each becomes one frozen request here,
before anything on disk or in memory changes; everything below the facade takes the request
and checks nothing again (httpx's one ``Request`` handed through its transports).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import CodeType
from typing import Any

import torch

from executor.delta import DEFAULT_SCHEME, DeltaFormat, QuantScheme, check_scheme
from executor.errors import InvalidRequest
from executor.reduce import MAX_SHARDS, SHARD_ALIGN
from executor.rounds import RoundSpec, validate_script
from executor.session._overlap import OverlapSpec
from executor.shards import ShardDescriptor, check_tenant
from executor.urls import Url

EXACT_HASH = re.compile(r"^(sha256|blake3):[0-9a-f]{64}$")

DELTA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
QUANT_DTYPES = ("int8", "int4")

# A URL the round will PUT its delta to, refused (InvalidRequest) before the round trains.
UrlCheck = Callable[[Url], object]


@dataclass(frozen=True)
class QuantConfig:
    """How a quantised delta is cut: the settings' ``quant_block_size`` and ``quant_scale_dtype``,
    and whether the session carries its quantisation error to the next round."""

    block_size: int = 0  # 0: the scheme's own default
    scale_dtype: str = ""  # "": the scheme's own default
    error_feedback: bool = True

    def delta_format(self, name: object) -> DeltaFormat:
        """``run_round``'s ``delta_dtype``: a float dtype, or a quantised scheme cut as configured."""
        if isinstance(name, str) and name in QUANT_DTYPES:
            if not self.block_size and not self.scale_dtype:
                return QuantScheme.named(name)
            return QuantScheme.named(name, self.block_size, self.scale_dtype)
        if not isinstance(name, str) or name not in DELTA_DTYPES:
            names = [*sorted(DELTA_DTYPES), *QUANT_DTYPES]
            raise InvalidRequest(f"delta_dtype must be one of {names}, got {name!r}")
        return DELTA_DTYPES[name]


def check_params(params: object) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidRequest(f"params must be an object, got {type(params).__name__}")
    return dict(params)


def check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def optional_url(name: str, value: object) -> Url | None:
    """An optional URL argument as a :class:`Url` (shown redacted from here on)."""
    return None if value is None or value == "" else required_url(name, value)


def required_url(name: str, value: object) -> Url:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string")
    return Url(value)


def check_shards(dataset_shards: object) -> list[ShardDescriptor]:
    if not isinstance(dataset_shards, Sequence) or isinstance(dataset_shards, (str, bytes)):
        raise InvalidRequest("dataset_shards must be a list of URLs or descriptors")
    return [ShardDescriptor.parse(item) for item in dataset_shards]


@dataclass(frozen=True)
class LoadRequest:
    """One ``load_model``: the model to fetch, the tenant's code (compiled once) and dataset."""

    model_url: Url
    code: str
    compiled: CodeType
    tenant: str
    descriptors: list[ShardDescriptor]
    batch_size: int
    params: dict[str, Any]
    initial_shard_index: int
    hash_scheme: str = DEFAULT_SCHEME

    @classmethod
    def parse(
        cls,
        model_url: object,
        dataset_shards: object,
        code: object,
        batch_size: object = 32,
        params: object = None,
        initial_shard_index: object = 0,
        *,
        tenant: object = "default",
        hash_scheme: object = DEFAULT_SCHEME,
        max_script_bytes: int,
    ) -> LoadRequest:
        compiled = validate_script(code, max_bytes=max_script_bytes)
        return cls(
            model_url=required_url("model_url", model_url),
            code=str(code),
            compiled=compiled,
            tenant=check_tenant(tenant),  # type: ignore[arg-type]
            descriptors=check_shards([] if dataset_shards is None else dataset_shards),
            batch_size=check_int("batch_size", batch_size, 1),
            params=check_params(params),
            # The seed clamps a negative index to 0 and wraps a large one; keep that.
            initial_shard_index=max(0, check_int("initial_shard_index", initial_shard_index, -(2**62))),
            hash_scheme=check_scheme(hash_scheme),
        )

    @property
    def staged_shard(self) -> int | None:
        """The shard a load stages first (None without shards)."""
        return self.initial_shard_index % len(self.descriptors) if self.descriptors else None


@dataclass(frozen=True)
class RoundRequest:
    """One ``run_round``: the round tenant code plays, and where its delta goes in which format."""

    spec: RoundSpec
    delta_url: Url | None = None
    delta_format: DeltaFormat = torch.float16
    overlap: OverlapSpec | None = None  # an overlapped session's round (executor.session._overlap)
    # A sharded round's (docs/SHARDED.md): ``delta_url`` given as a list, one URL per shard.
    delta_shards: tuple[Url, ...] | None = None

    @classmethod
    def parse(
        cls,
        steps: object = 100,
        round_num: object = 0,
        total_rounds: object = 1,
        mode: object = "training",
        step_offset: object = 0,
        *,
        delta_url: object = None,
        delta_dtype: object = "float16",
        quant: QuantConfig,
        policy: UrlCheck | None = None,
        overlap: object = None,
    ) -> RoundRequest:
        """A negative ``step_offset`` counts as 0 (the seed's). ``policy`` refuses a delta URL
        the URL policy would refuse at the upload, before the round trains (nothing is written)."""
        delta_format = quant.delta_format(delta_dtype)
        if mode not in ("training", "inference"):
            raise InvalidRequest(f"mode must be 'training' or 'inference', got {mode!r}")
        spec = RoundSpec(
            check_int("steps", steps, 0),
            check_int("round_num", round_num, 0),
            check_int("total_rounds", total_rounds, 0),
            max(0, check_int("step_offset", step_offset, -(2**62))),
            str(mode),
        )
        request = cls(spec, None, delta_format, OverlapSpec.parse(overlap))
        if request.overlap is not None and not spec.training:
            raise InvalidRequest("only a training round can be overlapped")
        return request.shipping_to(delta_url, delta_format, policy)

    def shipping_to(
        self, delta_url: object, delta_format: DeltaFormat, policy: UrlCheck | None = None
    ) -> RoundRequest:
        """This round with its delta sent elsewhere (the seed's ``finish_round`` names it late).
        A list of URLs: the delta as that many shards of a sharded round, one PUT each
        (``executor.reduce``; float dtypes, sequential rounds)."""
        if isinstance(delta_url, (list, tuple)):
            return self._sharded(delta_url, delta_format, policy)
        url = optional_url("delta_url", delta_url)
        if url is not None and policy is not None:
            policy(url)
        return replace(self, delta_url=url, delta_format=delta_format, delta_shards=None)

    def _sharded(
        self, urls: Sequence[object], delta_format: DeltaFormat, policy: UrlCheck | None
    ) -> RoundRequest:
        if not 2 <= len(urls) <= MAX_SHARDS:
            raise InvalidRequest(f"a sharded delta_url is a list of 2-{MAX_SHARDS} URLs, got {len(urls)}")
        if isinstance(delta_format, QuantScheme) and SHARD_ALIGN % delta_format.block_size:
            raise InvalidRequest(f"a sharded round's quantised blocks must divide {SHARD_ALIGN} elements")
        if self.overlap is not None:
            raise InvalidRequest("a sharded round is not overlapped (docs/SHARDED.md)")
        shards = tuple(required_url(f"delta_url[{n}]", url) for n, url in enumerate(urls))
        if policy is not None:
            for url in shards:
                policy(url)
        return replace(self, delta_url=None, delta_format=delta_format, delta_shards=shards)


@dataclass(frozen=True)
class StoreOrder:
    """A reducer's deferred objects, PUT beside its apply (docs/SHARDED.md, "Deferred store"):
    where its shard's new state (the file named by the shard's ``result_hash``) and velocity go."""

    state_url: Url
    velocity_url: Url
    velocity_hash: str

    @classmethod
    def parse(cls, n: int, value: object, result_hash: str) -> StoreOrder:
        """The two files are found by their hashes in the work dir: both must be exact hashes
        (a name that is not one is refused here, before it can be a path)."""
        if not isinstance(value, dict):
            raise InvalidRequest(
                f"sync shard {n} store must be an object: state_url, velocity_url, velocity_hash"
            )
        velocity_hash = value.get("velocity_hash")
        if not isinstance(velocity_hash, str) or not EXACT_HASH.match(velocity_hash):
            raise InvalidRequest(f"sync shard {n} store needs its velocity_hash ('<sha256|blake3>:<64 hex>')")
        if not EXACT_HASH.match(result_hash):
            raise InvalidRequest(f"sync shard {n} with a store order needs an exact result_hash")
        return cls(
            required_url(f"sync shard {n} store.state_url", value.get("state_url")),
            required_url(f"sync shard {n} store.velocity_url", value.get("velocity_url")),
            velocity_hash,
        )


@dataclass(frozen=True)
class SyncShard:
    url: Url
    hash: str
    result_hash: str
    state_url: Url | None
    store: StoreOrder | None = None  # this host reduced the shard: its deferred objects' PUT


@dataclass(frozen=True)
class ShardedSync:
    """``apply_delta``'s ``delta_url`` given as the round's N shards (a list of objects)."""

    shards: tuple[SyncShard, ...]
    align: int = SHARD_ALIGN

    @classmethod
    def parse(cls, value: object) -> ShardedSync:
        if not isinstance(value, (list, tuple)) or not 2 <= len(value) <= MAX_SHARDS:
            raise InvalidRequest(f"a sharded sync is a list of 2-{MAX_SHARDS} shards")
        shards = []
        for n, item in enumerate(value):
            if not isinstance(item, dict):
                raise InvalidRequest(f"sync shard {n} must be an object: url, hash, result_hash, state_url")
            hashes = [item.get("hash"), item.get("result_hash")]
            if not all(isinstance(h, str) and h.partition(":")[2] for h in hashes):
                raise InvalidRequest(f"sync shard {n} needs its hash and result_hash")
            state, store = item.get("state_url"), item.get("store")
            shards.append(
                SyncShard(
                    required_url(f"sync shard {n} url", item.get("url")), str(hashes[0]), str(hashes[1]),
                    required_url(f"sync shard {n} state_url", state) if state is not None else None,
                    StoreOrder.parse(n, store, str(hashes[1])) if store is not None else None,
                )
            )  # fmt: skip
        return cls(tuple(shards))


@dataclass(frozen=True)
class SyncRequest:
    """One ``apply_delta``: the sync delta on its base, the full model as the fallback, and the
    params and shards that replace the session's (None leaves what the session has)."""

    model_url: Url
    delta_url: Url | None
    base_hash: str | None
    result_hash: str | None
    params: dict[str, Any] | None
    descriptors: list[ShardDescriptor] | None
    sharded: ShardedSync | None = None  # a sharded round's: ``delta_url`` given as its N shards

    @classmethod
    def parse(
        cls,
        model_url: object,
        params: object = None,
        dataset_shards: object = None,
        delta_url: object = None,
        base_hash: object = None,
        result_hash: object = None,
    ) -> SyncRequest:
        url = required_url("model_url", model_url)
        for name, value in (("base_hash", base_hash), ("result_hash", result_hash)):
            if value is not None and not isinstance(value, str):
                raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")
        sharded = ShardedSync.parse(delta_url) if isinstance(delta_url, (list, tuple)) else None
        return cls(
            url,
            None if sharded is not None else optional_url("delta_url", delta_url),
            base_hash or None,  # type: ignore[arg-type]
            result_hash or None,  # type: ignore[arg-type]
            check_params(params) if params is not None else None,
            check_shards(dataset_shards) if dataset_shards is not None else None,
            sharded,
        )
