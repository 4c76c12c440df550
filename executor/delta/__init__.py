"""The bit-exact sync delta (DESIGN §4) and the trained delta a round ships back.

``state_hash`` / ``file_state_hash`` (the hash both sides agree on), ``make_sync_delta``
(the orchestrator's builder), ``write_delta`` / ``read_delta`` (the wire format, both
directions), ``apply_sync_delta`` (the worker's one-pass streaming apply) and
``write_result_delta`` (a round's ``trained - original``; ``compress_delta`` frames one
written plain). Every decode has a cap known
before it starts (DESIGN §11): ``max_delta_bytes`` of the model a delta belongs to, and
``zstd_bound`` of that for the compressed file's download.

Inside, data flows down: ``_apply`` (the streaming apply) and ``_wire`` (the zstd
safetensors format, the trained delta) → ``_decode`` (decoding within a cap: the bound,
the capped zstd stream, the apply's delta source, the seed's torch dicts) → ``_sync``
(the state hash, the apply rule, ``SyncDelta``) → ``_schemes`` (the hash schemes,
``sha256:`` and ``blake3:``, and the state hash of a safetensors stream as it arrives).

Quantised deltas (``"int8"``, ``"int4"``: ``QuantScheme``) run beside the float ones:
``_qwire`` (writing them, the trained delta with error feedback) → ``_feedback`` (the
session's residual, ``ErrorFeedback``) and ``_qlayout`` (their safetensors entries and
metadata, checked; the apply's dequantised slices) → ``_quant`` (the blockwise absmax
encoder and the bit-exact decoder, ``QuantizedDelta``). ``_decode``, ``_wire`` and
``_sync`` call into them where a delta turns out to be quantised.
"""

from executor.delta._apply import apply_sync_delta
from executor.delta._decode import max_delta_bytes, max_delta_tensors, zstd_bound
from executor.delta._feedback import ErrorFeedback, ResidualUpdate, SyncFeedback
from executor.delta._quant import (
    DeltaFormat,
    QuantizedDelta,
    QuantScheme,
    QuantTensor,
    delta_format,
    dequantize,
    format_name,
    quantize,
)
from executor.delta._qwire import quantize_key, residual_keys, trained_keys, trained_shapes
from executor.delta._schemes import (
    DEFAULT_SCHEME,
    SCHEMES,
    StreamStateHash,
    check_scheme,
    hash_entry_header,
    hash_prefix,
    new_hasher,
    scheme_of,
)
from executor.delta._sync import (
    SyncDelta,
    apply_rule,
    apply_sync_delta_state,
    file_state_hash,
    make_sync_delta,
    result_dtype,
    state_hash,
)
from executor.delta._wire import (
    DEFAULT_MAX_DELTA_BYTES,
    DeltaFile,
    compress_delta,
    read_delta,
    trained_diff,
    write_delta,
    write_result_delta,
)

__all__ = [
    "DEFAULT_MAX_DELTA_BYTES",
    "DEFAULT_SCHEME",
    "SCHEMES",
    "DeltaFile",
    "DeltaFormat",
    "ErrorFeedback",
    "QuantScheme",
    "QuantTensor",
    "QuantizedDelta",
    "ResidualUpdate",
    "StreamStateHash",
    "SyncDelta",
    "SyncFeedback",
    "apply_rule",
    "apply_sync_delta",
    "apply_sync_delta_state",
    "check_scheme",
    "compress_delta",
    "delta_format",
    "dequantize",
    "file_state_hash",
    "format_name",
    "hash_entry_header",
    "hash_prefix",
    "make_sync_delta",
    "max_delta_bytes",
    "max_delta_tensors",
    "new_hasher",
    "quantize",
    "quantize_key",
    "read_delta",
    "residual_keys",
    "result_dtype",
    "scheme_of",
    "state_hash",
    "trained_diff",
    "trained_keys",
    "trained_shapes",
    "write_delta",
    "write_result_delta",
    "zstd_bound",
]
