"""A loaded session: what ``load_model`` established and every later round reuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import CodeType
from typing import Any

from executor.session._model import InstalledModel
from executor.session._requests import LoadRequest
from executor.shards import ShardDescriptor, ShardSession
from executor.urls import Url


@dataclass
class Session:
    """The loaded session; ``model`` is replaced whole when a sync installs a new file.

    It meets :class:`executor.rounds.RoundSession`, what a runner needs of it."""

    tenant: str
    model_url: Url
    model: InstalledModel
    code: str
    compiled: CodeType
    params: dict[str, Any]
    batch_size: int
    dataset: ShardSession
    # Where this round's tenant code loads the model from: W in an overlapped session whose
    # working copy is current, else the installed model (executor.session._overlap).
    working: str | None = None

    @classmethod
    def of(cls, request: LoadRequest, model: InstalledModel, dataset: ShardSession) -> Session:
        return cls(
            tenant=request.tenant,
            model_url=request.model_url,
            model=model,
            code=request.code,
            compiled=request.compiled,
            params=request.params,
            batch_size=request.batch_size,
            dataset=dataset,
        )

    @property
    def model_path(self) -> str:
        return self.model.path

    @property
    def start_path(self) -> str:
        return self.working or self.model.path

    @property
    def bundle_root(self) -> str | None:
        return self.model.bundle_root

    @property
    def preprocessor_config(self) -> Mapping[str, Any]:
        return self.model.preprocessor_config

    @property
    def model_hash(self) -> str:
        return self.model.model_hash

    def update(
        self,
        model: InstalledModel,
        params: dict[str, Any] | None,
        descriptors: list[ShardDescriptor] | None,
    ) -> None:
        """After a sync: the model now in place, and the params and shards it replaced (if any)."""
        self.model = model
        if params is not None:
            self.params = params
        if descriptors is not None:
            self.dataset.replace_descriptors(descriptors)
