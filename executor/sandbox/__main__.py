"""``python -m executor.sandbox``: the runner, started inside the sandbox by the supervisor."""

from executor.sandbox._runner import main

main()
