"""Shard decoding: a zstd-packed shard streamed to its bytes, and a shard file to its object.

The cache decodes a ``compression: zstd`` shard once, when it arrives, into the entry
it keeps (:func:`decoded_chunks`, with :func:`probe_decode` and :func:`zstd_content_size`
to size the reservation first). :func:`load_shard_file` turns an entry into what
``get_shard`` returns; it holds no cache code, so the sandboxed runner uses it too.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import IO, Any

import torch
import zstandard
from safetensors.torch import load_file

from executor.errors import BadArtifact, Stopped, Translations, into, map_exceptions

# The decoder's output buffer. Small enough to stay in a core's L2 between the decoder
# writing it and write() copying it out: with 4 MiB the decode ran at half the speed of
# `zstd -d -T1` on a 512 MB shard (0.92 s vs 0.43 s), with 1 MiB at 96 % (bench/zstd.py).
DECODE_CHUNK_BYTES = 1024 * 1024
_ZIP_MAGIC = b"PK\x03\x04"
NOT_ZSTD: Translations = {zstandard.ZstdError: into(BadArtifact, "shard is not valid zstd")}


def zstd_content_size(source: IO[bytes]) -> int | None:
    """The decoded size the frame at the start of ``source`` records, None when it records none."""
    with map_exceptions(NOT_ZSTD):
        params = zstandard.get_frame_parameters(source.read(18))
    return params.content_size if params.content_size != zstandard.CONTENTSIZE_UNKNOWN else None


def probe_decode(source: Any, probe_bytes: int = 64 * 1024) -> None:
    """Decode the start of a frame before trusting its header: a corrupt frame's
    content size is noise, and must not turn into a cache reservation."""
    reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True, closefd=False)
    try:
        with map_exceptions(NOT_ZSTD):
            reader.read(probe_bytes)
    finally:
        reader.close()
        source.seek(0)


def decoded_chunks(source: Any, abort: threading.Event | None) -> Generator[memoryview, None, None]:
    """The decoded bytes of ``source`` through one reused buffer: a chunk is valid until the next."""
    view = memoryview(bytearray(DECODE_CHUNK_BYTES))
    with zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True) as reader:
        while True:
            if abort is not None and abort.is_set():
                raise Stopped("stopped while decoding a shard")
            with map_exceptions(NOT_ZSTD):
                count = reader.readinto(view)
            if not count:
                return
            yield view[:count]


def load_shard_file(path: str) -> Any:
    """Decode one shard file: a ``torch.save`` object (weights_only, mmap when possible) or safetensors."""
    with open(path, "rb") as file:
        magic = file.read(8)
    with map_exceptions(
        {Exception: into(BadArtifact, "shard is neither a weights-only torch file nor safetensors")}
    ):
        if magic.startswith(_ZIP_MAGIC):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if magic[:1] == b"\x80":  # the legacy (pre-zip) torch.save format cannot be mapped
            return torch.load(path, map_location="cpu", weights_only=True)
        return load_file(path)
