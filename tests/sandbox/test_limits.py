"""The fixed limits on what a sandboxed tenant says, and the ``unshare`` launch running tenant code.

- Tenant output (``print`` and stderr, one pipe) reaches the log capped at 1 MiB a round, then
  one ``[runner output truncated]`` (README, "Fixed limits"; ``STDERR_ROUND_BYTES`` in
  ``executor/sandbox/_process.py``); the worker reads it in pieces of at most 16 KiB
  (``STDERR_LINE_CHARS``), so a longer line becomes several log events and a line without
  an end costs the worker no more memory than its cap.
- One ``emit_log`` line is cut at 16 KiB (README; ``MAX_LOG_CHARS`` in the tenant's helper and
  in the worker's round budget, ``LOG_LINE_CHARS`` in the supervisor), also when tenant code
  goes around its helper and writes the frame itself. The worker cuts twice (the supervisor,
  then the budget): the log shows a longer line only when both cuts are gone.
- ``ROUNDHOUSE_SANDBOX=unshare`` (docs/SECURITY.md, "The other modes") loads a model and trains
  a round, confined as documented: network, pid, ipc and uts namespaces, the sandbox uid with
  no capabilities, nothing of the worker's environment, the worker's files guarded by their
  modes, the resource limits, and nothing the round started outlives it.

The limits are written here as the documents give them, not imported: a changed constant must
fail these tests. The stderr and log tests share the package's warm bwrap sandbox (``world``).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from shlex import quote
from typing import Any
from urllib.parse import urlsplit

import pytest

from executor.errors import SandboxUnavailable
from executor.fileio import MIB
from executor.results import RoundStatus
from executor.sandbox._launch import CODE_ROOT, site_dirs, unshare_works
from tests.support.engine import TRAIN_CODE
from tests.support.sandboxed import sandboxed_executor, serving_mlp

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(300)]

OUTPUT_CAP = MIB  # tenant output a round (README)
PIECE = 16 * 1024  # the most of a line one log event carries (README, docs/SECURITY.md)
TRUNCATED = "[runner output truncated]"
LOG_WAIT_S = 60.0  # stderr reaches the log from a thread of its own: waited for, this long at most

# Tenant code ends a round once the worker has read all it wrote to stderr (the pipe's unread
# byte count, FIONREAD, is 0): output the worker read later would count against the next round.
DRAINED = """
import fcntl, os, struct, sys, termios, time

def drained():
    sys.stdout.flush()
    sys.stderr.flush()
    deadline = time.monotonic() + 60
    while struct.unpack("i", fcntl.ioctl(2, termios.FIONREAD, b"    "))[0]:
        assert time.monotonic() < deadline, "the worker stopped reading the runner's stderr"
        time.sleep(0.01)
"""


def _logs_until(world: Any, done: Callable[[list[str]], bool]) -> list[str]:
    """The world's log lines once ``done`` holds for them (stderr is drained by a thread of
    the worker's own, so its lines may still be on their way when the round has returned)."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        logs = list(world.logs)
        if done(logs):
            return logs
        if time.monotonic() > deadline:
            pytest.fail(
                f"the log never got there in {LOG_WAIT_S:.0f} s; it ends {[s[:40] for s in logs[-3:]]}"
            )
        time.sleep(0.05)


def _flood_line(i: int) -> str:
    """Line ``i`` of the flood: 1023 characters, 1 KiB with its newline, numbered."""
    return f"flood-{i:06d}-".ljust(1023, "x")


def test_tenant_output_reaches_the_log_capped_at_1_mib_a_round(world) -> None:  # type: ignore[no-untyped-def]
    # 3 MiB of numbered 1 KiB lines, then a last line: the log gets the first 1 MiB of them,
    # whole and in order, then the marker once, and nothing of the other 2 MiB.
    lines = 3 * MIB // 1024
    flood = DRAINED + f"for i in range({lines}):\n    print(f'flood-{{i:06d}}-'.ljust(1023, 'x'))\n"
    flood += f"print('flood-end')\ndrained()\nsave_report({{'printed': {lines}}})\n"
    result = world.attack(flood)
    assert world.completed(result) == {"printed": lines}  # the flood does not fail the round
    logs = _logs_until(world, lambda logs: TRUNCATED in logs or "flood-end" in logs)
    said = [line for line in logs if line.startswith("flood-") or line == TRUNCATED]
    assert said.count(TRUNCATED) == 1 and said[-1] == TRUNCATED, [line[:20] for line in said[-3:]]
    kept = said[:-1]
    assert kept == [_flood_line(i) for i in range(len(kept))]
    assert OUTPUT_CAP - 1024 <= 1024 * len(kept) <= OUTPUT_CAP, len(kept)

    # The cap is the round's: the next round's output reaches the log again, and none of the
    # last round's (the stream is read in order, so all of it was read before this line).
    result = world.attack(DRAINED + "print('after-the-flood')\ndrained()\nsave_report({})\n")
    assert world.completed(result) == {}
    logs = _logs_until(world, lambda logs: "after-the-flood" in logs)
    assert not [line for line in logs if line.startswith("flood-") or line == TRUNCATED], logs[:3]


def test_a_printed_line_longer_than_16_kib_reaches_the_log_in_pieces_of_16_kib(world) -> None:  # type: ignore[no-untyped-def]
    # Every piece distinct from its neighbours (the alphabet over 100 KiB), between two markers.
    code = DRAINED + (
        "line = ''.join(chr(97 + i % 26) for i in range(100 * 1024))\n"
        "print('<<<')\nprint(line)\nprint('>>>')\ndrained()\nsave_report({'length': len(line)})\n"
    )
    result = world.attack(code)
    assert world.completed(result) == {"length": 100 * 1024}
    logs = _logs_until(world, lambda logs: ">>>" in logs)
    pieces = logs[logs.index("<<<") + 1 : logs.index(">>>")]
    assert [len(piece) for piece in pieces] == [PIECE] * 6 + [100 * 1024 - 6 * PIECE]
    assert "".join(pieces) == "".join(chr(97 + i % 26) for i in range(100 * 1024))  # nothing lost
    assert TRUNCATED not in logs  # 100 KiB is within the round's 1 MiB


def test_a_32_mib_line_on_stderr_costs_the_worker_little_memory(world) -> None:  # type: ignore[no-untyped-def]
    # One line of 32 MiB: read whole, it would cost the worker three times that (its read
    # buffer, the bytes, their text); read in 16 KiB pieces, the worker's Python heap holds
    # about what it logs (the 1 MiB cap, kept here by the test's log list) and the rest passes
    # through. The bound leaves room for the worker's own downloads beside the round (a shard
    # fetched ahead takes 4 MiB of transfer buffers).
    world.arm(
        DRAINED
        + "chunk = memoryview(b'z' * 65536)\n"
        + "for _ in range(512):\n"
        + "    done = 0\n"
        + "    while done < len(chunk):\n"
        + "        done += os.write(2, chunk[done:])\n"
        + "os.write(2, b'\\n')\ndrained()\nsave_report({'wrote': 512 * 65536})\n"
    )
    tracemalloc.start()
    try:
        result = world.executor.run_round(steps=1)
        logs = _logs_until(world, lambda logs: TRUNCATED in logs)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert world.completed(result) == {"wrote": 32 * MIB}
    assert peak < 8 * MIB, f"the worker's Python heap grew by {peak / MIB:.1f} MiB for a 32 MiB line"
    pieces = [line for line in logs if line.startswith("z")]
    assert pieces and all(len(piece) <= PIECE for piece in pieces), {len(piece) for piece in pieces}
    assert sum(len(piece) for piece in pieces) <= OUTPUT_CAP


def test_an_emit_log_line_is_cut_at_16_kib_even_when_the_tenant_goes_around_its_helper(world) -> None:  # type: ignore[no-untyped-def]
    # The helper cuts in the tenant's interpreter, where tenant code can skip it: the second
    # line is the whole 100 KiB, sent as a frame by the runner's own channel.
    result = world.attack(
        """
        import gc
        line = ''.join(chr(97 + i % 26) for i in range(100 * 1024))
        emit_log('helper:' + line)
        channel = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')
        channel.send({'type': 'log', 'text': 'frame:' + line})
        save_report({'sent': len(line)})
        """
    )
    assert world.completed(result) == {"sent": 100 * 1024}
    line = "".join(chr(97 + i % 26) for i in range(100 * 1024))
    said = [text for text in world.logs if text.startswith(("helper:", "frame:"))]
    assert said == [("helper:" + line)[:PIECE], ("frame:" + line)[:PIECE]], [len(text) for text in said]


# ---------------------------------------------------------------- the unshare launch

UNSHARE_UIDS = range(67400, 67490)  # this module's own: no other test's sandbox runs as these

# The probe, run after the training round (its ``loss`` is the round's): what the tenant can
# reach, each attempt said as the errno it failed with, or as what it got.
PROBE = """
import errno, os, resource, socket, subprocess

def attempt(action):
    try:
        got = action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, repr(exc))
    return 'got ' + repr(got)[:200]

def status(field):
    return next(line.split()[1] for line in open('/proc/self/status') if line.startswith(field + ':'))

def connect():
    with socket.create_connection(('127.0.0.1', params['port']), timeout=5):
        return 'connected'

worker = params['worker']
stray = subprocess.Popen(['sleep', '600'], start_new_session=True)  # must not outlive the round
seen = {
    'ids': [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()],
    'caps': [status(name) for name in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')],
    'no_new_privs': status('NoNewPrivs'),
    'ns': {name: os.readlink(f'/proc/self/ns/{name}') for name in worker['ns']},
    'signal_worker': attempt(lambda: os.kill(worker['pid'], 0)),
    'worker_environ': attempt(lambda: open(f"/proc/{worker['pid']}/environ", 'rb').read()),
    'secret_file': attempt(lambda: open(params['secret_file']).read()),
    'cache_dir': attempt(lambda: os.listdir(params['cache_dir'])),
    'host_loopback': attempt(connect),
    'interfaces': [name for _, name in socket.if_nameindex()],
    'environ': dict(os.environ),
    'limits': {name: list(resource.getrlimit(getattr(resource, name)))
               for name in ('RLIMIT_NPROC', 'RLIMIT_NOFILE', 'RLIMIT_DATA', 'RLIMIT_FSIZE', 'RLIMIT_CORE')},
}
save_report({'final_loss': loss.item(), 'steps': steps, 'seen': seen})
"""

# The worker: a sandboxed executor in a process of its own (run where the sandbox uid can reach
# its interpreter: see the test), which prints what the round gave and what the host saw after it.
WORKER = """
import json, os, subprocess, sys, time
from pathlib import Path
from tests.support.sandboxed import sandboxed_executor

args = json.loads(sys.argv[1])
uid = args['uid']
# A work dir under a directory the sandbox uid cannot cross: refused by the probe, at once.
closed = Path(args['base']) / 'closed'
closed.mkdir(mode=0o700)
try:
    sandboxed_executor(closed / 'work', 'unshare-closed', range(uid, uid + 1), sandbox='unshare').shutdown()
    refused = None
except Exception as exc:
    refused = f'{type(exc).__name__}: {exc}'
executor = sandboxed_executor(Path(args['base']), 'unshare-test', range(uid, uid + 1), sandbox='unshare')
try:
    namespaces = {name: os.readlink(f'/proc/self/ns/{name}') for name in ('net', 'pid', 'ipc', 'uts')}
    worker = {'pid': os.getpid(), 'ns': namespaces}
    params = {**args['params'], 'worker': worker, 'cache_dir': executor.settings.cache_dir}
    executor.load(args['model_url'], args['shards'], args['code'], params=params)
    result = executor.run_round(steps=2, mode='training')
    # What the round started is killed from outside as it ends; a killed process in a frozen
    # group is gone once the kill thaws it, a moment later.
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(['pgrep', '-u', str(uid)], capture_output=True, text=True).stdout
        pids = [int(pid) for pid in out.split()]
        if len(pids) <= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    settings = executor.settings
    print(json.dumps({
        'result': result.to_json(), 'sandbox': executor.status()['sandbox'], 'pids': pids, 'refused': refused,
        'worker': worker, 'limits': [settings.sandbox_max_procs, settings.sandbox_max_open_files,
                                     settings.sandbox_memory_mb],
    }))
finally:
    executor.shutdown()
"""


def _hidden_ways() -> dict[Path, set[str]]:
    """The first directory the sandbox uid may not search on each way to what the unshare launch
    runs (the interpreter as named and as it resolves, its library, the code, the packages), with
    the entries of it on those ways. A fresh uid is in no group: only the others' bits count."""
    needed = {
        Path(sys.executable),
        Path(sys.executable).resolve(),
        Path(sys.base_prefix).resolve(),
        CODE_ROOT,
    }
    needed |= {Path(host) for host, _ in site_dirs()}
    hidden: dict[Path, set[str]] = {}
    for path in needed:
        for parent in reversed(path.parents):  # from / down
            if not parent.stat().st_mode & stat.S_IXOTH:
                hidden.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
                break
    return hidden


def _uncovered(hidden: dict[Path, set[str]], stash: Path) -> list[str]:
    """The command that runs the rest of an argv in a mount namespace of its own where each
    ``hidden`` directory is covered by a tmpfs (mode 0755) holding only its entries on the
    needed ways, bound back from the originals (held at ``stash`` meanwhile); or nothing when
    none is hidden. The host's directories keep their modes, and what else they hold stays out
    of the sandbox uid's reach."""
    if not hidden:
        return []
    script = ["set -e"]
    for number, (directory, entries) in enumerate(sorted(hidden.items())):
        held = {entry: stash / f"{number}-{entry}" for entry in sorted(entries)}
        for entry, place in held.items():
            place.mkdir(parents=True)
            script.append(f"mount --bind {quote(str(directory / entry))} {quote(str(place))}")
        script.append(f"mount -t tmpfs -o mode=0755,size=64k roundhouse-test {quote(str(directory))}")
        for entry, place in held.items():
            inside = quote(str(directory / entry))
            script.append(f"mkdir {inside} && mount --move {quote(str(place))} {inside}")
    script.append('exec "$@"')
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "sh"]


@pytest.fixture()
def open_base() -> Iterator[Path]:
    """A work dir the sandbox uid can reach: the unshare launch has no mount namespace, so the
    runner enters its task dir by the host's path, and pytest's temp root is 0700."""
    base = Path(tempfile.mkdtemp(prefix="roundhouse-unshare-"))
    base.chmod(0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_unshare_launch_trains_a_round_confined_as_documented(open_base: Path) -> None:
    if not unshare_works():
        pytest.skip(
            "the unshare launch cannot run here: it needs root, unshare and setpriv on PATH, and "
            "`unshare --net --pid --fork true` to succeed"
        )
    uid = random.choice(UNSHARE_UIDS)
    hidden = _hidden_ways()
    if hidden:
        # The launch has no mount namespace: the runner is the worker's interpreter at its host
        # path. Under a directory the sandbox uid cannot search (a pyenv Python under /root, mode
        # 0700, as on the development machines) the launch is refused at once, saying why; the
        # worker below then runs where those directories are searchable (_uncovered).
        with pytest.raises(SandboxUnavailable, match="cannot start tenant code here"):
            sandboxed_executor(
                open_base / "refused", "unshare-refused", range(uid, uid + 1), sandbox="unshare"
            )
    secret = "canary-" + uuid.uuid4().hex
    secret_file = open_base / "secret.txt"  # the worker's, mode 0600
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    with serving_mlp(open_base / "srv") as (server, shards):
        args = {
            "base": str(open_base),
            "uid": uid,
            "model_url": server.url("model.safetensors"),
            "shards": shards,
            "code": TRAIN_CODE + PROBE,
            "params": {"port": urlsplit(server.base_url).port, "secret_file": str(secret_file)},
        }
        argv = [*_uncovered(hidden, open_base / "stash"), sys.executable, "-c", WORKER, json.dumps(args)]
        path = os.pathsep.join(filter(None, [str(CODE_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "ROUNDHOUSE_TEST_SECRET": secret, "PYTHONPATH": path}
        done = subprocess.run(argv, env=env, cwd=CODE_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    # It loaded and trained: a completed round with a trained state (its delta) and a loss.
    result = out["result"]
    assert result["status"] == RoundStatus.COMPLETED.value, result
    assert result["delta"] and result["delta"]["bytes"] > 0, result
    report = result["report"]
    assert report["steps"] == 2 and math.isfinite(report["final_loss"]), report
    assert out["sandbox"]["mode"] == "unshare", out["sandbox"]
    assert out["sandbox"]["confinement"].split()[0] in ("cgroup2", "cgroup1", "pidns"), out["sandbox"]

    seen = report["seen"]
    # The sandbox uid, no capabilities, no new privileges.
    assert seen["ids"] == [uid, uid, uid, uid, []], seen["ids"]
    assert seen["caps"] == ["0000000000000000"] * 5 and seen["no_new_privs"] == "1", seen
    # Network, pid, ipc and uts namespaces of its own: the host's loopback (where the model
    # came from) is out of reach, and the worker cannot be signalled.
    worker = out["worker"]
    assert all(seen["ns"][name] != worker["ns"][name] for name in worker["ns"]), (seen["ns"], worker["ns"])
    assert seen["interfaces"] == ["lo"] and not seen["host_loopback"].startswith("got"), seen
    assert seen["signal_worker"] == "ESRCH", seen
    # Nothing of the worker's environment; its files guarded by their modes (the host's /proc
    # is visible in this mode, the worker's environ in it is not readable).
    assert secret not in json.dumps(report)
    assert not [key for key in seen["environ"] if key.startswith("ROUNDHOUSE_")], seen["environ"]
    assert seen["worker_environ"] == seen["secret_file"] == seen["cache_dir"] == "EACCES", seen
    # The resource limits of the settings; no core files; a bounded file size.
    procs, files, memory_mb = out["limits"]
    limits = seen["limits"]
    assert limits["RLIMIT_NPROC"] == [procs, procs] and limits["RLIMIT_NOFILE"] == [files, files], limits
    assert limits["RLIMIT_DATA"] == [memory_mb * MIB] * 2 and limits["RLIMIT_CORE"] == [0, 0], limits
    assert 0 < limits["RLIMIT_FSIZE"][1] < 2**62, limits
    # Nothing the round started outlives it: of the sandbox uid only the warm runner is left.
    assert len(out["pids"]) == 1, out["pids"]
    # The runner enters its task dir by the host's path: a work dir it cannot reach is refused
    # when the executor starts (the probe enters it too), not at every round.
    assert out["refused"] is not None and out["refused"].startswith("SandboxUnavailable"), out["refused"]
    assert "Permission denied" in out["refused"], out["refused"]
