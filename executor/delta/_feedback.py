"""Error feedback: what quantising a session's trained deltas dropped, kept for its next round.

A round that ships a quantised delta (``int8``, ``int4``) adds the residual of the rounds
before it to ``trained - original`` before quantising, and keeps what this quantisation
dropped, ``value - dequant(quant(value))`` in float32, as the next residual. It lives in
the work dir beside the model (``SessionDir.residual``, a plain safetensors file of float32
tensors), so it survives a crash of the worker's child with the rest of the session (the
manifest); the session drops it at ``load_model`` (``executor.session.drop_manifest``) and
``reset`` wipes it with the work dir.

The next residual is staged beside the current one and replaces it only when the round's
delta has been delivered (uploaded, or kept in the work dir): a delta that never reached
the orchestrator leaves the residual it was built from in place, since nothing it carried
arrived. A residual file that cannot be read is treated as none — it is a correction to
the next delta, never a reason to fail a round.

:class:`SyncFeedback` is the same idea on the orchestrator's side: what quantising one
round's sync delta dropped from the outer step is added to the next round's step, so
that the global model follows the outer optimiser over rounds, not just round by round.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO

import torch

from executor.delta._quant import DeltaFormat, QuantScheme, delta_format
from executor.delta._schemes import DEFAULT_SCHEME
from executor.delta._sync import SyncDelta, is_floating, make_sync_delta
from executor.errors import BadArtifact
from executor.fileio import remove_quietly, temp_path_for
from executor.tensorfile import Header, StreamWriter, read_header, read_tensor, tensor_bytes
from executor.workdir import SessionDir

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """The residual of one session's quantised deltas, in its work dir."""

    def __init__(self, work_dir: str) -> None:
        self.path = SessionDir(work_dir).residual

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def drop(self) -> int:
        """Forget the residual (a new session, a reset); returns the bytes freed."""
        return remove_quietly(self.path)

    def load(self) -> dict[str, torch.Tensor]:
        """The whole residual (empty when there is none or it cannot be read)."""
        with self.next_round() as update:
            return update.previous_all()

    @contextmanager
    def next_round(self) -> Iterator[ResidualUpdate]:
        """The current residual to read and the next one to stage; ``commit()`` swaps it in,
        leaving without a commit keeps the current one."""
        update = ResidualUpdate(self.path)
        try:
            yield update
        finally:
            update.close()


class ResidualUpdate:
    """One round's pass over the residual: read the previous one, stage the next in key order.

    Keys the round does not write (a key the trained state lacked) keep their previous
    residual: it is copied into the next file where it falls in the order.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._old: IO[bytes] | None = None
        self._old_header: Header | None = None
        self._open_previous()
        self._tmp: str | None = None
        self._out: IO[bytes] | None = None
        self._writer: StreamWriter | None = None
        self._plan: list[str] = []
        self._carried: set[str] = set()
        self._done = 0

    def _open_previous(self) -> None:
        try:
            self._old = open(self._path, "rb")  # noqa: SIM115 - closed by close()
        except FileNotFoundError:
            return
        try:
            self._old_header = read_header(self._old)
        except (BadArtifact, OSError) as exc:
            logger.warning("error-feedback residual unreadable, starting from none: %s", exc)
            self._old.close()
            self._old = None

    def _old_spec_ok(self, name: str, shape: Sequence[int] | None = None) -> bool:
        header = self._old_header
        spec = header.specs.get(name) if header is not None else None
        return (
            spec is not None
            and spec.dtype == torch.float32
            and (shape is None or spec.shape == tuple(int(d) for d in shape))
        )

    def previous(self, name: str, shape: Sequence[int]) -> torch.Tensor | None:
        """The previous residual of ``name`` (float32, of ``shape``), or None."""
        if self._old is None or self._old_header is None or not self._old_spec_ok(name, shape):
            return None
        try:
            return read_tensor(self._old, self._old_header, self._old_header.specs[name])
        except (BadArtifact, OSError) as exc:
            logger.warning("error-feedback residual of %r unreadable, using none: %s", name, exc)
            return None

    def previous_all(self) -> dict[str, torch.Tensor]:
        specs = self._old_header.specs if self._old_header is not None else {}
        found = {name: self.previous(name, specs[name].shape) for name in sorted(specs)}
        return {name: tensor for name, tensor in found.items() if tensor is not None}

    def begin(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Stage the next residual: ``shapes`` are the keys this round writes, with the previous
        residual's other keys carried over."""
        written = {name: tuple(shape) for name, shape in shapes}
        specs = self._old_header.specs if self._old_header is not None else {}
        carried = {n: s.shape for n, s in specs.items() if n not in written and self._old_spec_ok(n)}
        plan = sorted({**carried, **written}.items())
        self._plan = [name for name, _ in plan]
        self._carried = set(carried)
        self._tmp = temp_path_for(self._path)
        self._out = open(self._tmp, "r+b")  # noqa: SIM115 - closed by commit() or close()
        self._writer = StreamWriter(self._out, [(name, torch.float32, shape) for name, shape in plan])
        self._writer.write_header()

    def put(self, name: str, residual: torch.Tensor) -> None:
        """The next residual of ``name``; keys come in sorted order."""
        self._carry_until(name)
        if self._writer is None or self._done >= len(self._plan) or self._plan[self._done] != name:
            raise ValueError(f"residual of {name!r} is not next in the staged order")
        self._writer.write(tensor_bytes(residual.to(torch.float32).contiguous()))
        self._done += 1

    def _carry_until(self, name: str | None) -> None:
        while self._done < len(self._plan) and self._plan[self._done] != name:
            carried = self._plan[self._done]
            if carried not in self._carried or self._writer is None or self._old_header is None:
                raise ValueError(f"residual of {carried!r} was never written")
            shape = self._old_header.specs[carried].shape
            kept = self.previous(carried, shape)
            self._writer.write(tensor_bytes(kept if kept is not None else torch.zeros(shape)))
            self._done += 1

    def commit(self) -> None:
        """The staged residual replaces the current one (atomically)."""
        if self._out is None or self._tmp is None:
            return
        self._carry_until(None)
        self._out.close()
        self._out = None
        os.replace(self._tmp, self._path)
        self._tmp = None

    def close(self) -> None:
        for file in (self._out, self._old):
            if file is not None:
                file.close()
        self._out = self._old = None
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            self._tmp = None


class SyncFeedback:
    """Sync deltas of one dtype over a session's rounds, with error feedback when quantised.

    ``build(base, new)`` is ``make_sync_delta(base, new + residual, dtype)``; the residual
    becomes ``(new + residual) - result`` (float32, floating keys). A float dtype keeps no
    residual. ``residual`` is the orchestrator's to checkpoint (``orchestrator.checkpoint``
    saves it with each round, so a resumed session carries it on).
    """

    def __init__(self, dtype: DeltaFormat | str = "float16", *, enabled: bool = True) -> None:
        self.dtype = delta_format(dtype)
        self.enabled = enabled and isinstance(self.dtype, QuantScheme)
        self.residual: dict[str, torch.Tensor] = {}

    def build(
        self,
        base_state: Mapping[str, torch.Tensor],
        new_state: Mapping[str, torch.Tensor],
        *,
        scheme: str = DEFAULT_SCHEME,
        base_hash: str | None = None,
    ) -> SyncDelta:
        if not self.enabled:
            return make_sync_delta(base_state, new_state, self.dtype, scheme=scheme, base_hash=base_hash)
        target = {
            name: value.detach().to("cpu", torch.float32) + self.residual[name]
            if name in self.residual and is_floating(value.dtype)
            else value
            for name, value in new_state.items()
        }
        sync = make_sync_delta(base_state, target, self.dtype, scheme=scheme, base_hash=base_hash)
        self.residual = {
            name: value.to(torch.float32) - sync.result[name]
            for name, value in target.items()
            if is_floating(value.dtype) and is_floating(base_state[name].dtype)
        }
        return sync
