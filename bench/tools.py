"""Command-line tools a benchmark compares against, installed from Debian when missing.

Benchmarks run on fresh machines of the project's kind, where ``nginx``, ``aria2c`` and
``zstd`` are not always present; as root the bench installs them with apt-get (a few
seconds from the package mirror) rather than failing or skipping a comparison.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# executable -> Debian package
PACKAGES = {"nginx": "nginx-light", "aria2c": "aria2", "curl": "curl", "zstd": "zstd"}
# Debian puts nginx in /usr/sbin, which a non-login PATH may lack.
EXTRA_PATH = ("/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for directory in EXTRA_PATH:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def require(*names: str) -> dict[str, str]:
    """Paths of ``names``; missing ones are installed with apt-get (root) or reported."""
    missing = [name for name in names if which(name) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise SystemExit(
                f"bench needs {', '.join(missing)}: install {' '.join(PACKAGES[m] for m in missing)}"
            )
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        packages = [PACKAGES[name] for name in missing]
        result = subprocess.run(
            ["apt-get", "install", "-y", "-q", *packages], env=env, capture_output=True, text=True
        )
        if result.returncode != 0:  # an old package index: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
            subprocess.run(
                ["apt-get", "install", "-y", "-q", *packages], env=env, check=True, capture_output=True
            )
    paths = {name: which(name) for name in names}
    absent = [name for name, path in paths.items() if path is None]
    if absent:
        raise SystemExit(f"bench could not install {', '.join(absent)}")
    return {name: path for name, path in paths.items() if path is not None}
