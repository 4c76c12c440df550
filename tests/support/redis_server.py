"""A redis-server of the test's own: the product's embedded Redis (it can be killed and restarted)."""

from orchestrator.local import EmbeddedRedis as RedisServer
from orchestrator.local import free_port

__all__ = ["RedisServer", "free_port"]
