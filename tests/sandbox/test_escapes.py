"""The escape suite: each attack runs as tenant code in the real sandbox and must fail.

A canary secret sits in the worker's environment and in a world-readable file of the
host; the worker (this test process, which owns the Executor) must keep serving rounds
after every attack. Needs bubblewrap (``make test`` installs it where it can).
"""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from executor import Executor
from executor.delta import read_delta
from executor.results import RoundStatus
from executor.sandbox import bwrap_works
from settings import Settings
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import RedisServer

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to a dedicated uid: run as root"),
    pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is not installed"),
    pytest.mark.timeout(300),
]

CANARY = "canary-" + uuid.uuid4().hex
DISPATCH = 'exec(compile(params["attack"], "<attack>", "exec"))\n'


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("sandbox")
    os.environ["ROUNDHOUSE_TEST_CANARY"] = CANARY
    canary_file = base / "canary.txt"
    canary_file.write_text(CANARY)
    canary_file.chmod(0o644)
    root = base / "srv"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    settings = Settings(
        work_dir=str(base / "work"),
        cache_dir=str(base / "cache"),
        host_id="sandbox-test",
        sandbox="bwrap",
        sandbox_max_procs=256,
        sandbox_memory_mb=3072,
        sandbox_disk_mb=256,
        sandbox_tmp_mb=64,
        sandbox_stop_grace_s=1.0,
        download_backoff_s=0.01,
    )
    with FaultServer(root) as server:
        descriptors = shard_descriptors(server, shards)
        executor = Executor(lambda _s: None, lambda _l: None, settings=settings, sandboxed=True)
        executor.load(server.url("model.safetensors"), descriptors, DISPATCH, params={"attack": "pass"})
        yield SimpleNamespace(
            executor=executor, server=server, base=base, canary=canary_file, descriptors=descriptors
        )
        executor.shutdown()
    os.environ.pop("ROUNDHOUSE_TEST_CANARY", None)


def attack(world, code: str, **round_args):  # type: ignore[no-untyped-def]
    session = world.executor.session
    world.executor.update_model(
        world.server.url("model.safetensors"),
        params={"attack": textwrap.dedent(code)},
        result_hash=session.model_hash,
    )
    return world.executor.run_round(**{"steps": 1, **round_args})


def healthy(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(world, "save_report({'ok': True, 'pid': __import__('os').getpid()})")
    assert result.status is RoundStatus.COMPLETED and result.report["ok"], result


def test_environment_of_the_worker_is_not_visible(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import os
        def read(path):
            try:
                return open(path, 'rb').read().decode(errors='replace')
            except OSError as exc:
                return 'denied: ' + type(exc).__name__
        save_report({
            'environ': dict(os.environ),
            'pid1': read('/proc/1/environ'),
            'parent': read(f'/proc/{os.getppid()}/environ'),
            'self': read('/proc/self/environ'),
            'cmdline1': read('/proc/1/cmdline'),
        })
        """,
    )
    report = result.report
    assert CANARY not in str(report)
    assert not any(key.startswith("ROUNDHOUSE_") for key in report["environ"])
    # bwrap's own command line holds no host path: its options came through a pipe.
    assert str(world.base) not in report["cmdline1"] and "/work" not in report["cmdline1"]
    healthy(world)


def test_no_inherited_descriptor_reaches_the_worker(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import os
        links = {}
        for fd in range(3, 1024):
            try:
                links[fd] = os.readlink(f'/proc/self/fd/{fd}')
            except OSError:
                pass
        save_report({'fds': links})
        """,
    )
    fds = result.report["fds"]
    assert not [link for link in fds.values() if link.startswith("socket:")], fds
    assert all(
        link.startswith(("pipe:", "/dev/null", "anon_inode:", "/ro/", "/model/", "/task/"))
        for link in fds.values()
    ), fds
    healthy(world)


def test_network_is_loopback_only(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    redis_server = RedisServer(tmp_path / "redis").start()  # the worker's own kind of neighbour
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    abstract_name = "\0roundhouse-test-" + uuid.uuid4().hex
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(abstract_name)
    abstract.listen()
    tcp_port, udp_port = listener.getsockname()[1], udp.getsockname()[1]
    result = attack(
        world,
        f"""
        import socket
        out = {{}}
        def tcp(host, port):
            s = socket.socket(); s.settimeout(2)
            try:
                s.connect((host, port)); return 'CONNECTED'
            except OSError as exc:
                return type(exc).__name__
        out['host_tcp'] = tcp('127.0.0.1', {tcp_port})
        out['redis'] = tcp('127.0.0.1', {redis_server.port})
        out['outside_tcp'] = tcp('1.1.1.1', 80)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.sendto(b'escape', ('127.0.0.1', {udp_port}))
        try:
            u.sendto(b'escape', ('8.8.8.8', 53)); out['outside_udp'] = 'SENT'
        except OSError as exc:
            out['outside_udp'] = type(exc).__name__
        a = socket.socket(socket.AF_UNIX)
        try:
            a.connect({abstract_name!r}); out['abstract'] = 'CONNECTED'
        except OSError as exc:
            out['abstract'] = type(exc).__name__
        save_report(out)
        """,
    )
    report = result.report
    assert report["host_tcp"] == report["redis"] == "ConnectionRefusedError", report
    assert redis_server.client().ping()  # it was there all along
    redis_server.stop()
    assert report["outside_tcp"] != "CONNECTED" and report["outside_udp"] != "SENT", report
    assert report["abstract"] == "ConnectionRefusedError", report
    with pytest.raises(TimeoutError):
        udp.recvfrom(64)  # nothing reached the host's UDP socket
    listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        listener.accept()
    for sock in (listener, udp, abstract):
        sock.close()
    healthy(world)


def test_writes_outside_the_task_dir_fail(world) -> None:  # type: ignore[no-untyped-def]
    marker = "escape-" + uuid.uuid4().hex
    result = attack(
        world,
        f"""
        import os
        out = {{}}
        for path in ['/{marker}', '/opt/site-packages/{marker}.py', '/opt/roundhouse/executor/{marker}.py',
                     '/model/{marker}', '/ro/{marker}', '/usr/{marker}', '/etc/{marker}', '/root/{marker}']:
            try:
                open(path, 'w').write('x'); out[path] = 'WRITTEN'
            except OSError as exc:
                out[path] = type(exc).__name__
        open('/tmp/{marker}', 'w').write('private tmp')
        open(os.path.join(os.environ['HOME'], '{marker}'), 'w').write('home is in the task dir')
        out['home'] = os.environ['HOME']
        out['canary'] = 'READ' if os.path.exists({str(world.canary)!r}) else 'absent'
        save_report(out)
        """,
    )
    report = result.report
    assert not [path for path, outcome in report.items() if outcome == "WRITTEN"], report
    assert report["home"].startswith("/task") and report["canary"] == "absent"
    assert not Path(f"/tmp/{marker}").exists(), "the sandbox's /tmp is the host's"
    site = Path(torch.__file__).parents[1]
    assert not (site / f"{marker}.py").exists()
    healthy(world)


@pytest.mark.parametrize(
    "swap",
    [
        "os.symlink('/etc/passwd', p)",
        "os.symlink('../../ro/code.py', p)",
        "open('/task/out/other', 'wb').write(data); os.link('/task/out/other', p)",
        "os.mkfifo(p)",
        "os.mkdir(p)",
        # As large as the sandbox's file-size limit lets it be (sparse: no disk used).
        "f = open(p, 'wb'); [f.truncate(n) for n in (255 << 20,)]; f.close()",
    ],
    ids=["absolute-symlink", "relative-symlink", "hardlink", "fifo", "directory", "sparse-huge"],
)
def test_result_file_tricks_are_refused(world, swap: str) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        f"""
        import gc, os
        channel = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')
        original = channel.send
        def send(message, os=os, original=original, channel=channel):  # globals are gone by then
            if message.get('type') == 'complete' and message.get('result'):
                channel.send = original  # the runner stays warm: leave the next round alone
                p = '/task/out/' + message['result']
                data = open(p, 'rb').read()
                os.unlink(p)
                {swap}
            return original(message)
        channel.send = send
        save_model(torch.nn.Linear(2, 2))
        """,
    )
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_protocol_error", result
    healthy(world)


def test_a_result_swapped_after_it_was_opened_is_read_through_the_descriptor(world) -> None:  # type: ignore[no-untyped-def]
    executor = world.executor
    result = attack(
        world,
        """
        import gc, os, threading, time
        channel = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')
        original = channel.send
        def swapper(p, os=os, time=time):
            end = time.time() + 1.0
            while time.time() < end:
                try:
                    os.replace('/task/evil', p)
                except OSError:
                    pass
                try:
                    os.symlink('/etc/passwd', '/task/evil')
                except OSError:
                    pass
        def send(message, threading=threading, swapper=swapper, original=original, channel=channel):
            if message.get('type') == 'complete' and message.get('result'):
                channel.send = original
                threading.Thread(target=swapper, args=('/task/out/' + message['result'],)).start()
            return original(message)
        channel.send = send
        state = load_model(model_path)
        save_model({k: v + 1 for k, v in state.items()})
        """,
    )
    # Either the parent opened the real file first (a correct delta of +1 everywhere), or the
    # swap won and the result was refused; never anything else.
    if result.status is RoundStatus.COMPLETED:
        delta = read_delta(result.delta.path)
        assert all(torch.all(t.float() == 1) for t in delta.values())
    else:
        assert result.error.code == "sandbox_protocol_error", result
    assert executor.state.value == "loaded"
    healthy(world)


def test_fork_bomb_is_contained(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import os
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    import time
                    time.sleep(60)
                    os._exit(0)
                children += 1
        except OSError as exc:
            save_report({'children': children, 'error': type(exc).__name__})
        """,
    )
    assert result.status is RoundStatus.COMPLETED and result.report["children"] < 256, result
    assert _sandbox_processes() <= 1, "the bomb's processes outlived the round"
    healthy(world)


def test_memory_bomb_is_contained(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(world, "hog = bytearray(64 * 1024 ** 3)")
    assert result.status is RoundStatus.FAILED
    assert result.error.code in ("user_code_error", "gpu_oom"), result
    assert "MemoryError" in result.error.message or result.error.code == "gpu_oom"
    healthy(world)


def test_open_files_are_bounded(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        files = []
        try:
            while True:
                files.append(open('/dev/null'))
        except OSError as exc:
            save_report({'opened': len(files), 'error': type(exc).__name__})
        """,
    )
    assert result.report["error"] == "OSError" and result.report["opened"] < 4096, result.report
    healthy(world)


def test_wall_time_ends_a_round(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = world.executor.settings.model_copy(
        update={"work_dir": str(tmp_path / "w"), "sandbox_wall_time_s": 2.0}
    )
    timed = Executor(lambda _s: None, lambda _l: None, settings=settings, sandboxed=True)
    timed.load(world.server.url("model.safetensors"), world.descriptors, "import time\ntime.sleep(600)")
    result = timed.run_round(steps=1)
    timed.shutdown()
    assert result.status is RoundStatus.FAILED and "wall time" in result.error.message, result


def test_disk_fill_is_stopped(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import os
        block = b'x' * (8 << 20)
        for i in range(10_000):
            with open(f'/task/fill-{i}', 'wb') as f:
                for _ in range(16):
                    f.write(block)
        """,
    )
    assert result.status is RoundStatus.FAILED, result
    assert result.error.code in ("sandbox_runner_error", "user_code_error"), result
    assert "quota" in result.error.message or "File too large" in result.error.message, result
    healthy(world)
    task = Path(world.executor.work_dir) / "sandbox" / "task"
    assert sum(p.stat().st_size for p in task.rglob("fill-*")) == 0, (
        "the next runner starts on a clean task dir"
    )


@pytest.mark.parametrize(
    "frame",
    ["b'x' * (2 << 20)", "b'this is not json\\n'", "b'[1, 2, 3]\\n'", 'b\'{"type": "launch-missiles"}\\n\''],
    ids=["2MiB-no-newline", "junk", "not-an-object", "unknown-type"],
)
def test_oversized_and_junk_frames_end_the_round_not_the_worker(world, frame: str) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        f"""
        import gc
        channel = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')
        channel._out.write({frame})
        channel._out.flush()
        import time
        time.sleep(5)
        """,
    )
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_protocol_error", result
    healthy(world)


def test_a_detached_daemon_does_not_outlive_its_round(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import os, signal, time
        if os.fork() == 0:
            os.setsid()
            if os.fork():
                os._exit(0)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            n = 0
            while True:
                n += 1
                with open('/task/daemon-alive', 'w') as f:
                    f.write(str(n))
                time.sleep(0.05)
        time.sleep(0.5)
        save_report({'started': os.path.exists('/task/daemon-alive')})
        """,
    )
    assert result.report == {"started": True}
    check = attack(
        world,
        """
        import time
        first = open('/task/daemon-alive').read()
        time.sleep(0.5)
        save_report({'changed': open('/task/daemon-alive').read() != first})
        """,
    )
    assert check.report == {"changed": False}, "the daemon survived its round"
    assert _sandbox_processes() <= 1


def test_the_parent_cannot_be_traced_or_killed(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import ctypes, os, signal
        out = {'ppid': os.getppid()}
        for pid in (os.getppid(), 1):
            try:
                os.kill(pid, signal.SIGKILL); out[f'kill{pid}'] = 'KILLED'
            except OSError as exc:
                out[f'kill{pid}'] = type(exc).__name__
        libc = ctypes.CDLL(None, use_errno=True)
        out['ptrace'] = libc.ptrace(16, os.getppid(), 0, 0)  # PTRACE_ATTACH
        out['visible'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        save_report(out)
        """,
    )
    report = result.report
    assert report["kill1"] == "PermissionError" and report[f"kill{report['ppid']}"] == "PermissionError", (
        report
    )
    assert report["ptrace"] == -1
    assert os.getpid() not in report["visible"] or len(report["visible"]) <= 3, report
    healthy(world)


def test_another_tenants_cache_entry_is_unreachable(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    executor = world.executor
    other = Path(executor.cache.root) / "tenants" / "other-tenant"
    other.mkdir(parents=True, exist_ok=True)
    (other / "secret.bin").write_bytes(CANARY.encode())
    (other / "secret.bin").chmod(0o644)
    result = attack(
        world,
        f"""
        import os
        out = {{'shards': os.listdir('/ro/shards')}}
        for path in [{str(other / "secret.bin")!r}, '/ro/../' + {str(other)!r}]:
            try:
                out[path] = open(path).read()
            except OSError as exc:
                out[path] = type(exc).__name__
        save_report(out)
        """,
    )
    assert CANARY not in str(result.report), result.report
    healthy(world)


def test_nested_user_namespaces_are_refused(world) -> None:  # type: ignore[no-untyped-def]
    result = attack(
        world,
        """
        import ctypes, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        out = {'unshare_call': libc.unshare(0x10000000), 'errno': ctypes.get_errno()}
        out['unshare_cli'] = subprocess.run(['unshare', '-U', 'true'], capture_output=True).returncode
        save_report(out)
        """,
    )
    assert result.report["unshare_call"] == -1 and result.report["unshare_cli"] != 0, result.report
    healthy(world)


def test_a_loop_that_ignores_stop_is_killed_after_the_grace(world) -> None:  # type: ignore[no-untyped-def]
    import threading

    executor, server = world.executor, world.server
    session = executor.session
    code = """
    while True:
        try:
            while True:
                pass
        except BaseException:
            pass
    """
    executor.update_model(
        server.url("model.safetensors"),
        params={"attack": textwrap.dedent(code)},
        result_hash=session.model_hash,
    )
    executor.run(steps=1)
    time.sleep(1.0)
    started = time.monotonic()
    threading.Thread(target=executor.stop).start()
    assert executor.wait(30), "the round did not end"
    latency = time.monotonic() - started
    result = executor.finish_round()
    print(f"stop of a stop-ignoring loop: {latency * 1000:.0f} ms (grace 1 s)")
    assert result.status is RoundStatus.STOPPED, result
    assert latency < 10
    healthy(world)


def test_sandboxed_and_in_thread_training_agree(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    executor, server = world.executor, world.server
    code = "torch.manual_seed(0)\ntorch.set_num_threads(1)\n" + TRAIN_CODE
    sandboxed = attack(world, code, steps=4)
    in_thread = Executor(
        lambda _s: None,
        lambda _l: None,
        settings=executor.settings.model_copy(update={"work_dir": str(tmp_path / "w"), "sandbox": "off"}),
    )
    in_thread.load(
        server.url("model.safetensors"), world.descriptors, DISPATCH,
        params={"attack": code},
    )  # fmt: skip
    plain = in_thread.run_round(steps=4)
    in_thread.shutdown()
    assert sandboxed.status is plain.status is RoundStatus.COMPLETED, (sandboxed, plain)
    assert sandboxed.delta.hash == plain.delta.hash
    assert sandboxed.report == plain.report


def _sandbox_processes() -> int:
    """Processes of the sandbox uid on the host (the warm runner counts one)."""
    time.sleep(0.2)
    out = subprocess.run(["pgrep", "-u", "65534"], capture_output=True, text=True).stdout
    return len(out.split())
