"""``python -m bench.quant [--rounds 8] [--steps 20] [--workers 2] [--mb 64]``: quantised deltas.

DiLoCo training of the same model for the same rounds with trained and sync deltas in
``float16``, ``int8`` and ``int4``, the quantised ones with and without error feedback
(the workers' residual, ``ROUNDHOUSE_QUANT_ERROR_FEEDBACK``, and the orchestrator's,
:class:`executor.delta.SyncFeedback`). Two models: the demo's MLP (``roundhouse demo``'s
model, shards and script) and a tiny GPT-2 built from a config. The engine does the work:
``--workers`` in-thread :class:`executor.Executor` s load from and upload to a real
:class:`orchestrator.artifacts.ArtifactServer` on loopback, and the bench plays the
orchestrator with :mod:`orchestrator.diloco`'s mean and outer optimiser (SGD, Nesterov)
and applies each sync delta on every worker (``update_model``, bit-exact, by delta). The
loss is the bench's own evaluation of the global model after the last round. Bytes are
the zstd delta files: up per worker per round, down per round (each worker fetches it).

Then the quantiser's throughput against the upload's, on a ``--mb`` MB float32 model:
``write_result_delta`` (the round's delta, with error feedback for the quantised ones),
``quantize`` alone, and ``transfer.upload`` of each file to the artifact server.
Prints both tables and writes ``bench/results/quant.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.common import save, scratch
from bench.quant_models import MODELS, BenchModel
from executor import Executor, transfer
from executor.configs import transfer_config
from executor.delta import (
    ErrorFeedback,
    QuantScheme,
    SyncFeedback,
    delta_format,
    max_delta_bytes,
    quantize,
    read_delta,
    write_delta,
    write_result_delta,
)
from executor.results import RoundStatus
from executor.tensorfile import write_state
from orchestrator.artifacts import ArtifactServer
from orchestrator.diloco import OuterOptimizer, mean_delta
from settings import Settings

# (delta dtype, error feedback, block size): the default block (Settings), and int8 with 64.
_BLOCK = int(Settings.model_fields["quant_block_size"].default)
RUNS = (
    ("float16", False, _BLOCK),
    ("int8", True, _BLOCK),
    ("int8", False, _BLOCK),
    ("int4", True, _BLOCK),
    ("int4", False, _BLOCK),
    ("int8", True, 64),
)
LOSS_TOLERANCE = 0.02
BYTES_TARGET = 0.55


@dataclass
class Run:
    model: str
    dtype: str
    feedback: bool
    block: int
    up_bytes: float = 0.0  # per worker per round
    down_bytes: float = 0.0  # per round
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        if self.dtype == "float16":
            return self.dtype
        block = (
            "" if self.block == Settings.model_fields["quant_block_size"].default else f", block {self.block}"
        )
        return f"{self.dtype} {'+ EF' if self.feedback else 'no EF'}{block}"

    @property
    def round_bytes(self) -> float:
        return self.up_bytes + self.down_bytes


def quiet(_value: object) -> None:
    pass


def stored(server: ArtifactServer, name: str) -> str:
    """The local path of ``name`` in the store, its directory made."""
    path = server.path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def train(model: BenchModel, key: str, dtype: str, feedback: bool, block: int, args: argparse.Namespace,
          root: Path, server: ArtifactServer) -> Run:  # fmt: skip
    run = Run(model.name, dtype, feedback, block)
    tag = f"{key}-{dtype}-{'ef' if feedback else 'plain'}-{block}"
    settings = Settings(
        work_dir=str(root / "work"), cache_dir=str(root / "cache"), url_allow=["127.0.0.1"],
        quant_error_feedback=feedback, quant_block_size=block, download_backoff_s=0.05,
    )  # fmt: skip
    save_file(model.state, stored(server, f"{tag}/model-0.safetensors"))
    descriptors = [
        {"url": server.url_get(name), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in model.shards
    ]
    workers = [Executor(quiet, quiet, host_id=f"bench-{i}", settings=settings) for i in range(args.workers)]
    started = time.monotonic()
    try:
        for worker in workers:
            worker.load(
                server.url_get(f"{tag}/model-0.safetensors"), descriptors, model.code,
                batch_size=model.batch_size, params=model.params,
            )  # fmt: skip
        sync_dtype = QuantScheme.named(dtype, block) if dtype != "float16" else dtype
        outer, sync_feedback = OuterOptimizer(), SyncFeedback(sync_dtype, enabled=feedback)
        state = dict(model.state)
        ups: list[int] = []
        downs: list[int] = []
        for round_num in range(args.rounds):
            deltas = []
            for index, worker in enumerate(workers):
                name = f"{tag}/up/round-{round_num}-{index}.zst"
                result = worker.run_round(
                    steps=args.steps, round_num=round_num, total_rounds=args.rounds,
                    step_offset=round_num * args.steps, delta_url=server.url_put(name), delta_dtype=dtype,
                )  # fmt: skip
                if result.status is not RoundStatus.COMPLETED:
                    raise RuntimeError(f"{tag} round {round_num}: {result.error}")
                ups.append(server.path(name).stat().st_size)
                deltas.append(read_delta(str(server.path(name)), max_bytes=max_delta_bytes(state)))
            sync = sync_feedback.build(state, outer.step(state, mean_delta(deltas)))
            down, full = f"{tag}/down/round-{round_num}.zst", f"{tag}/model-{round_num + 1}.safetensors"
            downs.append(write_delta(sync.delta, stored(server, down)).bytes)
            save_file(sync.result, stored(server, full))
            for worker in workers:
                applied = worker.update_model(
                    server.url_get(full), delta_url=server.url_get(down),
                    base_hash=sync.base_hash, result_hash=sync.result_hash,
                )  # fmt: skip
                if applied.via.value != "delta":
                    raise RuntimeError(f"{tag} round {round_num}: sync by {applied.via.value}")
            state = sync.result
            run.losses.append(model.evaluate(state))
    finally:
        for worker in workers:
            worker.shutdown()
    run.up_bytes, run.down_bytes = statistics.mean(ups), statistics.mean(downs)
    run.seconds = time.monotonic() - started
    return run


# ---------------------------------------------------------------- throughput


def throughput(root: Path, megabytes: int, runs: int, server: ArtifactServer) -> list[dict[str, Any]]:
    """Per delta dtype: the round's delta write (MB/s of the model's float32 bytes), quantize
    alone, the file's size and its upload (MB/s of the file's bytes)."""
    tensors = max(1, megabytes // 4)  # 4 MB of float32 each
    g = torch.Generator().manual_seed(0)
    original = {f"layer{i:03d}.weight": torch.randn(1024, 1024, generator=g) for i in range(tensors)}
    trained = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    diffs = {k: trained[k] - v for k, v in original.items()}
    model = root / "throughput.safetensors"
    with open(model, "wb") as file:
        write_state(file, original)
    fp32_bytes = sum(t.numel() * 4 for t in original.values())
    config = transfer_config(Settings(url_allow=["127.0.0.1"]))
    rows = []
    for name in ("float16", "int8", "int4"):
        fmt = delta_format(name)
        out = root / f"throughput-{name}.zst"
        writes, uploads, quants = [], [], []
        for attempt in range(runs):
            feedback = ErrorFeedback(str(root / f"feedback-{name}"))
            Path(feedback.path).parent.mkdir(exist_ok=True)
            started = time.monotonic()
            with feedback.next_round() as residual:
                write_result_delta(str(model), trained, str(out), dtype=fmt,
                                   feedback=residual if isinstance(fmt, QuantScheme) else None)  # fmt: skip
                residual.commit()
            writes.append(time.monotonic() - started)
            started = time.monotonic()
            transfer.upload(str(out), server.url_put(f"throughput/{name}-{attempt}.zst"), config=config)
            uploads.append(time.monotonic() - started)
            if isinstance(fmt, QuantScheme):
                started = time.monotonic()
                for value in diffs.values():
                    quantize(value, fmt)
                quants.append(time.monotonic() - started)
        size = out.stat().st_size
        write_s, upload_s = statistics.median(writes), statistics.median(uploads)
        rows.append({
            "dtype": name, "file_bytes": size, "write_s": write_s, "upload_s": upload_s,
            "write_mb_s": fp32_bytes / write_s / 1e6, "upload_mb_s": size / upload_s / 1e6,
            "quantize_mb_s": fp32_bytes / statistics.median(quants) / 1e6 if quants else None,
            "ship_s": write_s + upload_s, "model_fp32_bytes": fp32_bytes,
        })  # fmt: skip
    return rows


# ---------------------------------------------------------------- report


def training_table(runs: list[Run]) -> list[str]:
    lines = [
        "| model | deltas | bytes up / worker / round | bytes down / round | x float16 bytes "
        "| final loss | vs float16 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        base = next(r for r in runs if r.model == run.model and r.dtype == "float16")
        ratio = run.round_bytes / base.round_bytes
        change = (run.losses[-1] - base.losses[-1]) / base.losses[-1] * 100
        lines.append(
            f"| {run.model} | {run.label} | {run.up_bytes:,.0f} | {run.down_bytes:,.0f} | {ratio:.3f} "
            f"| {run.losses[-1]:.5f} | {change:+.2f} % |"
        )
    return lines


def throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    mb = rows[0]["model_fp32_bytes"] / 1e6
    lines = [
        f"| delta ({mb:.0f} MB fp32 model) | file MB | delta write s (MB/s of fp32) | quantize alone MB/s "
        "| upload s (MB/s of file) | write + upload s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        quant = f"{row['quantize_mb_s']:.0f}" if row["quantize_mb_s"] else "-"
        lines.append(
            f"| {row['dtype']} | {row['file_bytes'] / 1e6:.1f} "
            f"| {row['write_s']:.3f} ({row['write_mb_s']:.0f}) | {quant} "
            f"| {row['upload_s']:.3f} ({row['upload_mb_s']:.0f}) | {row['ship_s']:.3f} |"
        )
    return lines


def verdicts(runs: list[Run]) -> list[str]:
    out = []
    for run in runs:
        if not (run.dtype == "int8" and run.feedback):
            continue
        base = next(r for r in runs if r.model == run.model and r.dtype == "float16")
        loss_ok = run.losses[-1] <= base.losses[-1] * (1 + LOSS_TOLERANCE)
        bytes_ok = run.round_bytes <= BYTES_TARGET * base.round_bytes
        out.append(
            f"{run.model}: {run.label} final loss {run.losses[-1]:.5f} vs float16 {base.losses[-1]:.5f} "
            f"({'within' if loss_ok else 'NOT within'} {LOSS_TOLERANCE:.0%}), bytes "
            f"{run.round_bytes / base.round_bytes:.3f} x ({'<=' if bytes_ok else 'NOT <='} {BYTES_TARGET})"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", default="mlp,gpt2", help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--mb", type=int, default=32, help="model size of the throughput part")
    parser.add_argument("--runs", type=int, default=3, help="runs of the throughput part (median)")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    started = time.monotonic()
    with scratch(args.dir) as root, ArtifactServer(root / "store") as server:
        runs = []
        for key in args.models.split(","):
            model = MODELS[key](root)
            for name, path in model.shards:
                server.publish(name, path)
            for dtype, feedback, block in RUNS:
                runs.append(train(model, key, dtype, feedback, block, args, root / key, server))
                print(f"  {model.name} {runs[-1].label}: {runs[-1].seconds:.1f} s", file=sys.stderr)
        rows = throughput(root, args.mb, args.runs, server)
    print(f"quantised deltas: {args.workers} workers, {args.rounds} rounds of {args.steps} steps, "
          f"bytes are zstd delta files")  # fmt: skip
    print("\n".join(training_table(runs)))
    print()
    print("\n".join(throughput_table(rows)))
    print()
    print("\n".join(verdicts(runs)))
    print(f"({time.monotonic() - started:.0f} s in all)")
    save("quant", {
        "date": time.strftime("%Y-%m-%d"), "args": vars(args), "runs": [asdict(r) for r in runs],
        "throughput": rows, "verdicts": verdicts(runs),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
