"""A hostile tenant cannot outlive, outgrow or out-talk its round (issue 11, DESIGN §8).

Tenant code shares the sandboxed runner's interpreter, so every attack here works *through*
the runner: it finds the runner's channel in its own process (``gc``) and talks on it, it
switches off the runner's own end-of-round cleanup, it writes frames the runner would never
write. Each test first proves that its attack ran, then that it failed — enforced from
outside the sandbox — and then that the worker serves the next round.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import save_file

from executor import Executor
from executor.results import RoundStatus
from settings import Settings
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(300)]

DISPATCH = 'exec(compile(params["attack"], "<attack>", "exec"))\n'
# Tenant-side: the runner's own channel, and the id of the round now running.
CHANNEL = """
import gc, glob, os
from executor.sandbox._runner import Channel
channel = next(o for o in gc.get_objects() if isinstance(o, Channel))
round_id = os.path.basename(glob.glob('/ro/rounds/*.json')[0])[: -len('.json')]
"""
QUOTA_MB = 64
# The attacks that test_hostile_worker.py replays through a real worker.
FORGED_COMPLETE = (
    CHANNEL
    + """
channel.send({'type': 'complete', 'round': round_id, 'stopped': False, 'error': None,
              'report': {'forged': True}, 'training_time': 0.0, 'result': None})
"""
)
FILL_FOREVER = """
n = 0
while True:  # the old watchdog slept once the round 'ended': 321 MiB into a 64 MiB quota
    with open(f'/task/fill-{n}', 'wb') as f:
        f.write(b'x' * (4 << 20))
    n += 1
"""
# A frame the runner would never send once its round is complete.
LATE_LOG = "channel.send({'type': 'log', 'text': 'still here'})\n"
DAEMON_WITHOUT_CLEANUP = """
import os, time
import executor.sandbox._runner as runner
runner._own_pid_namespace = lambda init: False  # the runner's own kill(-1) of strays: off
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            with open('/task/beat.tmp', 'w') as f:  # whole beats only: a kill lands anywhere
                f.write(repr(time.time()))
            os.replace('/task/beat.tmp', '/task/beat')
            time.sleep(0.05)
    os._exit(0)
os.waitpid(pid, 0)
deadline = time.monotonic() + 30
while not os.path.exists('/task/beat') and time.monotonic() < deadline:
    time.sleep(0.01)
save_report({'beating': os.path.exists('/task/beat')})
"""
SHARED_MEMORY_BOMB = """
import mmap
open('/task/mapped', 'w').write('started')
m = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
for offset in range(0, len(m), 4096):  # RLIMIT_DATA never counted these pages
    m[offset] = 1
save_report({'touched': len(m)})
"""


def _uid() -> int:
    return 63000 + random.randrange(900)  # a uid of this module's own: other tests' sandboxes differ


def _settings(base: Path, host: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "work_dir": str(base / host / "work"),
        "cache_dir": str(base / host / "cache"),
        "host_id": host,
        "sandbox": "bwrap",
        "sandbox_uid": _uid(),
        "sandbox_max_procs": 128,
        "sandbox_memory_mb": 1024,
        "sandbox_disk_mb": QUOTA_MB,
        "sandbox_tmp_mb": 64,
        "sandbox_stop_grace_s": 1.0,
        "round_stats_max_mb": 1,
        "download_backoff_s": 0.01,
        **overrides,
    }
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    base = tmp_path_factory.mktemp("hostile")
    root = base / "srv"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield SimpleNamespace(base=base, server=server, descriptors=shard_descriptors(server, shards))


def _executor(served, host: str, **overrides: object) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    stats: list[dict] = []
    logs: list[str] = []
    settings = _settings(served.base, host, **overrides)
    executor = Executor(stats.append, logs.append, settings=settings, sandboxed=True)
    executor.load(
        served.server.url("model.safetensors"), served.descriptors, DISPATCH, params={"attack": "pass"}
    )
    return SimpleNamespace(executor=executor, stats=stats, logs=logs, settings=settings, served=served)


@pytest.fixture(scope="module")
def world(served):  # type: ignore[no-untyped-def]
    world = _executor(served, "hostile")
    yield world
    world.executor.shutdown()


def attack(world, code: str, **round_args):  # type: ignore[no-untyped-def]
    executor = world.executor
    executor.update_model(
        world.served.server.url("model.safetensors"),
        params={"attack": textwrap.dedent(code)},
        result_hash=executor.session.model_hash,
    )
    return executor.run_round(**{"steps": 1, **round_args})


def healthy(world) -> str:  # type: ignore[no-untyped-def]
    """A normal round completes; returns the runner's identity (pid and start time: the runner
    is pid 2 of every sandbox, so a fresh runner differs by its start time)."""
    code = "save_report({'ok': True, 'runner': open('/proc/self/stat').read().split()[21]})"
    result = attack(world, code, mode="inference")
    assert result.status is RoundStatus.COMPLETED and result.report["ok"], result
    return str(result.report["runner"])


def task_bytes(session_dir: Path) -> int:
    """Disk blocks the tenant's task dir holds under a session dir (what its quota counts)."""
    total = 0
    for root, _dirs, files in os.walk(session_dir / "sandbox" / "task"):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def live_processes(uid: int, at_most: int = 1, within_s: float = 60.0) -> int:
    """Live processes of ``uid`` on the host, once no more than ``at_most`` are left (or, if more
    live on, after ``within_s``). A process killed at the round end has its SIGKILL pending and
    runs nothing more, but leaves the process table only once the kernel schedules it, which on
    a loaded machine can take longer than the supervisor's own wait: poll for what is asked
    instead of guessing how long. A killed child of the frozen runner stays a zombie until the
    runner reaps it: it runs nothing, so it does not count."""
    deadline = time.monotonic() + within_s
    while True:
        out = subprocess.run(["ps", "-o", "stat=", "-u", str(uid)], capture_output=True, text=True).stdout
        live = len([state for state in out.split() if not state.startswith("Z")])
        if live <= at_most or time.monotonic() >= deadline:
            return live
        time.sleep(0.1)


def _task_bytes(world) -> int:  # type: ignore[no-untyped-def]
    return task_bytes(Path(world.executor.work_dir))


def test_a_forged_complete_does_not_let_the_tenant_run_on(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        FORGED_COMPLETE + FILL_FOREVER,
        mode="inference",
    )
    assert result.status is RoundStatus.COMPLETED and result.report == {"forged": True}, result
    # Between rounds the sandbox is frozen: the writer does not write another byte.
    first = _task_bytes(world)
    time.sleep(1.5)
    assert _task_bytes(world) == first
    assert first < QUOTA_MB << 20
    # Thawed for the next round, the writer resumes and the watchdog ends it at the quota;
    # the round after that gets a fresh runner.
    second = attack(world, "save_report({'ok': True})", mode="inference")
    assert second.status is RoundStatus.FAILED and second.error.code == "sandbox_runner_error", second
    assert "quota" in second.error.message
    # The quota is checked every WATCH_POLL_S while a round runs: what a fast writer adds in one
    # interval is the overshoot (a disk writes ~1 GB/s here).
    assert _task_bytes(world) < 10 * (QUOTA_MB << 20)
    healthy(world)


def test_switching_off_the_runners_cleanup_does_not_keep_a_daemon(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        DAEMON_WITHOUT_CLEANUP,
        mode="inference",
    )
    assert result.status is RoundStatus.COMPLETED and result.report == {"beating": True}, result
    live = live_processes(world.settings.sandbox_ids[0])
    assert live <= 1, f"the daemon outlived its round: {live} live processes of the sandbox uid after 60 s"
    later = attack(
        world,
        "import time\ntime.sleep(0.5)\nsave_report({'age': time.time() - float(open('/task/beat').read())})",
        mode="inference",
    )
    assert later.status is RoundStatus.COMPLETED and later.report["age"] > 0.5, later


def test_a_message_after_complete_ends_the_runner_and_fails_the_round(world) -> None:  # type: ignore[no-untyped-def]
    before = healthy(world)
    result = attack(world, FORGED_COMPLETE + LATE_LOG, mode="inference")
    if result.status is RoundStatus.COMPLETED:
        # The sandbox was frozen between its "complete" and its next frame: that frame (and the
        # runner's own "complete" for a round that is over) comes at the thaw and fails the next.
        assert result.report == {"forged": True}, result
        result = attack(world, "save_report({'ok': True})", mode="inference")
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_protocol_error", result
    assert healthy(world) != before  # a fresh runner


@pytest.mark.parametrize("where", ["channel", "result header"])
def test_deeply_nested_json_fails_the_round(world, where: str) -> None:  # type: ignore[no-untyped-def]
    nested = "b'[' * 100_000 + b']' * 100_000"
    code = (
        CHANNEL + f"channel._out.write({nested} + b'\\n'); channel._out.flush()\nimport time; time.sleep(5)\n"
        if where == "channel"
        else f"""
import executor.sandbox._runner as runner
def poisoned(out, state):
    import struct  # the round's namespace is cleared before the runner writes the result
    header = {nested}
    out.write(struct.pack('<Q', len(header)) + header)
runner.write_state = poisoned
save_model({{name: value for name, value in load_model(model_path).items()}})
"""
    )
    result = attack(world, code)
    # Not "completed, error None": the parser's RecursionError is a protocol error.
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_protocol_error", result
    healthy(world)


def test_stats_beyond_the_budget_never_reach_the_worker(world) -> None:  # type: ignore[no-untyped-def]
    world.stats.clear()
    result = attack(
        world,
        CHANNEL
        + """
for _ in range(300):  # 264 MiB of stats once went to Redis: emit_stats' cap is the tenant's
    channel.send({'type': 'stats', 'data': {'blob': 'x' * 900_000}})
for step in range(10_000):
    channel.send({'type': 'stats', 'data': {'step': step, 'pad': 'y' * 1000}})
save_report({'sent': True})
""",
        mode="inference",
    )
    assert result.status is RoundStatus.COMPLETED and result.report == {"sent": True}, result
    passed = sum(len(json.dumps(event, separators=(",", ":"))) for event in world.stats)
    assert passed <= world.settings.round_stats_max_mb << 20
    assert result.dropped["stats"] >= 300 and "dropped" in result.to_json()
    assert any(line.startswith("[budget]") for line in world.logs)
    healthy(world)


def test_shared_memory_counts_against_the_sandbox_limit(world) -> None:  # type: ignore[no-untyped-def]
    if world.executor.status()["sandbox"]["confinement"] == "pidns":
        pytest.skip("no writable cgroup here: shared memory is bounded only by the host")
    result = attack(
        world,
        SHARED_MEMORY_BOMB,
        mode="inference",
    )
    assert (Path(world.executor.work_dir) / "sandbox" / "task" / "mapped").exists() or result.error
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_runner_error", result
    healthy(world)


def test_two_workers_tenants_do_not_share_a_process_limit(served) -> None:  # type: ignore[no-untyped-def]
    # One uid per worker: a tenant that forks up to its limit on GPU 0 leaves GPU 1 alone.
    first = _executor(served, "gpu-host-a", sandbox_uid=None, gpu=0, sandbox_uid_base=62000)
    try:
        assert first.settings.sandbox_ids[0] == 62000
        hog = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError:
    open('/task/full', 'w').write(str(children))
time.sleep(60)
"""
        first.executor.update_model(
            served.server.url("model.safetensors"),
            params={"attack": hog},
            result_hash=first.executor.session.model_hash,
        )
        first.executor.run(steps=1, mode="inference")
        full = Path(first.executor.work_dir) / "sandbox" / "task" / "full"
        deadline = time.monotonic() + 60
        while not full.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert full.exists(), "the first tenant never filled its process limit"
        second = _executor(served, "gpu-host-b", sandbox_uid=None, gpu=1, sandbox_uid_base=62000)
        try:
            assert second.settings.sandbox_ids[0] == 62001
            assert healthy(second)
        finally:
            second.executor.shutdown()
        stopper = threading.Thread(target=first.executor.stop)
        stopper.start()
        stopper.join(60)
    finally:
        first.executor.shutdown()


def test_auto_never_picks_the_weaker_unshare(tmp_path: Path) -> None:
    # A PATH with unshare and setpriv but no bwrap: auto refuses instead of falling back.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("unshare", "setpriv", "prlimit", "env", "true", "sh"):
        found = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    code = (
        "from executor.sandbox import resolve_mode\n"
        "try:\n    print(resolve_mode('auto', 63999))\n"
        "except Exception as exc:\n    print(type(exc).__name__)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PATH": str(bin_dir), "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        cwd=repo,
    )
    assert out.stdout.strip() == "SandboxUnavailable", out.stdout + out.stderr


def test_the_chosen_launch_is_probed_as_it_will_run(served, tmp_path: Path) -> None:
    # The sandbox uid cannot read the code it would run (a 0700 checkout): the worker refuses
    # at once with the reason, instead of failing every round with "Permission denied".
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    repo = Path(__file__).resolve().parents[2]
    for name in ("executor", "settings"):
        subprocess.run(["cp", "-r", str(repo / name), str(private / name)], check=True)
    code = textwrap.dedent(
        f"""
        from executor import Executor
        from settings import Settings
        settings = Settings(work_dir={str(tmp_path / "w")!r}, cache_dir={str(tmp_path / "c")!r},
                            host_id='probe', sandbox='unshare', sandbox_uid=63998)
        try:
            Executor(lambda s: None, lambda l: None, settings=settings, sandboxed=True)
            print('accepted')
        except Exception as exc:
            print(type(exc).__name__, exc.code, exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(private)},
        capture_output=True,
        text=True,
        cwd=private,
        timeout=120,
    )
    assert out.stdout.startswith("SandboxUnavailable sandbox_runner_error"), out.stdout + out.stderr
    assert "unshare" in out.stdout


def test_status_says_what_confines_the_sandbox(world) -> None:  # type: ignore[no-untyped-def]
    sandbox = world.executor.status()["sandbox"]
    assert sandbox["mode"] == "bwrap" and sandbox["uid"] == world.settings.sandbox_ids[0]
    assert sandbox["confinement"] in ("cgroup2", "cgroup1", "pidns"), sandbox
    if os.environ.get("CI") == "true":  # CI machines have the v1 controllers
        assert sandbox["confinement"].startswith("cgroup"), sandbox


def test_through_a_real_worker_a_tenant_cannot_flood_redis_or_outlive_its_round(
    served, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # The same attacks through `celery worker` (prefork) and Redis, as an orchestrator sees them.
    import redis

    from tasks.client import RoundClient
    from tasks.names import stream_name
    from tests.support.redis_server import RedisServer
    from tests.support.worker import WorkerProcess

    server = RedisServer(tmp_path / "redis").start()
    uid = _uid()
    worker = WorkerProcess(
        "hostile-w",
        server.url,
        tmp_path / "w",
        env={"ROUNDHOUSE_SANDBOX": "bwrap", "ROUNDHOUSE_SANDBOX_UID": str(uid),
             "ROUNDHOUSE_SANDBOX_DISK_MB": str(QUOTA_MB), "ROUNDHOUSE_ROUND_STATS_MAX_MB": "1"},
    )  # fmt: skip
    try:
        worker.start()
        client = RoundClient(Settings(broker_url=server.url))
        # A daemon forked (and beating) before the forged "complete", so that one surely lives
        # when the round ends, and another forked in the gap after it.
        flood = CHANNEL + (
            "import os, time\n"
            "def daemon():\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()\n"
            "        while True:\n"
            "            open('/task/beat', 'w').write(repr(time.time())); time.sleep(0.05)\n"
            "daemon()\n"
            "deadline = time.monotonic() + 30\n"
            "while not os.path.exists('/task/beat') and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "for _ in range(300):\n"
            "    channel.send({'type': 'stats', 'data': {'blob': 'x' * 900_000}})\n"
            "channel.send({'type': 'complete', 'round': round_id, 'stopped': False, 'error': None,\n"
            "              'report': {'forged': os.path.exists('/task/beat')}, 'training_time': 0.0,\n"
            "              'result': None})\n"
            "daemon()\n"
            "while True:\n"
            "    time.sleep(0.01)\n"
        )
        model_url = served.server.url("model.safetensors")
        client.load_model("hostile-w", model_url, served.descriptors, flood).get(timeout=120)
        result = client.run_round("hostile-w", steps=1, mode="inference").get(timeout=120)
        assert result["report"] == {"forged": True} and result["dropped"]["stats"] == 300, result
        stream_bytes = sum(
            len(fields[b"msg"])
            for _id, fields in redis.Redis.from_url(server.url).xrange(stream_name("hostile-w"))
        )
        assert stream_bytes < 2 << 20, f"{stream_bytes} bytes of events reached Redis"
        live = live_processes(uid)
        assert live <= 1, (
            f"the tenant's daemon outlived its round: {live} live processes of its uid after 60 s"
        )
        status = client.status("hostile-w").get(timeout=30)
        assert status["state"] == "loaded" and status["sandbox"]["uid"] == uid, status
    finally:
        worker.stop()
        server.stop()
