# legorl-base/python: stands in for python:3.11-slim-bookworm where no registry is reachable.
# Debian's python3 (3.11) with pip and venv, made a plain Python as the official image is: pip
# installs into it (no EXTERNALLY-MANAGED marker) and `python` names it. Built a second time on
# trixie (--build-arg DEBIAN_IMAGE=legorl-base/debian:trixie, Python 3.13) as legorl-base/python:trixie,
# the base of the task images built here (scripts/images/build_images.py: TASK_PYTHON).
ARG DEBIAN_IMAGE=legorl-base/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-pip python3-venv python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED
