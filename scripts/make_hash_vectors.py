"""Write tests/vectors/hash_schemes_v1.json: every state of the shared sync-delta vectors
(tests/vectors/sync_delta_v1.json: base, delta, result) hashed in each scheme.

Run once; the file is committed. Both schemes hash the same bytes (DESIGN §4's layout); the
vectors pin the ``blake3:`` values beside the ``sha256:`` ones that the sync-delta vectors
already hold, so an orchestrator written against another BLAKE3 implementation can check
its bytes, and tests/unit/test_hash_schemes.py checks this one against both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from executor.delta import SCHEMES, state_hash  # noqa: E402  (after the path insert)
from tests.support.vectors import decode  # noqa: E402

VECTORS = REPO / "tests" / "vectors"


def main() -> None:
    source = json.loads((VECTORS / "sync_delta_v1.json").read_text())
    out = []
    for vector in source["vectors"]:
        hashes = {
            part: {scheme: state_hash(decode(vector[part]), scheme=scheme) for scheme in SCHEMES}
            for part in ("base", "delta", "result")
        }
        out.append({"delta_dtype": vector["delta_dtype"], "hashes": hashes})
    target = VECTORS / "hash_schemes_v1.json"
    target.write_text(json.dumps({"version": 1, "source": "sync_delta_v1.json", "vectors": out}, indent=1))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
