"""What ``roundhouse train`` and ``roundhouse demo`` show: live progress, the story, the loss.

- :class:`LiveProgress`: one bar per host, moved by the hosts' ``stats`` events (a bar is
  added when a host first takes part, so joiners get theirs);
- :func:`event_line`: one line per membership event (joined, lost, rejoined, kept, …);
- :func:`round_line`, :func:`loss_table` and :func:`plot`: the loss per round, as a line,
  a table and a PNG.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table

from orchestrator.diloco import RoundSummary
from tasks.client import RoundClient
from tasks.names import seq_key


class LiveProgress:
    """One bar per worker, moved by the workers' ``stats`` events."""

    def __init__(self, client: RoundClient, steps: int, console: Console, *, enabled: bool = True) -> None:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[loss]}"),
        )
        self.progress = Progress(*columns, console=console, transient=True, disable=not enabled)
        self.console = console
        self._steps = steps
        self._bars: dict[str, TaskID] = {}
        self._client = client
        self._stop = threading.Event()
        self._enabled = enabled

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.progress.stop()

    def print(self, text: str) -> None:
        self.progress.console.print(text, highlight=False, soft_wrap=True)

    def new_round(self, round_num: int, hosts: Iterable[str]) -> None:
        for host in hosts:
            if host not in self._bars:
                self._bars[host] = self.progress.add_task(host, total=self._steps, loss="")
                if self._enabled:
                    threading.Thread(target=self._follow, args=(host,), daemon=True).start()
            self.progress.reset(self._bars[host], description=f"{host} round {round_num}", loss="")

    def _follow(self, host: str) -> None:
        since = int(self._client.redis.get(seq_key(host)) or 0)
        for event in self._client.events(host, since=since, idle_timeout_s=None):
            if self._stop.is_set():
                return
            if event.type == "stats" and "step" in event.data:
                loss = event.data.get("loss")
                self.progress.update(
                    self._bars[host],
                    completed=int(event.data["step"]) + 1,
                    loss=f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "",
                )


EVENT_TEXT = {
    "joining": "joining ({kind})",
    "joined": "joined ({via}, {seconds} s)",
    "rejoined": "rejoined ({via}, {seconds} s)",
    "kept": "holds the global model already: not loaded again",
    "lost": "lost: {reason}",
    "straggler-stopped": "straggler, stopped: {reason}",
    "left-out": "left out: {reason}",
    "resynced": "re-synced by full download ({reason})",
    "resync-needed": "to re-sync: {reason}",
    "join-stale": "joined an older model: to re-sync",
    "dropped": "dropped after {failures} failures: {reason}",
    "stopped-after-restart": "its round from before the restart stopped",
    "resumed": "resumed from the state directory",
    "model-kept": "fewer than {min_hosts} hosts completed ({completed}): the model stays as it was",
}


def event_line(event: dict[str, Any]) -> str:
    template = EVENT_TEXT.get(event["event"], event["event"])
    try:
        text = template.format(**event)
    except (KeyError, IndexError, ValueError):
        text = event["event"]
    who = event.get("host") or "orchestrator"
    return f"  round {event.get('round')}: {who} {text}"


def round_line(summary: RoundSummary) -> str:
    loss = f"{summary.mean_loss:.4f}" if summary.mean_loss is not None else "-"
    via = ", ".join(sorted(set(summary.via.values()))) or "-"
    left = f"  left out {', '.join(sorted(summary.excluded))}" if summary.excluded else ""
    kept = "  model kept" if summary.kept else ""
    return (
        f"round {summary.round_num}: mean loss {loss}  hosts {len(summary.included)}{left}{kept}"
        f"  synced via {via}  model {summary.model_hash[7:19]}"
    )


def loss_table(history: list[RoundSummary]) -> Table:
    table = Table(title="loss per round")
    for column in ("round", "mean loss", "workers", "left out", "sync"):
        table.add_column(column)
    for s in history:
        left = ", ".join(f"{h} ({why.split(':')[0]})" for h, why in sorted(s.excluded.items()))
        table.add_row(
            str(s.round_num), f"{s.mean_loss:.4f}" if s.mean_loss is not None else "-", str(len(s.included)),
            left or "-", ", ".join(f"{h}:{v}" for h, v in sorted(s.via.items())) or "-",
        )  # fmt: skip
    return table


def plot(
    history: list[RoundSummary], path: Path, title: str = "Roundhouse: DiLoCo over Celery workers"
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    rounds = [s.round_num for s in history]
    hosts = sorted({host for s in history for host in s.losses})
    for host in hosts:
        axes.plot(
            rounds, [s.losses.get(host, float("nan")) for s in history], marker=".", alpha=0.5, label=host
        )
    means = [s.mean_loss if s.mean_loss is not None else float("nan") for s in history]
    axes.plot(rounds, means, marker="o", linewidth=2.5, color="black", label="mean")
    axes.set_xlabel("round")
    axes.set_ylabel("training loss (last steps)")
    if all(m > 0 for m in means if m == m):
        axes.set_yscale("log")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
