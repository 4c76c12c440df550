"""Queued task messages taken apart and forged: what an attacker holding a broker password does
to a signed message (tests/unit/test_gate.py, tests/integration/test_control_plane.py).

A message in a Redis queue is JSON whose ``body`` is base64 of the auth serializer's payload,
itself base64: signer, signature, content type, encoding and the signed JSON, joined by
``tasks.trust.signing.SEP``.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from typing import Any

from tasks.trust.signing import SEP


def payload_parts(message: dict[str, Any]) -> list[bytes]:
    """The five parts of a queued message's auth payload (the signed JSON last)."""
    return base64.b64decode(base64.b64decode(message["body"])).split(SEP, 4)


def with_signed_json(message: dict[str, Any], edit: Callable[[bytes], bytes]) -> dict[str, Any]:
    """``message`` with the JSON inside its auth payload edited, its signature kept."""
    forged = copy.deepcopy(message)
    parts = payload_parts(forged)
    payload = SEP.join([*parts[:4], edit(parts[4])])
    forged["body"] = base64.b64encode(base64.b64encode(payload)).decode()
    return forged
