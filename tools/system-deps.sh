#!/usr/bin/env bash
# Install the Debian packages the test-suite uses, when missing and when we can (root + apt).
set -u
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${need[*]} (not root or no apt-get); tests needing them will skip visibly"
  exit 0
fi
echo "system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || echo "system-deps: apt-get install ${need[*]} failed; tests needing them will skip visibly"
exit 0
