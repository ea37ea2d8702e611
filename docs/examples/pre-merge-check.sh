#!/bin/sh
# Pre-merge gate: run the training entry point for two steps on two CPU ranks under
# `ckptwatch check`, and block the merge if checkpointing is unsafe (a collision, a hazard or
# a corrupt checkpoint) or the job fails.
#
#   docs/examples/pre-merge-check.sh [extra training arguments...]
#
# Environment:
#   TRAIN           the training entry point, as torchrun takes it (default: train.py;
#                   a module: "-m pkg.train")
#   CKPTWATCH       how to run ckptwatch (default: ckptwatch)
#   CKPTWATCH_KEEP  a directory to keep the agent's journal and log in (a CI artifact)
#
# The job gets `--steps 2 --out DIR`: adapt those two flags to your script's.
set -eu

CKPTWATCH="${CKPTWATCH:-ckptwatch}"
TRAIN="${TRAIN:-train.py}"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/pre-merge-ckpt.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

export OMP_NUM_THREADS=1          # two CPU ranks on a small runner
keep=""
if [ -n "${CKPTWATCH_KEEP:-}" ]; then
    keep="--keep $CKPTWATCH_KEEP"
fi

status=0
# shellcheck disable=SC2086  # CKPTWATCH, TRAIN and keep are word lists on purpose
$CKPTWATCH check --watch.path "$OUT" $keep -- \
    torchrun --standalone --nproc-per-node 2 $TRAIN --steps 2 --out "$OUT" "$@" || status=$?

case "$status" in
    0) echo "pre-merge: checkpointing is safe" >&2 ;;
    1) echo "pre-merge: checkpointing is unsafe (report above); not merging" >&2 ;;
    *) echo "pre-merge: the training job failed (exit $status); not merging" >&2 ;;
esac
exit "$status"
