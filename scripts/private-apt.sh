#!/usr/bin/env bash
# Sourced by the scripts that fetch Debian packages without installing them (mesa25.sh,
# mesa-sid.sh): apt with a sources list, package lists and cache of its own under a folder, so
# that the system's apt state stays as it was.
#
# private_apt DIR "deb …" sets apt_opts, the options that point apt-get and apt-cache there,
# and fetches that source's package lists.
private_apt() {
    local dir="$1" source="$2"
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    echo "$source" >"$dir/sources.list"
    apt_opts=(
        -o "Dir::Etc::SourceList=$dir/sources.list" -o Dir::Etc::SourceParts=/nonexistent
        -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache" -o Debug::NoLocking=1
        -o "APT::Sandbox::User=$(id -un)" -o APT::Architecture=amd64 -qq
    )
    apt-get "${apt_opts[@]}" update >&2
}
