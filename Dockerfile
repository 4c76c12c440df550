# The Roundhouse worker image: one worker per GPU (`roundhouse worker --gpu N`).
# CUDA comes with the torch wheel; the host needs the NVIDIA driver and the container
# toolkit (compose asks for the GPU with a device reservation).
FROM python:3.11-slim-bookworm

# bubblewrap is the sandbox (docs/SECURITY.md); tini reaps and forwards signals.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap tini util-linux \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY executor executor
COPY settings settings
COPY tasks tasks
COPY orchestrator orchestrator
RUN pip install --no-cache-dir .

ENV ROUNDHOUSE_WORK_DIR=/var/lib/roundhouse/work \
    ROUNDHOUSE_CACHE_DIR=/var/lib/roundhouse/cache \
    PYTHONUNBUFFERED=1
VOLUME ["/var/lib/roundhouse"]
EXPOSE 9808

# The worker runs as root inside its container so that bubblewrap can build the sandbox
# and drop tenant code to ROUNDHOUSE_SANDBOX_UID (see docs/SECURITY.md). Compose grants it
# the capabilities bwrap needs.
ENTRYPOINT ["tini", "--"]
CMD ["roundhouse", "worker"]
