# The Roundhouse worker image: one worker per GPU (`roundhouse worker --gpu N`).
# CUDA comes with the torch wheel; the host needs the NVIDIA driver and the container
# toolkit (compose asks for the GPU with a device reservation).
#
# BASE_IMAGE: any Debian bookworm image with python3.11 and its venv module. The default is
# the official one; where no registry is reachable, scripts/docker_base.sh makes one from
# Debian's archive (debootstrap + docker import), as `make compose-test` does.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# bubblewrap is the sandbox (docs/SECURITY.md); tini reaps and forwards signals.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap tini util-linux \
 && rm -rf /var/lib/apt/lists/*

# A virtualenv of its own: Debian's system Python refuses pip (PEP 668), and the official
# image's is left as it is.
RUN python3 -m venv /opt/roundhouse
ENV PATH=/opt/roundhouse/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
# torch and torchvision (with CUDA, ~5 GB) in a layer of their own, at the pins of
# pyproject.toml: a change to the code does not download them again.
RUN pip install --no-cache-dir $(python3 -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print(' '.join(d for d in deps if d.startswith(('torch==', 'torchvision=='))))")
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
