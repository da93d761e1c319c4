#!/usr/bin/env bash
# Vagrant provisioner (root, inside the VM): makes the chosen kernel line the one the VM boots next. The
# Vagrantfile reboots the VM after this script.
set -euo pipefail
line=${1:?kernel line}
export DEBIAN_FRONTEND=noninteractive
case $line in
  5.10 | 6.1 | 6.12)
    # The box's own release ships this line: make sure its current build is installed.
    apt-get update -qq
    apt-get install -y -qq linux-image-amd64
    ;;
  newest)
    # Unstable's kernel on trixie, pinned so that nothing else comes from unstable; from the mirror the box's
    # apt sources already use (ci/apt-mirrors: no mirror address lives in the repository).
    . /nftkube/ci/apt-mirrors
    mirror=$(apt_debian_mirror) || { echo "no Debian mirror in the box's apt sources" >&2; exit 1; }
    echo "deb $mirror sid main" >/etc/apt/sources.list.d/sid.list
    cat >/etc/apt/preferences.d/nftkube-sid <<'PIN'
Package: *
Pin: release n=sid
Pin-Priority: 100
PIN
    apt-get update -qq
    apt-get install -y -qq -t sid linux-image-amd64
    ;;
  *)
    echo "unknown kernel line $line" >&2
    exit 1
    ;;
esac
# GRUB boots the newest installed kernel by default.
update-grub >/dev/null 2>&1 || true
echo "installed kernels:"; ls /boot/vmlinuz-*
