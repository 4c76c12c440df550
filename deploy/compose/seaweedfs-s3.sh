#!/bin/sh
# One `weed server` (master, volume, filer, S3 gateway on :9000) whose only identity holds
# MinIO's root credentials; arguments are passed to `weed server` (the data directory).
set -eu
: "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}"
mkdir -p /etc/seaweedfs
umask 077
cat >/etc/seaweedfs/s3.json <<JSON
{"identities": [{"name": "root",
  "credentials": [{"accessKey": "${MINIO_ROOT_USER}", "secretKey": "${MINIO_ROOT_PASSWORD}"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
# Small volumes, many of them: each bucket is a collection that grows several at once.
exec weed server -ip.bind=0.0.0.0 -s3 -s3.port=9000 -s3.config=/etc/seaweedfs/s3.json \
  -s3.port.iceberg=0 -s3.port.lance=0 -master.volumeSizeLimitMB=64 -volume.max=64 "$@"
