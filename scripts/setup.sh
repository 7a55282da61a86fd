#!/usr/bin/env bash
# Installs what building and testing wasmplane needs on a fresh Debian machine (as root):
# the wasm32-wasip2 Rust target for the guests, rustfmt for the formatting check, nftables,
# iproute2 and conntrack for the dataplane tests, protoc (with the well-known .proto files)
# and etcd for the kvstore, the reference CNI plugins for the CNI benchmark, an OCI registry
# (docker-registry) for the module registry tests. Quick when everything is already there.
set -euo pipefail
packages=(build-essential pkg-config protobuf-compiler libprotobuf-dev nftables iproute2 etcd-server conntrack containernetworking-plugins docker-registry)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The tests start their own registry on loopback; the package's service would listen on
  # every interface of a machine with systemd.
  if [[ " ${missing[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
fi
if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2
fi
# The formatting check (tests/deploy/tests/tidy.rs) runs rustfmt.
if ! rustup component list --installed | grep -q '^rustfmt'; then
  rustup component add rustfmt
fi
