"""Safe extraction of a zip that comes from a tenant: member checks, bounded reads.

The zip is treated as hostile: every name is checked before a single byte is written
(no absolute paths, no ``..``, no links or device files, no duplicates), the member
count is bounded, and the uncompressed size is bounded by counting the bytes actually
written, because a zip's headers can lie. A JSON member is read up to a bound, and a
config that needs remote code is refused; nothing from the zip is executed.
"""

from __future__ import annotations

import json
import os
import stat
import zipfile
from collections.abc import Mapping
from typing import IO, Any

from executor.errors import BadArtifact, into, map_exceptions

CONFIG_NAME = "config.json"
# Real checkpoints deflate to ~1.1x and JSON/tokenizer files to ~10x; a member that
# claims more than this is a bomb (deflate alone reaches ~1000x, bzip2 far more).
MAX_COMPRESSION_RATIO = 200
# Small members may compress absurdly well (a zero-filled buffer) and cost nothing.
RATIO_CHECK_MIN_BYTES = 1024 * 1024
MAX_JSON_BYTES = 16 * 1024 * 1024


def is_bundle_zip(names: list[str]) -> bool:
    """A zip that is a bundle rather than a ``torch.save`` archive (``<name>/data.pkl``)."""
    torch_archive = any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names)
    has_config = any(n == CONFIG_NAME or n.endswith("/" + CONFIG_NAME) for n in names)
    return has_config or not torch_archive


# --- member checks -------------------------------------------------------------------------


def safe_member_name(raw: str) -> str:
    """The normalised relative path of a member, or ``BadArtifact`` if it could escape."""
    if "\x00" in raw or "\\" in raw:
        raise BadArtifact(f"bundle member {raw!r} has a NUL or backslash in its name")
    if raw.startswith("/") or (len(raw) >= 2 and raw[1] == ":"):
        raise BadArtifact(f"bundle member {raw!r} has an absolute path")
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise BadArtifact(f"bundle member {raw!r} has a '..' component")
    return "/".join(parts)


def check_members(archive: zipfile.ZipFile, *, max_bytes: int, max_files: int) -> dict[str, zipfile.ZipInfo]:
    """Validate every member before anything is extracted; returns files by normalised name."""
    infos = archive.infolist()
    if len(infos) > max_files:
        raise BadArtifact(f"bundle has {len(infos)} members, more than the limit of {max_files}")
    seen: set[str] = set()
    files: dict[str, zipfile.ZipInfo] = {}
    declared_bytes = 0
    for info in infos:
        name = safe_member_name(info.filename)
        if name in seen:
            raise BadArtifact(f"bundle has a duplicate member {name!r}")
        seen.add(name)
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind == stat.S_IFLNK:
            raise BadArtifact(f"bundle member {name!r} is a symbolic link; links are rejected")
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise BadArtifact(f"bundle member {name!r} is a device or special file")
        if info.flag_bits & 0x1:
            raise BadArtifact(f"bundle member {name!r} is encrypted")
        if info.is_dir() or not name:
            continue
        declared_bytes += info.file_size
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size >= RATIO_CHECK_MIN_BYTES and ratio > MAX_COMPRESSION_RATIO:
            raise BadArtifact(f"bundle member {name!r} compresses {ratio:.0f}:1 (a zip bomb?)")
        files[name] = info
    if declared_bytes > max_bytes:
        raise BadArtifact(
            f"bundle declares {declared_bytes} uncompressed bytes, more than the limit of {max_bytes}"
        )
    return files


def find_root(members: Mapping[str, zipfile.ZipInfo]) -> str:
    """The member-name prefix of the bundle: ``""`` or ``"<folder>/"`` holding config.json."""
    if CONFIG_NAME in members:
        return ""
    folders = sorted(
        name.split("/")[0] for name in members if name.count("/") == 1 and name.endswith("/" + CONFIG_NAME)
    )
    if len(folders) == 1:
        return folders[0] + "/"
    if not folders:
        raise BadArtifact("bundle has no config.json at its root or in a single top-level folder")
    raise BadArtifact(f"bundle has config.json in several top-level folders: {', '.join(folders)}")


def reject_remote_code(config: Mapping[str, Any], name: str) -> None:
    if "auto_map" in config or config.get("trust_remote_code"):
        raise BadArtifact(
            f"bundle {name} needs remote code (auto_map/trust_remote_code); it is never executed"
        )


def read_json_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> dict[str, Any]:
    with archive.open(info) as source:
        raw = read_bounded(source, MAX_JSON_BYTES, name)
    return parse_json_object(raw, name)


def parse_json_object(raw: bytes, name: str) -> dict[str, Any]:
    with map_exceptions(
        {(ValueError, RecursionError): into(BadArtifact, f"bundle {name} is not valid JSON")}
    ):
        value = json.loads(raw)
    if not isinstance(value, dict):
        raise BadArtifact(f"bundle {name} is not a JSON object")
    return value


def read_bounded(source: IO[bytes], limit: int, name: str) -> bytes:
    unreadable = (zipfile.BadZipFile, OSError, EOFError, ValueError)
    with map_exceptions({unreadable: into(BadArtifact, f"bundle member {name} cannot be read")}):
        data = source.read(limit + 1)
    if len(data) > limit:
        raise BadArtifact(f"bundle {name} is larger than {limit} bytes")
    return data


# --- extraction ----------------------------------------------------------------------------


def extract_members(
    archive: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], root: str, *, max_bytes: int
) -> int:
    """Extract regular files under ``root``, counting real bytes; returns the bytes written."""
    written = 0
    for name in sorted(members):
        info = members[name]
        target = os.path.join(root, *name.split("/"))
        cannot = into(BadArtifact, f"bundle member {name!r} cannot be extracted")
        with map_exceptions({OSError: cannot}, where=root):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # O_EXCL | O_NOFOLLOW: never write through something that is already there.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as sink, map_exceptions({OSError: cannot}, where=root):
            written = _copy_member(archive, info, name, sink, written, max_bytes)
    return written


def _copy_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, sink: IO[bytes], written: int, max_bytes: int
) -> int:
    member_bytes = 0
    # zipfile stops at the declared size, so a lying header surfaces here as a bad CRC.
    corrupt = (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, RuntimeError)
    translated = map_exceptions({corrupt: into(BadArtifact, f"bundle member {name!r} is corrupt")})
    with translated, archive.open(info) as source:
        while chunk := source.read(1024 * 1024):
            member_bytes += len(chunk)
            written += len(chunk)
            if written > max_bytes:
                raise BadArtifact(f"bundle expands beyond the limit of {max_bytes} bytes")
            if member_bytes > info.file_size:
                raise BadArtifact(f"bundle member {name!r} is larger than its header says")
            sink.write(chunk)
    return written
