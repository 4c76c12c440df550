"""How the sandboxed runner is launched (DESIGN §8).

``bwrap`` (the primary mechanism), as root: new network (loopback only), pid, ipc, uts and
cgroup namespaces; a root of its own with only what the runner needs, read-only — the
Python installation at ``/opt/python``, its packages at ``/opt/site-packages``, the
runner's code at ``/opt/roundhouse``, the model at ``/model``, the worker's files for the
round at ``/ro`` — and one writable directory, ``/task``; a bounded tmpfs ``/tmp`` and
``/dev/shm``; the GPU device nodes; a new session; all capabilities dropped but the two
``setpriv`` needs to become the sandbox uid; a seccomp filter (:mod:`executor.seccomp`).
bwrap itself starts with an empty environment (a variable in bwrap's own environment
would be readable at ``/proc/1/environ``); the runner's is set with ``--setenv``.

``unshare`` (only when the operator names it): new network, pid, ipc and uts namespaces,
``setpriv`` to the sandbox uid — but no mount namespace (the host's ``/proc`` and files are
visible, guarded by permissions alone) and no seccomp filter. It does not give bwrap's
isolation, so ``auto`` never picks it: ``auto`` is bwrap or a refusal to run tenant code.

Both run under ``prlimit`` (processes, data size, file size, open files) and inside the
sandbox's confinement (:mod:`executor.sandbox._cgroup`). Whichever mode is chosen, the
worker first runs exactly the launch it will use, with a probe for a program
(:func:`probe_program`), and refuses clearly when that fails.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from executor.errors import SandboxUnavailable
from executor.fileio import MIB, remove_tree

logger = logging.getLogger(__name__)

CODE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the executor package
INSIDE_PYTHON = "/opt/python"
INSIDE_SITE = "/opt/site-packages"
INSIDE_CODE = "/opt/roundhouse"
INSIDE_TASK = "/task"
INSIDE_RO = "/ro"
INSIDE_MODEL = "/model"
GPU_DEVICES = ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidia4", "nvidia5", "nvidia6", "nvidia7")
GPU_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps")
# What the launch runs: the runner; or, to probe the very same launch, an interpreter that
# imports the engine's ground floor from the sandbox's view of the code (cheap: no torch).
RUNNER_PROGRAM = ("-m", "executor.sandbox")


def probe_program(task_dir: str) -> tuple[str, str]:
    """The probe: the engine's ground floor imported and the task directory entered, as the
    runner does first. Without the second, an unshare launch whose work dir lies under a
    directory the sandbox uid cannot cross (a 0700 parent) passes the probe and then fails
    every round at the runner's ``chdir``."""
    return ("-c", f"import os, executor.errors; os.chdir({task_dir!r})")


# The host's system directories bound read-only as themselves (see _system_binds).
SYSTEM_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "passwd",
    "group",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "nsswitch.conf",
    "os-release",
)


@dataclass(frozen=True)
class SandboxConfig:
    mode: str = "auto"  # auto | bwrap | unshare
    uid: int = 65534
    gid: int = 65534
    max_procs: int = 4096
    max_open_files: int = 4096
    memory_bytes: int | None = None  # RLIMIT_DATA; None: three quarters of the host's RAM
    tmp_bytes: int = 1024 * MIB
    stop_grace_s: float = 5.0
    wall_time_s: float | None = None
    disk_bytes: int | None = None  # the task dir's quota; None: derived from the model
    start_timeout_s: float = 180.0
    confinement: str = "auto"  # auto | cgroup2 | cgroup1 | pidns (executor.sandbox._cgroup)
    spare: bool = True  # keep a spare runner started for the next session (bwrap only)

    @property
    def data_limit(self) -> int:
        if self.memory_bytes:
            return self.memory_bytes
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(pages * 3 // 4)


@dataclass(frozen=True)
class Paths:
    """Host paths of one session's sandbox, and what the runner sees for each."""

    task: str  # writable, owned by the sandbox uid
    ro: str  # the worker's files for the runner: code, round specs, shards
    model: str  # the model dir (model.safetensors, bundle/), read-only
    bwrap: bool

    @property
    def inside_task(self) -> str:
        return INSIDE_TASK if self.bwrap else self.task

    @property
    def inside_ro(self) -> str:
        return INSIDE_RO if self.bwrap else self.ro

    @property
    def inside_model(self) -> str:
        return INSIDE_MODEL if self.bwrap else self.model

    def inside(self, host_path: str) -> str:
        """Where a file under ``ro``/``task``/``model`` appears to the runner."""
        for host, inner in (
            (self.ro, self.inside_ro),
            (self.task, self.inside_task),
            (self.model, self.inside_model),
        ):
            if host_path == host or host_path.startswith(host + os.sep):
                return inner + host_path[len(host) :]
        raise ValueError(f"{host_path} is not shared with the sandbox")


def _quiet(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, env={}, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def bwrap_works() -> bool:
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    probe = [
        "--unshare-net",
        "--unshare-pid",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "true",
    ]
    return _quiet([exe, *probe])


@functools.cache
def unshare_works() -> bool:
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    return bool(
        unshare and setpriv and os.geteuid() == 0 and _quiet([unshare, "--net", "--pid", "--fork", "true"])
    )


def resolve_mode(requested: str, uid: int) -> str:
    """``bwrap`` (``auto`` or asked for) or ``unshare`` (asked for by name only: it isolates less);
    ``SandboxUnavailable`` when the request cannot be met. The launch itself is probed after."""
    if requested in ("auto", "bwrap") and bwrap_works():
        return "bwrap"
    if requested == "unshare" and unshare_works():
        return "unshare"
    raise SandboxUnavailable(
        f"sandbox {requested!r} is not available here: nothing can isolate tenant code as DESIGN §8 "
        "requires. Install bubblewrap (apt-get install bubblewrap), or set ROUNDHOUSE_SANDBOX=off to "
        "run tenant code inside the worker (trusted code only).",
        {"requested": requested, "uid": uid},
    )


def _prlimit(config: SandboxConfig, file_bytes: int | None) -> list[str]:
    prlimit = shutil.which("prlimit") or "prlimit"
    return [
        prlimit,
        f"--nproc={config.max_procs}",
        f"--nofile={config.max_open_files}",
        f"--data={config.data_limit}",
        # None: a spare's, which lowers it itself before its first round's tenant code runs.
        f"--fsize={'unlimited' if file_bytes is None else file_bytes}",
        "--core=0",
        "--",
    ]


def _setpriv(config: SandboxConfig) -> list[str]:
    setpriv = shutil.which("setpriv") or "setpriv"
    return [
        setpriv,
        f"--reuid={config.uid}",
        f"--regid={config.gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]


def runner_environment(paths: Paths, cuda_visible: str | None) -> dict[str, str]:
    """The runner's whole environment: nothing of the worker's but the GPU selection."""
    home = f"{paths.inside_task}/home"
    cache = f"{paths.inside_task}/cache"
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp" if paths.bwrap else f"{paths.inside_task}/tmp",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "XDG_CACHE_HOME": cache,
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
        "TORCH_HOME": f"{cache}/torch",
        "CUDA_CACHE_PATH": f"{cache}/cuda",
        "HF_HOME": f"{cache}/hf",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MPLCONFIGDIR": f"{cache}/matplotlib",
    }
    sites = site_dirs()
    if paths.bwrap:
        env["PYTHONPATH"] = ":".join([INSIDE_CODE, *(inside for _, inside in sites)])
        # The interpreter moved to /opt/python; its RUNPATH still names the host path.
        env["LD_LIBRARY_PATH"] = ":".join([f"{INSIDE_PYTHON}/lib", *library_dirs(bwrap=True)])
    else:
        env["PYTHONPATH"] = ":".join([str(CODE_ROOT), *(host for host, _ in sites)])
        if libraries := library_dirs(bwrap=False):
            env["LD_LIBRARY_PATH"] = ":".join(libraries)
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return env


@functools.cache
def site_dirs() -> tuple[tuple[str, str], ...]:
    """Where the worker imports packages from beside its interpreter's own library, each with
    the path the runner sees it at: the entries of the worker's ``PYTHONPATH`` first (as in
    the worker, they come before site-packages: an operator's extra or newer packages, such
    as the GPU check's wheels beside an image's PyTorch), then the installation's
    site-packages. The code root is not one (the runner gets its ``executor`` package
    alone), nor is ``/`` or any directory above the code root: a ``PYTHONPATH`` naming one
    would otherwise put the host's files in the sandbox."""
    code = CODE_ROOT.resolve()
    paths = sysconfig.get_paths()
    candidates = [*os.environ.get("PYTHONPATH", "").split(os.pathsep), paths["purelib"], paths["platlib"]]
    found: list[str] = []
    for entry in candidates:
        if not entry or not os.path.isdir(entry):
            continue
        path = Path(entry).resolve()
        if path in code.parents:
            logger.warning("PYTHONPATH entry %s is not shared with the sandbox: it holds the code", path)
        elif path != code and str(path) not in found:
            found.append(str(path))
    return tuple((host, INSIDE_SITE if i == 0 else f"{INSIDE_SITE}-{i}") for i, host in enumerate(found))


@functools.cache
def library_dirs(*, bwrap: bool) -> tuple[str, ...]:
    """The worker's ``LD_LIBRARY_PATH`` as far as the runner can see it. A GPU host's driver
    (``libcuda.so``) is often found only through it (a driver directory mounted into the
    container, ``/usr/local/nvidia/lib64``, say), and the runner's environment is otherwise
    built from nothing. Under bwrap only the entries inside the system directories it binds
    (``/usr``, ``/lib*``) are kept: those are the same files there."""
    keep: list[str] = []
    for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if not entry or not os.path.isdir(entry) or entry in keep:
            continue
        if bwrap and not any(entry == root or entry.startswith(root + "/") for root in SYSTEM_ROOTS):
            continue
        keep.append(entry)
    return tuple(keep)


def python_inside() -> str:
    """The interpreter as the runner sees it under bwrap (the installation is moved to /opt/python)."""
    relative = Path(sys.executable).resolve().relative_to(Path(sys.base_prefix).resolve())
    return f"{INSIDE_PYTHON}/{relative}"


def _system_binds() -> list[str]:
    # Directories bwrap creates on the way to a mount point are 0700 otherwise: unreadable
    # for the sandbox uid.
    args = ["--ro-bind", "/usr", "/usr"]
    for directory in ("/etc", "/opt", INSIDE_CODE):
        args += ["--perms", "0755", "--dir", directory]
    for root in SYSTEM_ROOTS[1:]:
        path = Path(root)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ETC_FILES:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    return args


def _gpu_binds() -> list[str]:
    args: list[str] = []
    for name in (*GPU_DEVICES, *GPU_CONTROL_DEVICES):
        path = Path("/dev") / name
        if path.exists():
            args += ["--dev-bind", str(path), str(path)]
    return args


def bwrap_args(config: SandboxConfig, paths: Paths, env: dict[str, str], seccomp_fd: int | None) -> list[str]:
    """bwrap's options, handed over through ``--args FD``: as argv they would be readable
    by the sandbox at ``/proc/1/cmdline`` (bwrap is pid 1 there), host paths and all.
    (The command itself must stay on the command line; it names only sandbox paths.)"""
    base = Path(sys.base_prefix).resolve()
    args = [
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--hostname", "sandbox",
        # setpriv needs CAP_SETPCAP to empty the bounding set: libcap-ng 0.8.4 (Ubuntu 24.04)
        # refuses the launch without it ("apply bounding set"), 0.8.3 (Debian 12) silently
        # left the whole bounding set in place. setpriv drops all three before the program.
        "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
        "--clearenv",
        *_system_binds(),
        "--ro-bind", str(base), INSIDE_PYTHON,
        *(arg for host, inside in site_dirs() for arg in ("--ro-bind", host, inside)),
        "--ro-bind", str(CODE_ROOT / "executor"), f"{INSIDE_CODE}/executor",
        "--ro-bind", paths.model, INSIDE_MODEL,
        "--ro-bind", paths.ro, INSIDE_RO,
        "--bind", paths.task, INSIDE_TASK,
        "--dev", "/dev", *_gpu_binds(),
        "--proc", "/proc",
        "--perms", "1777", "--size", str(config.tmp_bytes), "--tmpfs", "/tmp",
        "--perms", "1777", "--size", str(config.tmp_bytes), "--tmpfs", "/dev/shm",
        "--chdir", "/",  # the runner enters /task itself: bwrap has no DAC override to do it
    ]  # fmt: skip
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args


def unshare_argv(config: SandboxConfig, env: dict[str, str], program: tuple[str, ...]) -> list[str]:
    unshare = shutil.which("unshare") or "unshare"
    env_args = [f"{key}={value}" for key, value in sorted(env.items())]
    return [
        unshare, "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
        *_setpriv(config),
        "/usr/bin/env", "-i", *env_args,
        sys.executable, *program,
    ]  # fmt: skip


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    args_blob: bytes | None  # what bwrap reads from its --args fd (NUL-separated)


def command(
    mode: str,
    config: SandboxConfig,
    paths: Paths,
    cuda_visible: str | None,
    *,
    seccomp_fd: int | None,
    args_fd: int | None,
    file_bytes: int | None,
    program: tuple[str, ...] = RUNNER_PROGRAM,
) -> Launch:
    env = runner_environment(paths, cuda_visible)
    if mode != "bwrap":
        return Launch([*_prlimit(config, file_bytes), *unshare_argv(config, env, program)], None)
    blob = b"".join(arg.encode() + b"\0" for arg in bwrap_args(config, paths, env, seccomp_fd))
    bwrap = shutil.which("bwrap") or "bwrap"
    inner = [*_setpriv(config), python_inside(), *program]
    return Launch([*_prlimit(config, file_bytes), bwrap, "--args", str(args_fd), "--", *inner], blob)


def prepare_dirs(paths: Paths, config: SandboxConfig) -> None:
    """The task dir belongs to the sandbox uid; ro and model are the worker's, readable only.

    A sandbox starts with an empty task dir: what one left (a runner that died, a worker
    process that crashed mid-round) is a tenant's tree of any shape, never walked, only
    removed (:func:`executor.fileio.remove_tree`); what cannot be removed stays, as before."""
    for directory in (paths.ro, os.path.join(paths.ro, "shards"), os.path.join(paths.ro, "rounds")):
        os.makedirs(directory, mode=0o755, exist_ok=True)
        os.chmod(directory, 0o755)
    remove_tree(paths.task, ignore_errors=True, keep_root=True)
    os.makedirs(paths.task, mode=0o700, exist_ok=True)
    subs = [os.path.join(paths.task, sub) for sub in ("home", "cache", "out", "tmp", "offload")]
    for sub in subs:
        os.makedirs(sub, mode=0o700, exist_ok=True)
    if os.geteuid() == 0:
        for directory in (*subs, paths.task):
            os.lchown(directory, config.uid, config.gid)
