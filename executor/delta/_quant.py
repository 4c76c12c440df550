"""Blockwise absmax quantisation of a delta: int8, and int4 two values a byte (issue 16).

The contract both sides keep is the *decoder* (docs/ARCHITECTURE.md, "Quantised deltas"):
a tensor of ``n`` elements, flattened in row-major order, is cut into blocks of
``block_size`` consecutive elements (the last one may be short); block ``b`` has one
scale ``s_b`` stored as float32 or float16, and element ``i`` is
``float32(code_i) * float32(s_{i // block_size})`` — one IEEE fp32 multiply, round to
nearest even, no fused add after it. Codes are symmetric: ``[-127, 127]`` for int8,
``[-7, 7]`` for int4 (the most negative two's-complement value is never written and is
refused on input). int4 codes are packed two a byte over the whole flattened tensor,
element ``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in its high nibble; an odd
tensor's last high nibble is zero.

The encoder is as exact, so that every implementation builds the same codes from the
same floats: ``s = float32(absmax_b) / qmax`` (fp32 division), cast to the scale dtype
(a float16 scale that would overflow is the largest finite float16), widened back to
fp32; ``code = clamp(round_half_even(x / s), -qmax, qmax)`` with that widened scale, and
0 where the scale is 0 (a block of zeros, or a float16 scale that underflowed). Non-finite
inputs are refused. Error per element is at most ``s / 2`` plus fp32 rounding (and the
clamp's few ulps, where a rounded-down scale puts the absmax a hair past ``qmax``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from executor.errors import BadArtifact
from executor.tensorfile import dtype_name

QMAX = {8: 127, 4: 7}
SCHEME_BITS = {"int8": 8, "int4": 4}
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
FLOAT_DELTA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# A block of 2 keeps a quantised delta within the float32 bound every decode is capped by
# (1 + 4/2 bytes an element with float32 scales); wider than 2**20 would be one scale a tensor.
MIN_BLOCK, MAX_BLOCK = 2, 1 << 20
FLOAT16_MAX = 65504.0
# Encoding works through a tensor this many elements at a time: the temporaries stay small.
CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class QuantScheme:
    """How a delta is quantised: ``bits`` (8 or 4), ``block_size`` and the scales' dtype."""

    bits: int
    block_size: int = 64
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.bits not in QMAX:
            raise ValueError(f"quantised deltas have 8 or 4 bits, not {self.bits}")
        if not (isinstance(self.block_size, int) and MIN_BLOCK <= self.block_size <= MAX_BLOCK):
            raise ValueError(f"block_size must be an integer in [{MIN_BLOCK}, {MAX_BLOCK}]")
        if self.scale_dtype not in SCALE_DTYPES.values():
            raise ValueError(f"scale_dtype must be float32 or float16, not {self.scale_dtype}")

    @classmethod
    def named(
        cls, name: str, block_size: int = 64, scale_dtype: str | torch.dtype = "float32"
    ) -> QuantScheme:
        """``"int8"`` / ``"int4"`` with the given block size and scale dtype (a name or a dtype)."""
        if name not in SCHEME_BITS:
            raise ValueError(f"unknown quantised delta dtype {name!r}; use one of {sorted(SCHEME_BITS)}")
        dtype = SCALE_DTYPES.get(scale_dtype) if isinstance(scale_dtype, str) else scale_dtype
        if dtype is None:
            raise ValueError(f"scale_dtype must be float32 or float16, not {scale_dtype!r}")
        return cls(SCHEME_BITS[name], block_size, dtype)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def qmax(self) -> int:
        return QMAX[self.bits]

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` elements: one each (int8), one per two (int4)."""
        return numel if self.bits == 8 else (numel + 1) // 2

    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8


DeltaFormat = torch.dtype | QuantScheme


def delta_format(value: object) -> DeltaFormat:
    """A delta's dtype from what a caller names: a floating dtype, its name, ``"int8"``/``"int4"``
    (default block and scale), or a :class:`QuantScheme`. ``ValueError`` for anything else."""
    if isinstance(value, QuantScheme):
        return value
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f"delta dtype must be floating or quantised, got {value}")
        return value
    if isinstance(value, str):
        if value in FLOAT_DELTA_DTYPES:
            return FLOAT_DELTA_DTYPES[value]
        if value in SCHEME_BITS:
            return QuantScheme.named(value)
    names = sorted(FLOAT_DELTA_DTYPES) + sorted(SCHEME_BITS)
    raise ValueError(f"delta dtype must be one of {names} or a QuantScheme, got {value!r}")


def format_name(fmt: DeltaFormat) -> str:
    return fmt.name if isinstance(fmt, QuantScheme) else dtype_name(fmt)


@dataclass(frozen=True)
class QuantTensor:
    """One tensor quantised: its shape, its codes (flat int8, or flat packed uint8) and scales."""

    shape: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ---------------------------------------------------------------- encoding


def quantize(
    values: torch.Tensor, scheme: QuantScheme, *, dequantized: torch.Tensor | None = None
) -> QuantTensor:
    """The codes and scales of ``values`` (any floating dtype; read as float32).

    ``dequantized`` (float32, ``values``' size): filled with what the codes stand for, bit for
    bit what :func:`dequantize` returns (``float32(code) * scale``, computed from the same
    integers and scales), without decoding the codes again: the writer's error feedback.
    """
    flat = values.detach().to("cpu").reshape(-1)
    numel = flat.numel()
    out = dequantized.view(-1) if dequantized is not None else None
    if out is not None and (out.dtype != torch.float32 or out.numel() != numel):
        raise ValueError("dequantized must be a float32 tensor of the values' size")
    codes = torch.empty(numel, dtype=torch.int8)
    scales = torch.empty(scheme.blocks(numel), dtype=scheme.scale_dtype)
    block = scheme.block_size
    step = max(block, CHUNK_ELEMENTS // block * block)
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        first = start // block
        chunk_codes, chunk_scales = _encode(
            flat[start:stop].to(torch.float32), scheme, out[start:stop] if out is not None else None
        )
        codes[start:stop].copy_(chunk_codes)  # exact integers in float32: the cast is exact
        scales[first : first + chunk_scales.numel()] = chunk_scales
    packed = pack_int4(codes) if scheme.bits == 4 else codes
    return QuantTensor(tuple(int(d) for d in values.shape), packed, scales)


def _encode(
    chunk: torch.Tensor, scheme: QuantScheme, dequantized: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (as float32 integers) and stored scales of a run of whole blocks (the last may be short)."""
    count, block = chunk.numel(), scheme.block_size
    blocks = scheme.blocks(count)
    padded = chunk if blocks * block == count else torch.nn.functional.pad(chunk, (0, blocks * block - count))
    grid = padded.view(blocks, block)
    low, high = torch.aminmax(grid, dim=1)  # one pass; nan if the block holds one
    absmax = torch.maximum(high, low.neg_()).add_(0.0)  # + 0.0: a zero block's -0.0 is +0.0
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("a quantised delta cannot hold inf or nan")
    stored = absmax.div_(scheme.qmax).to(scheme.scale_dtype)
    if scheme.scale_dtype == torch.float16:
        stored.clamp_(max=FLOAT16_MAX)  # an overflow to inf becomes the largest float16
    wide = stored.to(torch.float32).unsqueeze(1)
    codes = torch.div(grid, wide).round_().clamp_(-scheme.qmax, scheme.qmax)
    zero = wide == 0  # there the quotient is nan or inf: the codes are 0
    if bool(zero.any()):
        codes.masked_fill_(zero, 0.0)
    if dequantized is not None:
        # The codes are exact integers in float32, so this is the decoder's product, once a code
        # that rounded to -0.0 is +0.0 (as the integer 0 is): x + 0.0 changes nothing else.
        flat = codes.add_(0.0).view(-1)[:count]
        torch.mul(flat, wide.expand(blocks, block).reshape(-1)[:count], out=dequantized)
    return codes.view(-1)[:count], stored


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes (int8 in [-8, 7]) two a byte: element 2j low nibble, 2j+1 high."""
    nibbles = codes.view(torch.uint8) & 0xF  # the low four bits of the two's complement
    if nibbles.numel() % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 codes of ``numel`` elements from their packed bytes (two's-complement nibbles)."""
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel].to(torch.int8)
    return torch.where(pairs >= 8, pairs - 16, pairs)


# ---------------------------------------------------------------- decoding


def check_scales(scales: torch.Tensor, what: str) -> torch.Tensor:
    """Stored scales widened to float32; a non-finite or negative (sign bit set) one is refused."""
    wide = scales.to(torch.float32)
    if not bool(torch.isfinite(wide).all()) or bool(torch.signbit(wide).any()):
        raise BadArtifact(f"quantised delta {what}: a scale is negative or not finite")
    return wide


def check_codes(codes: torch.Tensor, scheme: QuantScheme, what: str) -> None:
    """Unpacked int8 codes: the most negative value (-128, or -8 for int4) is never written."""
    if codes.numel() and int(codes.min()) < -scheme.qmax:
        raise BadArtifact(f"quantised delta {what}: a code is out of range [-{scheme.qmax}, {scheme.qmax}]")


def codes_of(qt: QuantTensor, scheme: QuantScheme, what: str) -> torch.Tensor:
    """The checked int8 codes of one tensor (unpacked for int4, its padding nibble zero)."""
    numel = qt.numel
    if scheme.bits == 8:
        codes = qt.codes
    else:
        codes = unpack_int4(qt.codes, numel)
        if numel % 2 and int(qt.codes[-1]) >> 4:
            raise BadArtifact(f"quantised delta {what}: the padding nibble is not zero")
    check_codes(codes, scheme, what)
    return codes


def scale_per_element(scales: torch.Tensor, start: int, count: int, block_size: int) -> torch.Tensor:
    """Float32 scales of elements ``[start, start + count)`` (``scales``: widened, whole tensor)."""
    first, last = start // block_size, (start + count - 1) // block_size
    expanded = scales[first : last + 1].repeat_interleave(block_size)
    skip = start - first * block_size
    return expanded[skip : skip + count]


def dequantize(qt: QuantTensor, scheme: QuantScheme, what: str = "tensor") -> torch.Tensor:
    """The float32 tensor ``qt`` stands for, bit for bit (checked as an untrusted input)."""
    numel = qt.numel
    scales = check_scales(qt.scales, what)
    codes = codes_of(qt, scheme, what)
    if numel == 0:
        return torch.empty(qt.shape, dtype=torch.float32)
    out = codes.to(torch.float32).mul_(scale_per_element(scales, 0, numel, scheme.block_size))
    return out.reshape(qt.shape)


class QuantizedDelta(Mapping[str, torch.Tensor]):
    """A quantised delta: maps each key to the float32 tensor it stands for (dequantised on
    access), and keeps the codes and scales that :func:`executor.delta.write_delta` writes.

    It is what ``make_sync_delta(..., dtype="int8")`` returns as ``.delta``: the orchestrator
    writes it like any delta, ``state_hash`` of it is ``state_hash`` of what ``read_delta``
    of the written file returns, and applying it adds exactly these float32 values.
    """

    def __init__(self, scheme: QuantScheme, tensors: Mapping[str, QuantTensor]) -> None:
        self.scheme = scheme
        self.tensors = dict(sorted(tensors.items()))

    def __getitem__(self, key: str) -> torch.Tensor:
        return dequantize(self.tensors[key], self.scheme, repr(key))

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"QuantizedDelta({self.scheme.name}, {len(self)} keys)"
