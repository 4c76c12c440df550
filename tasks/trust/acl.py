"""Redis ACL users of a Roundhouse deployment (DESIGN §11): each worker its own, the
orchestrator its own, nothing administrative for either.

``python -m tasks.trust.acl --worker gpu-host-0 --worker gpu-host-1 [--db 0] [--template]``
prints a Redis ACL file (``aclfile``): users ``worker-<host>`` and ``orchestrator`` (and
``admin`` with ``--admin``), the default user off. Passwords are generated and written,
with the URL each process uses, to ``--secrets FILE`` (mode 0600); the ACL file holds only
their SHA-256. ``--template`` writes ``>@PASSWORD_<USER>@`` placeholders instead, for a
start script that fills them in (``deploy/redis/``, docker-compose). Every rule is
explained in deploy/redis/README.md; the names come from :mod:`tasks.names`.

What a worker user can do: consume its own queue and put back what it took; keep its own
in-flight bookkeeping; bind its own queue and the shared control (``celery.pidbox``)
exchange; read the reply exchange's table and push replies; read and write results
(``celery-task-meta-*``: any id, results are not per host); publish its events, heartbeat
and Celery events; read its own stop requests; remember its own nonces. It cannot read
another worker's queue, in-flight messages, stop requests or nonces, bind to another
worker's exchange (which would copy that worker's tasks to it), or run ``CONFIG``,
``FLUSHALL``, ``KEYS``, ``DEBUG``, ``SHUTDOWN``, ``ACL``, ``MONITOR`` and the like: every
command is listed, everything else is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys

from settings.celery import unacked_keys
from tasks.names import (
    HEARTBEAT_INDEX,
    HOST_ID,
    channel_name,
    control_channel,
    heartbeat_key,
    nonce_key,
    queue_name,
    stop_key,
)

__all__ = ["acl_file", "orchestrator_rules", "worker_rules"]


# What every client library sends to connect and keep its connection: redis-py's HELLO,
# CLIENT SETNAME, health-check PINGs (its CLIENT SETINFO, Redis 7.2+, may fail: it is ignored);
# transactions and the Lua scripts of kombu (bindings, the unacked mutex) and of the event
# publisher (seq, stream, pub/sub at once).
CONNECTION = (
    "+ping +hello +auth +select +echo +quit +reset +client|setname +client|id "
    "+multi +exec +discard +watch +unwatch +evalsha +eval +script|load +script|exists +time"
)
WORKER_COMMANDS = (
    "+brpop +lpush +llen +exists +pexpire "  # its queue (and kombu's restore of what it took)
    "+hset +hget +hdel +zadd +zrem +zrange +zrangebyscore +zrevrangebyscore "  # in-flight
    "+set +get +setex +del +incr +xadd "  # results, heartbeat, events, nonces, the mutex
    "+sadd +srem +smembers "  # bindings
    "+publish +subscribe +unsubscribe +psubscribe +punsubscribe"
)
ORCHESTRATOR_COMMANDS = (
    "+lpush +llen +exists +brpop +pexpire "  # send tasks, and its reply queues
    "+hset +hget +hdel +zadd +zrem +zrange +zrangebyscore +zrevrangebyscore "  # kombu's bookkeeping
    "+set +get +mget +setex +del +scan +xrange +xrevrange "  # results, heartbeats, stops, events
    "+zremrangebyscore "  # the index of beats, pruned
    "+sadd +srem +smembers "
    "+publish +subscribe +unsubscribe +psubscribe +punsubscribe"
)
PIDBOX_BINDING = "_kombu.binding.celery.pidbox"
REPLY_BINDING = "_kombu.binding.reply.celery.pidbox"
# A client's reply queue is "<uuid4>.reply.celery.pidbox" (kombu's oid).
REPLY_QUEUE = "????????-????-????-????-????????????.reply.celery.pidbox"


def _user(name: str, password_rule: str, rules: list[str]) -> str:
    return " ".join(["user", name, "on", password_rule, "resetkeys", "resetchannels", "-@all", *rules])


def worker_rules(host_id: str, *, db: int = 0) -> list[str]:
    """The ACL rules of the worker ``host_id`` (everything after its password)."""
    if not HOST_ID.match(host_id):
        raise ValueError(f"a host id for an ACL must be letters, digits, '_', '.', '-': {host_id!r}")
    queue = queue_name(host_id)
    inflight = unacked_keys(host_id)
    keys = [
        f"~{queue}",
        *(f"~{key}" for key in inflight.values()),
        f"~_kombu.binding.{queue}", f"~_kombu.binding_permanent.{queue}",
        f"~{PIDBOX_BINDING}", "~_kombu.binding_permanent.celery.pidbox", "~_kombu.binding_deadlines",
        "~*@*.celery.pidbox",  # its node's (unused) control list: node names hold an '@'
        f"%R~{REPLY_BINDING}", "%R~_kombu.binding_permanent.reply.celery.pidbox",
        f"%W~{REPLY_QUEUE}",  # answers to inspect/ping: not the binding table ("*" would be)
        "~celery-task-meta-*",
        f"~{heartbeat_key(host_id)}",
        f"~{heartbeat_key(host_id, brief=True)}",
        f"~{channel_name(host_id)}:*",
        f"%R~{stop_key(host_id, '*')}",
        f"~{nonce_key(host_id, '*')}",
    ]  # fmt: skip
    channels = [
        f"&{channel_name(host_id)}",
        f"&{control_channel(host_id)}",
        "&celery-task-meta-*",
        f"&/{db}.celery.pidbox",
        f"&/{db}.celeryev/*",
    ]
    # kombu's sweep of expired binding tables may delete the reply exchange's: that alone.
    sweep = f"(~{REPLY_BINDING} +del)"
    # Its entry in the fleet's index of beats: ZADD only (no ZREM, no DEL of the index). An entry
    # it writes for another host is listed only if that host's own key holds its beat.
    index = f"(~{HEARTBEAT_INDEX} +zadd)"
    return [CONNECTION, WORKER_COMMANDS, *keys, *channels, sweep, index]


def orchestrator_rules(*, db: int = 0) -> list[str]:
    keys = [
        f"~{queue_name('*')}",
        "~_kombu.binding.*", "~_kombu.binding_permanent.*", "~_kombu.binding_deadlines",
        f"~{REPLY_QUEUE}",
        *(f"~{key}" for key in unacked_keys("*").values()),
        "~celery-task-meta-*",
        f"%R~{heartbeat_key('*')}",
        f"~{HEARTBEAT_INDEX}",  # read, and pruned of expired entries as it is listed
        f"%R~{channel_name('*')}:*",
        f"~{stop_key('*', '*')}",
    ]  # fmt: skip
    channels = [
        f"&{channel_name('*')}",
        f"&{control_channel('*')}",
        "&celery-task-meta-*",
        f"&/{db}.celery.pidbox",
        f"&/{db}.celeryev/*",  # Flower subscribes with this very pattern
    ]
    return [CONNECTION, ORCHESTRATOR_COMMANDS, *keys, *channels]


def password_rule(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def placeholder(user: str) -> str:
    return "@PASSWORD_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper() + "@"


def acl_file(passwords: dict[str, str | None], worker_hosts: list[str], *, db: int = 0) -> str:
    """The ACL file; ``passwords`` maps each user to its password (None: a placeholder)."""

    def rule(user: str) -> str:
        password = passwords.get(user)
        return password_rule(password) if password is not None else ">" + placeholder(user)

    lines = ["user default off resetkeys resetchannels -@all"]  # an ACL file has no comments
    for host in worker_hosts:
        lines.append(_user(f"worker-{host}", rule(f"worker-{host}"), worker_rules(host, db=db)))
    lines.append(_user("orchestrator", rule("orchestrator"), orchestrator_rules(db=db)))
    if "admin" in passwords:
        lines.append(f"user admin on {rule('admin')} ~* &* +@all")
    lines.append("user healthcheck on nopass resetkeys resetchannels -@all +ping +hello")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(prog="python -m tasks.trust.acl", description=__doc__.split("\n\n")[0])
    options.add_argument("--worker", action="append", default=[], help="a worker's host id (repeat)")
    options.add_argument("--db", type=int, default=0, help="the Redis database of the broker")
    options.add_argument("--admin", action="store_true", help="add an admin user (+@all) for operators")
    options.add_argument("--template", action="store_true", help="@PASSWORD_<USER>@ placeholders")
    options.add_argument("--secrets", default=None, help="write the generated passwords here (0600)")
    options.add_argument("--host", default="redis:6379", help="host:port in the URLs written to --secrets")
    args = options.parse_args(argv)
    users = [f"worker-{host}" for host in args.worker] + ["orchestrator"] + (["admin"] if args.admin else [])
    passwords: dict[str, str | None] = {
        user: None if args.template else secrets.token_urlsafe(24) for user in users
    }
    sys.stdout.write(acl_file(passwords, args.worker, db=args.db))
    if args.secrets and not args.template:
        fd = os.open(args.secrets, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            for user in users:
                out.write(f"{user} rediss://{user}:{passwords[user]}@{args.host}/{args.db}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
