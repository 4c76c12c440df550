"""The escape suite: each attack runs as tenant code in the real sandbox and must fail.

A canary secret sits in the worker's environment and in a world-readable file of the
host; the worker (this test process, which owns the Executor) must keep serving rounds
after every attack. Each test first proves its attack ran up to the point of trying — by
its report, or by what the tenant emitted just before — so an attack that crashed early
(a typo, an ImportError) fails the test instead of passing it. Needs root and bubblewrap
(``make test`` installs it where it can; see ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from executor import Executor
from executor.delta import read_delta
from executor.results import RoundStatus
from tests.support.engine import TRAIN_CODE
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(300)]


def test_environment_of_the_worker_is_not_visible(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
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
    report = world.completed(result)
    # It read environments: its own, both ways.
    assert report["environ"]["HOME"].startswith("/task") and "PATH=" in report["self"], report
    assert world.secret not in str(report)
    assert not any(key.startswith("ROUNDHOUSE_") for key in report["environ"])
    # bwrap's own command line holds no host path: its options came through a pipe.
    assert str(world.base) not in report["cmdline1"] and "/work" not in report["cmdline1"]
    world.healthy()


def test_no_inherited_descriptor_reaches_the_worker(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
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
    fds = world.completed(result)["fds"]
    assert any(link.startswith("pipe:") for link in fds.values()), f"the scan missed its own pipes: {fds}"
    assert not [link for link in fds.values() if link.startswith("socket:")], fds
    assert all(
        link.startswith(("pipe:", "/dev/null", "anon_inode:", "/ro/", "/model/", "/task/"))
        for link in fds.values()
    ), fds
    world.healthy()


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
    result = world.attack(
        f"""
        import socket
        out = {{}}
        def tcp(host, port):
            s = socket.socket(); s.settimeout(2)
            try:
                s.connect((host, port)); return 'CONNECTED'
            except OSError as exc:
                return type(exc).__name__
        own = socket.socket(); own.bind(('127.0.0.1', 0)); own.listen()
        out['own_loopback'] = tcp('127.0.0.1', own.getsockname()[1])
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
    report = world.completed(result)
    # Sockets work in the sandbox (its own loopback is up): the refusals below are the namespace's.
    assert report["own_loopback"] == "CONNECTED", report
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
    world.healthy()


def test_writes_outside_the_task_dir_fail(world) -> None:  # type: ignore[no-untyped-def]
    marker = "escape-" + uuid.uuid4().hex
    targets = [
        f"/{marker}",
        f"/opt/site-packages/{marker}.py",
        f"/opt/roundhouse/executor/{marker}.py",
        f"/model/{marker}",
        f"/ro/{marker}",
        f"/usr/{marker}",
        f"/etc/{marker}",
        f"/root/{marker}",
    ]
    result = world.attack(
        f"""
        import os
        out = {{}}
        for path in {targets!r}:
            try:
                open(path, 'w').write('x'); out[path] = 'WRITTEN'
            except OSError as exc:
                out[path] = type(exc).__name__
        open('/tmp/{marker}', 'w').write('private tmp')
        out['tmp'] = open('/tmp/{marker}').read()
        open(os.path.join(os.environ['HOME'], '{marker}'), 'w').write('home is in the task dir')
        out['home'] = os.environ['HOME']
        out['canary'] = 'READ' if os.path.exists({str(world.canary)!r}) else 'absent'
        save_report(out)
        """,
    )
    report = world.completed(result)
    # Every write was tried, and writing works where it may: the refusals are the sandbox's.
    assert all(report[path] for path in targets) and report["tmp"] == "private tmp", report
    assert not [path for path, outcome in report.items() if outcome == "WRITTEN"], report
    assert report["home"].startswith("/task") and report["canary"] == "absent"
    assert not Path(f"/tmp/{marker}").exists(), "the sandbox's /tmp is the host's"
    site = Path(torch.__file__).parents[1]
    assert not (site / f"{marker}.py").exists()
    world.healthy()


def _is(kind: Callable[[int], bool], **fields: int) -> Callable[[dict[str, Any]], bool]:
    return lambda st: kind(st["mode"]) and all(st[key] == value for key, value in fields.items())


@pytest.mark.parametrize(
    ("swap", "swapped"),
    [
        ("os.symlink('/etc/passwd', p)", _is(stat.S_ISLNK)),
        ("os.symlink('../../ro/code.py', p)", _is(stat.S_ISLNK)),
        (
            "open('/task/out/other', 'wb').write(data); os.link('/task/out/other', p)",
            _is(stat.S_ISREG, nlink=2),
        ),
        ("os.mkfifo(p)", _is(stat.S_ISFIFO)),
        ("os.mkdir(p)", _is(stat.S_ISDIR)),
        # As large as the sandbox's file-size limit lets it be (sparse: no disk used).
        (
            "f = open(p, 'wb'); [f.truncate(n) for n in (255 << 20,)]; f.close()",
            _is(stat.S_ISREG, size=255 << 20),
        ),
    ],
    ids=["absolute-symlink", "relative-symlink", "hardlink", "fifo", "directory", "sparse-huge"],
)
def test_result_file_tricks_are_refused(world, swap: str, swapped) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
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
                st = os.lstat(p)
                original({{'type': 'stats', 'data': {{
                    'attempt': 'swap', 'mode': st.st_mode, 'nlink': st.st_nlink, 'size': st.st_size}}}})
            return original(message)
        channel.send = send
        save_model(torch.nn.Linear(2, 2))
        """,
    )
    assert swapped(world.proved("swap")), world.attempts()  # the result's name is the trick now
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_protocol_error", result
    world.healthy()


def test_a_result_swapped_after_it_was_opened_is_read_through_the_descriptor(world) -> None:  # type: ignore[no-untyped-def]
    executor = world.executor
    result = world.attack(
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
                original({'type': 'stats', 'data': {'attempt': 'swap race', 'result': message['result']}})
            return original(message)
        channel.send = send
        state = load_model(model_path)
        save_model({k: v + 1 for k, v in state.items()})
        """,
    )
    assert world.proved("swap race")["result"].startswith("result-")
    # Either the parent opened the real file first (a correct delta of +1 everywhere), or the
    # swap won and the result was refused; never anything else.
    if result.status is RoundStatus.COMPLETED:
        delta = read_delta(result.delta.path)
        assert all(torch.all(t.float() == 1) for t in delta.values())
    else:
        assert result.error.code == "sandbox_protocol_error", result
    assert executor.state.value == "loaded"
    world.healthy()


def test_fork_bomb_is_contained(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
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
    report = world.completed(result)
    # It forked, then hit a limit.
    assert report["children"] > 0 and report["error"] == "BlockingIOError", report
    assert result.status is RoundStatus.COMPLETED and result.report["children"] < 256, result
    runners = world.processes()
    assert len(runners) <= 1, "the bomb's processes outlived the round"
    assert runners, "no process of the sandbox's uid: the count would prove nothing"  # the warm runner
    world.healthy()


def test_memory_bomb_is_contained(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        """
        emit_stats({'attempt': 'allocate', 'bytes': 64 * 1024 ** 3})
        hog = bytearray(64 * 1024 ** 3)
        """
    )
    world.proved("allocate")
    assert result.status is RoundStatus.FAILED
    assert result.error.code in ("user_code_error", "gpu_oom"), result
    assert "MemoryError" in result.error.message or result.error.code == "gpu_oom"
    world.healthy()


def test_open_files_are_bounded(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        """
        files = []
        try:
            while True:
                files.append(open('/dev/null'))
        except OSError as exc:
            save_report({'opened': len(files), 'error': type(exc).__name__})
        """,
    )
    assert world.completed(result)["opened"] > 100, result.report  # it opened files, then hit a limit
    assert result.report["error"] == "OSError" and result.report["opened"] < 4096, result.report
    world.healthy()


def test_wall_time_ends_a_round(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = world.executor.settings.model_copy(
        # A host id of its own: two live sandboxes of one process and host id collide (see
        # test_two_sandboxes_of_one_worker_process_do_not_disturb_each_other).
        update={"work_dir": str(tmp_path / "w"), "sandbox_wall_time_s": 2.0, "host_id": "sandbox-timed"}
    )
    stats: list[dict[str, Any]] = []
    timed = Executor(stats.append, lambda _l: None, settings=settings, sandboxed=True)
    code = "emit_stats({'attempt': 'sleep'})\nimport time\ntime.sleep(600)"
    timed.load(world.server.url("model.safetensors"), world.descriptors, code)
    result = timed.run_round(steps=1)
    timed.shutdown()
    assert any(data.get("attempt") == "sleep" for data in stats), stats
    assert result.status is RoundStatus.FAILED and "wall time" in result.error.message, result


def test_two_sandboxes_of_one_worker_process_do_not_disturb_each_other(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code = f"save_report({{'runner': {world.runner_identity}}})"
    pair, first_runners = [], []
    try:
        for name in ("first", "second"):
            settings = world.settings.model_copy(
                update={"work_dir": str(tmp_path / name), "host_id": "sandbox-pair"}
            )
            executor = Executor(lambda _s: None, lambda _l: None, settings=settings, sandboxed=True)
            pair.append(executor)
            executor.load(world.server.url("model.safetensors"), world.descriptors, code)
            first_runners.append(world.completed(executor.run_round(steps=1))["runner"])
        # Each warm runner served its session's next round too: neither sandbox killed the other's.
        again = [world.completed(executor.run_round(steps=1))["runner"] for executor in pair]
        assert again == first_runners, (first_runners, again)
    finally:
        for executor in pair:
            with contextlib.suppress(Exception):  # what a collision leaves may not close cleanly
                executor.shutdown()


def test_disk_fill_is_stopped(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        """
        import os
        block = b'x' * (8 << 20)
        emit_stats({'attempt': 'fill', 'block': len(block)})
        for i in range(10_000):
            with open(f'/task/fill-{i}', 'wb') as f:
                for _ in range(16):
                    f.write(block)
        """,
    )
    world.proved("fill")
    assert result.status is RoundStatus.FAILED, result
    assert result.error.code in ("sandbox_runner_error", "user_code_error"), result
    assert "quota" in result.error.message or "File too large" in result.error.message, result
    world.healthy()
    assert sum(p.stat().st_size for p in world.task_dir.rglob("fill-*")) == 0, (
        "the next runner starts on a clean task dir"
    )


@pytest.mark.parametrize(
    "frame",
    ["b'x' * (2 << 20)", "b'this is not json\\n'", "b'[1, 2, 3]\\n'", 'b\'{"type": "launch-missiles"}\\n\''],
    ids=["2MiB-no-newline", "junk", "not-an-object", "unknown-type"],
)
def test_oversized_and_junk_frames_end_the_round_not_the_worker(world, frame: str) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        f"""
        import gc
        channel = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')
        frame = {frame}
        emit_stats({{'attempt': 'frame', 'bytes': len(frame)}})
        channel._out.write(frame)
        channel._out.flush()
        import time
        time.sleep(5)
        """,
    )
    world.proved("frame")
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_protocol_error", result
    world.healthy()


def test_a_detached_daemon_does_not_outlive_its_round(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
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
        deadline = time.monotonic() + 30
        while not os.path.exists('/task/daemon-alive') and time.monotonic() < deadline:
            time.sleep(0.01)
        save_report({'started': os.path.exists('/task/daemon-alive')})
        """,
    )
    assert result.report == {"started": True}  # the daemon ran (and wrote) during its round
    check = world.attack(
        """
        import time
        first = open('/task/daemon-alive').read()
        time.sleep(2.0)  # a live daemon would have written ~40 times by now
        save_report({'changed': open('/task/daemon-alive').read() != first})
        """,
    )
    assert check.report == {"changed": False}, "the daemon survived its round"
    runners = world.processes()
    assert len(runners) <= 1
    assert runners, "no process of the sandbox's uid: the count would prove nothing"  # the warm runner


def test_the_parent_cannot_be_traced_or_killed(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        """
        import ctypes, os, signal
        out = {'ppid': os.getppid(), 'self': os.getpid()}
        for pid in (os.getppid(), 1):
            try:
                os.kill(pid, signal.SIGKILL); out[f'kill{pid}'] = 'KILLED'
            except OSError as exc:
                out[f'kill{pid}'] = type(exc).__name__
        libc = ctypes.CDLL(None, use_errno=True)
        out['ptrace'] = libc.ptrace(16, os.getppid(), 0, 0)  # PTRACE_ATTACH
        out['ptrace_errno'] = ctypes.get_errno()
        out['visible'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        save_report(out)
        """,
    )
    report = world.completed(result)
    assert report["self"] in report["visible"], report  # it listed its own /proc
    assert report["kill1"] == "PermissionError" and report[f"kill{report['ppid']}"] == "PermissionError", (
        report
    )
    assert report["ptrace"] == -1
    assert report["ptrace_errno"] == errno.EPERM, report  # refused, not a bad argument
    # A pid namespace of its own: bwrap's init (1), the runner and nothing of the host's.
    assert 1 in report["visible"] and len(report["visible"]) <= 3, report
    assert max(report["visible"]) < 100 and os.getpid() not in report["visible"], report
    world.healthy()


def test_another_tenants_cache_entry_is_unreachable(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    executor = world.executor
    other = Path(executor.cache.root) / "tenants" / "other-tenant"
    other.mkdir(parents=True, exist_ok=True)
    (other / "secret.bin").write_bytes(world.secret.encode())
    (other / "secret.bin").chmod(0o644)
    paths = [str(other / "secret.bin"), "/ro/../" + str(other)]
    result = world.attack(
        f"""
        import os
        out = {{'shards': os.listdir('/ro/shards')}}
        for path in {paths!r}:
            try:
                out[path] = open(path).read()
            except OSError as exc:
                out[path] = type(exc).__name__
        save_report(out)
        """,
    )
    report = world.completed(result)
    assert all(path in report for path in paths), report  # both reads were tried
    assert world.secret not in str(result.report), result.report
    world.healthy()


def test_nested_user_namespaces_are_refused(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        """
        import ctypes, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        out = {'unshare_call': libc.unshare(0x10000000), 'errno': ctypes.get_errno()}
        cli = subprocess.run(['unshare', '-U', 'true'], capture_output=True)
        out['unshare_cli'], out['cli_said'] = cli.returncode, cli.stderr.decode(errors='replace')
        save_report(out)
        """,
    )
    report = world.completed(result)
    # The seccomp filter refused both (the host's kernel allows an unprivileged user namespace).
    assert report["errno"] == errno.EPERM and "not permitted" in report["cli_said"], report
    assert result.report["unshare_call"] == -1 and result.report["unshare_cli"] != 0, result.report
    world.healthy()


def test_tenant_code_holds_no_capability_not_even_in_its_bounding_set(world) -> None:  # type: ignore[no-untyped-def]
    result = world.attack(
        """
        import os
        lines = open('/proc/self/status').read().splitlines()
        fields = dict(line.split(':', 1) for line in lines if ':' in line)
        names = ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs')
        save_report({k: fields[k].strip() for k in names} | {'uid': os.getuid()})
        """,
    )
    report = world.completed(result)
    assert report["uid"] != 0, report
    # An empty bounding set: no setuid or file-capability program could hand one back.
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(report[field], 16) == 0, report
    assert report["NoNewPrivs"] == "1", report
    world.healthy()


def test_a_loop_that_ignores_stop_is_killed_after_the_grace(world) -> None:  # type: ignore[no-untyped-def]
    executor = world.executor
    world.arm(
        """
        emit_stats({'attempt': 'spin'})
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
        """
    )
    executor.run(steps=1)
    deadline = time.monotonic() + 60
    while not world.attempts():  # the loop is entered: now a stop has to get through it
        assert time.monotonic() < deadline, "the round never started"
        time.sleep(0.01)
    started = time.monotonic()
    threading.Thread(target=executor.stop).start()
    assert executor.wait(30), "the round did not end"
    latency = time.monotonic() - started
    result = executor.finish_round()
    print(f"stop of a stop-ignoring loop: {latency * 1000:.0f} ms (grace 1 s)")
    world.proved("spin")
    assert result.status is RoundStatus.STOPPED, result
    assert latency < 10
    world.healthy()


def test_a_runner_that_segfaults_fails_its_round_and_the_next_gets_a_fresh_one(world) -> None:  # type: ignore[no-untyped-def]
    before = world.healthy().report["runner"]
    [host_pid] = world.processes()
    result = world.attack(
        """
        import ctypes
        emit_stats({'attempt': 'segfault'})
        ctypes.string_at(0)  # a read of address 0: SIGSEGV in the runner itself
        save_report({'survived': True})
        """,
    )
    world.proved("segfault")
    assert result.status is RoundStatus.FAILED and result.error.code == "sandbox_runner_error", result
    assert world.executor.state.value == "loaded"
    after = world.healthy().report["runner"]
    assert after != before, (before, after)  # same pid in a fresh pid namespace, a later start
    runners = world.processes()
    assert len(runners) == 1 and runners != [host_pid], f"not a fresh runner: {host_pid} then {runners}"


def test_sandboxed_and_in_thread_training_agree(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    executor, server = world.executor, world.server
    code = "torch.manual_seed(0)\ntorch.set_num_threads(1)\n" + TRAIN_CODE
    sandboxed = world.attack(code, steps=4)
    in_thread = Executor(
        lambda _s: None,
        lambda _l: None,
        settings=executor.settings.model_copy(update={"work_dir": str(tmp_path / "w"), "sandbox": "off"}),
    )
    in_thread.load(
        server.url("model.safetensors"), world.descriptors, world.dispatch,
        params={"attack": code},
    )  # fmt: skip
    plain = in_thread.run_round(steps=4)
    in_thread.shutdown()
    assert sandboxed.status is plain.status is RoundStatus.COMPLETED, (sandboxed, plain)
    assert sandboxed.delta.hash == plain.delta.hash
    assert sandboxed.report == plain.report
