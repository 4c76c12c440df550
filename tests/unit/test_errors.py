"""The error tree: stable codes, every error pickles with its data."""

from __future__ import annotations

import pickle

import pytest

from executor import errors

STABLE = {
    "user_code_error",
    "gpu_oom",
    "sandbox_runner_error",
    "sandbox_protocol_error",
    "download_failed",
    "bad_artifact",
    "hash_mismatch",
    "invalid_request",
    "stopped",
    "internal_error",
}


def all_errors() -> list[type[errors.RoundhouseError]]:
    found, todo = [], [errors.RoundhouseError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", all_errors(), ids=lambda c: c.__name__)
def test_every_error_pickles_and_has_a_stable_code(cls: type[errors.RoundhouseError]) -> None:
    exc = cls("something broke", {"host": "example.org", "status": 503})
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is cls
    assert again.message == "something broke" and again.details == {"host": "example.org", "status": 503}
    assert again.code in STABLE
    assert again.to_json() == {"code": again.code, "message": "something broke", "details": exc.details}


def test_the_tree_has_exactly_the_contracts_codes() -> None:
    assert errors.stable_codes() == STABLE


def test_error_info_maps_foreign_exceptions() -> None:
    assert errors.error_info(errors.StopExecution()).code == "stopped"
    assert errors.error_info(ValueError("x")).code == "internal_error"
    assert errors.error_info(errors.GpuOutOfMemory("oom")).to_json() == {"code": "gpu_oom", "message": "oom"}


def test_shard_index_error_is_also_an_index_error() -> None:
    # Seed callers catch IndexError for a bad shard index.
    assert issubclass(errors.ShardIndexError, IndexError)
    assert errors.ShardIndexError("x").code == "invalid_request"
