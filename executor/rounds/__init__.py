"""What tenant code sees and how a round ends, identical in-thread and in the sandboxed runner.

- the namespace (DESIGN §9): ``session_namespace``, ``RoundSpec``, ``RoundOutputs``, ``SessionView``;
- the budget (``_budget``): what one round may say — its stats, logs and report, counted in
  the worker;
- the guard: ``validate_script`` at ``load_model``, ``play`` to run a round's code under the
  stop shield and classify its end;
- the outcome: ``RoundOutcome`` (how a round ended), ``round_result`` (the task's result,
  which ships the trained delta through the callable the session hands it);
- the runners: the ``RoundRunner`` protocol both runners meet, and ``InThreadRunner``
  (sandbox ``off``); the sandboxed one is :class:`executor.sandbox.SandboxedRunner`;
- the player (``_player``): ``RoundPlayer``, the round in flight on a thread of its own, and
  its stop.

Inside the package each module imports only those above it in this list:
``_namespace`` → ``_outcome`` → ``_guard`` → ``_inthread``; ``_budget`` after ``_namespace``,
``_player`` last.
"""

from executor.rounds._budget import BudgetLimits, RoundBudget
from executor.rounds._guard import Played, execute_script, play, validate_script
from executor.rounds._inthread import InThreadRunner
from executor.rounds._namespace import (
    NAMESPACE_NAMES,
    RoundOutputs,
    RoundSpec,
    SessionView,
    session_namespace,
)
from executor.rounds._outcome import (
    RoundOutcome,
    RoundRunner,
    RoundSession,
    failure,
    round_result,
)
from executor.rounds._player import RoundPlayer

__all__ = [
    "NAMESPACE_NAMES",
    "BudgetLimits",
    "InThreadRunner",
    "Played",
    "RoundBudget",
    "RoundOutcome",
    "RoundOutputs",
    "RoundPlayer",
    "RoundRunner",
    "RoundSession",
    "RoundSpec",
    "SessionView",
    "execute_script",
    "failure",
    "play",
    "round_result",
    "session_namespace",
    "validate_script",
]
