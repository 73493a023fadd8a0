#!/usr/bin/env bash
# Usage: scripts/apt-unpack.sh SUITE WORKDIR DEST PACKAGE...
# Downloads Debian packages from SUITE (e.g. trixie, bookworm-backports) of deb.debian.org
# with apt-get download and unpacks them into DEST (dpkg -x: no install). apt works on its
# own sources, lists and cache under WORKDIR, so nothing on the system changes; the suite's
# signature is checked against the system's keyring as any apt update checks it, and the
# suite's version is taken even where the system has another installed. Prints the
# downloaded files' names (package_version_arch.deb).
set -euo pipefail
suite=$1 work=$2 dest=$3
shift 3
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$dest"
work=$(realpath "$work") dest=$(realpath "$dest")
echo "deb http://deb.debian.org/debian $suite main" >"$work/sources.list"
o=(-oDir::Etc::SourceList="$work/sources.list" -oDir::Etc::SourceParts=/dev/null
    -oDir::State::Lists="$work/lists" -oDir::Cache="$work/cache" -oAPT::Architecture=amd64
    -oDir::Etc::Preferences=/dev/null -oDir::Etc::PreferencesParts=/dev/null)
# As root apt would hand the download to its _apt user, who cannot write to WORKDIR.
if [ "$(id -u)" -eq 0 ]; then o+=(-oAPT::Sandbox::User=root); fi
apt-get "${o[@]}" update -qq
rm -f "$work"/*.deb
(cd "$work" && apt-get "${o[@]}" -oAPT::Default-Release="$suite" download "$@" >/dev/null)
for deb in "$work"/*.deb; do
    dpkg -x "$deb" "$dest"
    basename "$deb"
done
