#!/usr/bin/env bash
# Make the Debian 12 (bookworm) base image locally, for machines that reach the Debian archive
# but no image registry: debootstrap a minimal root file system from the Debian mirror this
# machine's apt already uses, then `docker import` it. The images' Dockerfiles take it as
# --build-arg BASE_IMAGE (`make images` picks it up when it exists).
#
#   sudo docker/make-base.sh [TAG]        (default dflash-base:bookworm; needs root, debootstrap)
#
# The mirror is read from apt's own view of its sources (`apt-get indextargets`), so no host
# name is written here; DEBIAN_MIRROR overrides it.
set -euo pipefail

TAG=${1:-dflash-base:bookworm}
SUITE=bookworm

if [ "$(id -u)" -ne 0 ]; then
    echo "make-base: debootstrap needs root (run it with sudo)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "make-base: apt-get install debootstrap" >&2; exit 1; }

# Debian archive entries of this suite (bookworm, bookworm-updates, bookworm-security) as apt
# sees them: "URI RELEASE" lines.
sources=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Created-By: Packages' \
          | awk -v s="$SUITE" '$2 == s || index($2, s "-") == 1' | sort -u)
MIRROR=${DEBIAN_MIRROR:-$(awk -v s="$SUITE" '$2 == s { print $1; exit }' <<<"$sources")}
if [ -z "$MIRROR" ]; then
    echo "make-base: apt knows no Debian $SUITE archive (apt-get update?); set DEBIAN_MIRROR" >&2
    exit 1
fi

ROOTFS=$(mktemp -d /var/tmp/dflash-base.XXXXXX)
# A failed debootstrap may leave /proc or /sys mounted inside: unmount, never delete through.
cleanup() {
    grep -o " $ROOTFS/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf --one-file-system "$ROOTFS"
}
trap cleanup EXIT
echo "make-base: debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --components=main "$SUITE" "$ROOTFS" "$MIRROR"

# apt inside the image uses the same archive entries (the security and updates suites too).
if [ -n "${DEBIAN_MIRROR:-}" ]; then
    echo "deb $MIRROR $SUITE main" >"$ROOTFS/etc/apt/sources.list"
else
    awk '{ print "deb " $1 " " $2 " main" }' <<<"$sources" >"$ROOTFS/etc/apt/sources.list"
fi
# Image-sized defaults, as the official Debian images have: no recommends, no docs or man
# pages, no apt caches kept.
cat >"$ROOTFS/etc/apt/apt.conf.d/90dflash-image" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOF
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/90dflash-image" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
# Security and point-release updates on top of what debootstrap took from the main suite.
chroot "$ROOTFS" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade'
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/log/*.log \
       "$ROOTFS"/usr/share/doc/*/changelog* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*
rm -f "$ROOTFS"/etc/machine-id "$ROOTFS"/var/lib/dbus/machine-id

tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase $SUITE" \
    - "$TAG"
docker image inspect --format "make-base: {{.RepoTags}} {{.Size}} bytes" "$TAG"
