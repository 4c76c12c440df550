"""What tenant code sees and how a round ends, identical in-thread and in the sandboxed runner.

The namespace (DESIGN §9), the script guard, the in-thread runner and the round's outcome.
"""

from executor.rounds._guard import execute_script, validate_script
from executor.rounds._inthread import RoundOutcome, ThreadRound, failure
from executor.rounds._namespace import (
    NAMESPACE_NAMES,
    RoundOutputs,
    RoundSpec,
    SessionView,
    cpu_state,
    session_namespace,
)
from executor.rounds._outcome import round_result, ship_delta

__all__ = [
    "NAMESPACE_NAMES",
    "RoundOutcome",
    "RoundOutputs",
    "RoundSpec",
    "SessionView",
    "ThreadRound",
    "cpu_state",
    "execute_script",
    "failure",
    "round_result",
    "session_namespace",
    "ship_delta",
    "validate_script",
]
