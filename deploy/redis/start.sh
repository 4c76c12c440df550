#!/bin/sh
# Redis for Roundhouse off loopback: TLS only, ACL users, noeviction. For the official
# redis:7 image: mount this directory at /deploy and the keys (`roundhouse keys init DIR
# --redis-host <name>`) at /keys, set ROUNDHOUSE_REDIS_PASSWORD_<USER> for every user of
# users.acl.template (e.g. ROUNDHOUSE_REDIS_PASSWORD_WORKER_GPU_HOST_0, ..._ORCHESTRATOR), and
# run `sh /deploy/start.sh`. The image's entrypoint then owns /data and drops root.
set -eu
mkdir -p /data/tls
cp /keys/redis.crt /keys/redis.key /keys/ca.crt /data/tls/
acl=/data/users.acl
cp /deploy/users.acl.template "$acl.tmp"
for placeholder in $(grep -o '@PASSWORD_[A-Z0-9_]*@' /deploy/users.acl.template | sort -u); do
    name=$(echo "$placeholder" | tr -d '@' | sed 's/^PASSWORD_/ROUNDHOUSE_REDIS_PASSWORD_/')
    value=$(printenv "$name") || { echo "start.sh: $name is not set" >&2; exit 1; }
    sed -i "s|$placeholder|$value|" "$acl.tmp"
done
mv "$acl.tmp" "$acl"
cd /data
exec docker-entrypoint.sh redis-server \
    --port 0 --tls-port 6379 \
    --tls-cert-file /data/tls/redis.crt --tls-key-file /data/tls/redis.key \
    --tls-ca-cert-file /data/tls/ca.crt --tls-auth-clients no \
    --aclfile "$acl" --appendonly yes --maxmemory-policy noeviction
