# Redis 7 from Debian, standing in for the official `redis:7-alpine` where no registry is
# reachable (deploy/compose/no-registry.yml). The official image turns protected mode off
# (it is reached over the stack's own network, by service name); the entry point does too.
ARG BASE_IMAGE=roundhouse-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
COPY redis-entry.sh /usr/local/bin/redis-entry
WORKDIR /data
ENTRYPOINT ["redis-entry"]
CMD ["redis-server"]
