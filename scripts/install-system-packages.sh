#!/usr/bin/env bash
# Installs the Debian packages some tests need, when their commands are missing:
#   docker-compose  tests/static/test_compose.py validates compose.yaml with `docker-compose config`
#   redis-server    the Redis-backed tests start a throwaway redis-server
# Idempotent and quiet. It never fails the caller: without root, without apt-get or
# without network it says what is missing and exits 0, and the tests that need the
# command skip with their own reason.
set -u

# command -> Debian package that provides it
declare -A PACKAGES=([docker-compose]=docker-compose [redis-server]=redis-server)

missing=()
for cmd in "${!PACKAGES[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("${PACKAGES[$cmd]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-packages: not root or no apt-get; not installing ${missing[*]} (tests that need them skip)" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if apt-get -qq update >"$log" 2>&1 \
        && apt-get -qq install -y --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
    echo "install-system-packages: installed ${missing[*]}"
else
    echo "install-system-packages: could not install ${missing[*]} (tests that need them skip); apt-get said:" >&2
    tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
