#!/bin/sh
# The agent image's writable places, owned by its user, so `docker run IMAGE` starts as that
# user with the default command: the socket directory (0750: only the agent may create or
# remove names there), the journal directory and HOME. Run by deploy/Dockerfile; the tests
# run it under a scratch root (ROOT=/some/dir) to start the image's command without docker.
set -eu
ROOT="${ROOT:-}"
uid="${1:?uid}"
gid="${2:?gid}"
for d in /run/ckptwatch /var/lib/ckptwatch /home/ckptwatch; do
    install -d -o "$uid" -g "$gid" -m 0750 "$ROOT$d"
done
