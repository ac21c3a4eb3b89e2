# legorl-base/node: stands in for node:22-bookworm-slim where no registry is reachable: Debian's
# nodejs and npm (only the harness images' build stages use it, to fetch pinned npm packages).
ARG DEBIAN_IMAGE=legorl-base/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm ca-certificates \
 && rm -rf /var/lib/apt/lists/*
