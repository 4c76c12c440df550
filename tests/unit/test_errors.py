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


def test_map_exceptions_translates_once_without_chaining() -> None:
    with (
        pytest.raises(errors.BadArtifact) as caught,
        errors.map_exceptions({ValueError: errors.into(errors.BadArtifact, "delta is corrupt")}),
    ):
        raise ValueError("bad frame at https://store/x?X-Amz-Signature=secret")
    assert str(caught.value) == "delta is corrupt: ValueError: bad frame at https://store/x?<redacted>"
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # the one rule


def test_map_exceptions_lets_the_tree_and_unnamed_errors_through() -> None:
    stop = errors.Stopped("stopped")
    with (
        pytest.raises(errors.Stopped) as caught,
        errors.map_exceptions({Exception: errors.into(errors.BadArtifact, "x")}),
    ):
        raise stop
    assert caught.value is stop
    with pytest.raises(KeyError), errors.map_exceptions({ValueError: errors.into(errors.BadArtifact, "x")}):
        raise KeyError("k")


def test_a_full_disk_is_storage_full_whatever_the_translation() -> None:
    import errno

    with (
        pytest.raises(errors.StorageFull) as caught,
        errors.map_exceptions({OSError: errors.into(errors.BadArtifact, "x")}, where="the cache"),
    ):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.code == "download_failed"
    assert caught.value.details["errno_name"] == "ENOSPC" and caught.value.details["where"] == "the cache"
    with (
        pytest.raises(errors.BadArtifact),
        errors.map_exceptions({OSError: errors.into(errors.BadArtifact, "x")}),
    ):  # without ``where``, the translation applies
        raise OSError(errno.ENOSPC, "No space left on device")


def test_sandbox_unavailable_is_in_the_tree() -> None:
    assert issubclass(errors.SandboxUnavailable, errors.SandboxRunnerError)
    assert errors.SandboxUnavailable("no sandbox").code == "sandbox_runner_error"
