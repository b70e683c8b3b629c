# kvd in a container: the daemon, its CLI and the client library (import names kvd,
# engine_client, gpu_worker). docs/containers.md runs it beside two engine containers
# that share its host cache: read it for --ipc, the socket volume and the uid/gid.
#
#   docker build -t kvd .
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY kvd kvd
COPY engine_client engine_client
COPY gpu_worker gpu_worker
RUN pip install --no-cache-dir . && rm -rf /src

# The daemon's user; engine containers run with this gid (or this uid) to reach the
# socket and map the extents, both mode 0660.
ARG KVD_UID=10001
ARG KVD_GID=10001
RUN groupadd --gid "$KVD_GID" kvd \
 && useradd --uid "$KVD_UID" --gid kvd --no-create-home --shell /usr/sbin/nologin kvd \
 && install -d -o kvd -g kvd -m 0770 /run/kvd
# A fresh named volume mounted here takes this directory's owner and mode.
VOLUME /run/kvd
USER kvd:kvd
WORKDIR /

# Engines and the CLI find the daemon here (also the default when the file exists).
ENV KVD_SOCKET=/run/kvd/kvd.sock
# SIGTERM: calls in flight finish within shutdown_grace_seconds, published pages stay
# in /dev/shm for the next start (warm restart).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvd"]
CMD ["serve", "--enable-prefix-reuse", "--host-bytes", "8GiB"]
