"""``python -m bench.presign``: how fast the orchestrator presigns S3 URLs, against botocore's.

A sharded round (issue 29) has every host GET a shard of every other host's delta: N × N
presigned URLs a round (4096 for 64 hosts), besides the N PUTs. The orchestrator signs them
with its own SigV4 query signer (``orchestrator.s3.presign``), which
``tests/unit/test_orchestrator_parts.py`` holds equal, URL for URL, to botocore's
``S3SigV4QueryAuth`` (given the path encoded as boto3's serializer does). This measures both on
``--urls`` object URLs, ``--runs`` times interleaved, and prints microseconds per URL (medians).
"""

from __future__ import annotations

import argparse
import statistics
import time
from urllib.parse import quote, urlsplit, urlunsplit

from bench.common import save
from orchestrator.s3 import presign

ENDPOINT = "http://127.0.0.1:9000/bucket/roundhouse"


def hand(urls: list[str]) -> float:
    started = time.perf_counter()
    for url in urls:
        presign("GET", url, access_key="AKID", secret_key="SECRET")
    return time.perf_counter() - started


def boto(urls: list[str]) -> float:
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    credentials = Credentials("AKID", "SECRET")
    started = time.perf_counter()
    for url in urls:
        parts = urlsplit(url)
        request = AWSRequest(method="GET", url=urlunsplit((*parts[:2], quote(parts.path, safe="/~"), "", "")))
        S3SigV4QueryAuth(credentials, "s3", "us-east-1", expires=3600).add_auth(request)
        _ = request.url
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.presign", description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", type=int, default=4096, help="URLs a run (64 hosts: 64 x 64)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    urls = [f"{ENDPOINT}/round-7/shard-{i % 64}/host-{i // 64}.zst" for i in range(args.urls)]
    times: dict[str, list[float]] = {"roundhouse": [], "botocore": []}
    for _ in range(args.runs):
        times["roundhouse"].append(hand(urls))
        times["botocore"].append(boto(urls))
    out = {name: 1e6 * statistics.median(values) / args.urls for name, values in times.items()}
    print(f"| signer | µs per URL | {args.urls} URLs, s |\n|---|---|---|")
    for name, micros in out.items():
        print(f"| {name} | {micros:.1f} | {micros * args.urls / 1e6:.3f} |")
    print(f"roundhouse / botocore: {out['roundhouse'] / out['botocore']:.2f} x")
    save("presign", {"args": vars(args), "us_per_url": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
