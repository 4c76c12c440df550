"""A second process using a shard cache: ``python -m tests.support.cache_client CACHE LIMIT TENANT URL...``.

Acquires each shard in turn, like an executor moving through its shards (the
current one pinned while the next one downloads: two shards per process), and
prints one JSON line per shard, so tests can run real concurrent processes
against one cache directory and kill them mid-download. Each acquire checks the
process's own URL first, as a session of its own would. A refusal (a Roundhouse
error) prints ``{"error": code, "message": ...}`` and exits with status 3.
"""

from __future__ import annotations

import json
import sys

from executor.configs import transfer_config
from executor.errors import RoundhouseError
from executor.shards import ShardCache, ShardDescriptor
from settings import Settings


def main(argv: list[str]) -> int:
    root, limit, tenant, *urls = argv
    config = transfer_config(Settings(download_retries=3, download_backoff_s=0.01, url_allow=["127.0.0.1"]))
    cache = ShardCache(root, int(limit), transfer_config=config, wait_timeout_s=60)
    pins = []
    try:
        for url in urls:
            descriptor = ShardDescriptor.parse(json.loads(url) if url.startswith("{") else url)
            while len(pins) > 1:
                pins.pop(0).release()
            pin = cache.acquire(tenant, descriptor)
            pins.append(pin)
            print(json.dumps({"url": url, "path": pin.path, "size": pin.size}), flush=True)
    except RoundhouseError as exc:
        print(json.dumps({"error": exc.code, "message": exc.message}), flush=True)
        return 3
    finally:
        for pin in pins:
            pin.release()
    print(json.dumps({"stats": cache.stats().to_json()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
