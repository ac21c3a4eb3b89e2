#!/usr/bin/env bash
# Install what a real Kubernetes node needs beside scripts/get-kube.sh's binaries (tests/support/kubenode.py
# starts one, contained in a network namespace): a Docker engine for the kubelet's dockershim
# (docker.io, with runc and containerd), the CNI bridge and host-local plugins in /usr/lib/cni
# (containernetworking-plugins), dnsmasq (the test cluster's stand-in for CoreDNS, which no Debian
# suite ships), iptables and conntrack (kube-proxy's iptables mode), iproute2 (`ip netns`) and
# util-linux (`nsenter`).
#
# Debian, as root, with apt-get; installs only what is missing and prints nothing but errors. No
# service is started: a policy-rc.d refuses every start while the packages install (tests start
# their own dockerd and dnsmasq inside the node's namespace, never a system one).
# Idempotent. Usage: bash scripts/get-node.sh
set -euo pipefail
trap 'echo "get-node.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] ||
  need+=(containernetworking-plugins)
command -v dnsmasq >/dev/null 2>&1 || need+=(dnsmasq-base)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v conntrack >/dev/null 2>&1 || need+=(conntrack)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
[ "${#need[@]}" -gt 0 ] || exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "get-node.sh: missing ${need[*]} (Debian: apt-get install ${need[*]}), as root" >&2
  exit 1
fi
apt-get update -qq >/dev/null
# policy-rc.d keeps docker.io's postinst from starting a system dockerd (in the machine's own
# network namespace). A policy-rc.d the machine already has is left as it is.
ours=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && ours=1
fi
log=$(mktemp)
trap '[ -z "$ours" ] || rm -f /usr/sbin/policy-rc.d; rm -f "$log"' EXIT
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
  </dev/null >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
