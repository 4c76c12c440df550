"""The script guard: early, clear errors; SystemExit handling."""

from __future__ import annotations

import pickle

import pytest

from executor.errors import ScriptRejected, UserCodeError
from executor.rounds import execute_script, validate_script


def test_valid_code_compiles_and_runs() -> None:
    namespace: dict = {"x": 2}
    execute_script(validate_script("y = x * 21"), namespace)
    assert namespace["y"] == 42


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        ("def f(:\n  pass", "syntax error in code at line 1"),
        ("x = 1\n  y = 2", "line 2"),
        ("", "empty"),
        ("a = 1\x00", "NUL"),
        (b"x = 1", "string"),
        ("x = '" + "a" * 2048 + "'", "limit"),
    ],
)
def test_bad_code_is_rejected_with_invalid_request(code: object, fragment: str) -> None:
    with pytest.raises(ScriptRejected) as caught:
        validate_script(code, max_bytes=1024)
    assert caught.value.code == "invalid_request"
    assert fragment in caught.value.message


def test_syntax_error_details_name_the_line() -> None:
    with pytest.raises(ScriptRejected) as caught:
        validate_script("ok = 1\nfor x in :\n    pass\n")
    assert caught.value.details["line"] == 2
    assert "for x in" in caught.value.details["text"]
    # Errors cross process boundaries (Celery pickles them): details survive.
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.details == caught.value.details and again.message == caught.value.message


def test_sys_exit_zero_is_a_normal_end_and_non_zero_is_a_user_error() -> None:
    execute_script("import sys\nsys.exit(0)", {})
    execute_script("raise SystemExit", {})
    with pytest.raises(UserCodeError) as caught:
        execute_script("import sys\nsys.exit(3)", {})
    assert caught.value.code == "user_code_error"


def test_exceptions_from_user_code_propagate_unchanged() -> None:
    with pytest.raises(ZeroDivisionError):
        execute_script("1 / 0", {})
