#!/usr/bin/env bash
# Vagrant provisioner (root, inside the VM): runs nftkube's kernel tests on the running kernel.
set -euo pipefail
line=${1:?kernel line}
kver=$(uname -r)
case $line in
  newest)
    newest=$(ls /boot/vmlinuz-* | sort -V | tail -1)
    if [ "$newest" != "/boot/vmlinuz-$kver" ]; then
      echo "running kernel $kver is not the newest installed ($newest): run 'vagrant reload --provision'" >&2
      exit 1
    fi
    ;;
  *)
    case $kver in
      "$line".*) ;;
      *)
        echo "running kernel $kver is not the $line line: run 'vagrant reload --provision'" >&2
        exit 1
        ;;
    esac
    ;;
esac
echo "kernel $kver"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# Build tools; nftables, iproute2 and conntrack are the tests' oracles (nftkube never runs them); file(1)
# checks that the release binary is static.
apt-get install -y -qq build-essential curl ca-certificates pkg-config file nftables iproute2 conntrack >/dev/null
if ! command -v cargo >/dev/null 2>&1 && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
fi
export PATH=$HOME/.cargo/bin:$PATH
cd /nftkube
bash ci/build-static
cargo build --bins --workspace
cargo test -p kernel-tests -- --test-threads=2
