#!/usr/bin/env bash
# train_distributed.py, unchanged, on 2 ranks with msrun and the plugin turned
# on from outside for every rank:
#
#   ./train_distributed.sh [--model PATH] [--steps N] [--zero-stage S]
#
# The same as `ms-loadpatch run -- msrun ...`. With a wheel install,
# `MS_LOADPATCH=1 msrun ...` works too (the .pth hook in every worker).
# RANKS (default 2) workers on this node, each reading with its share of the
# node's cores; MS_LOADPATCH_REPORT=1 logs each rank's load (read threads and
# ranks on the node included). Worker logs: $LOG_DIR (default ./msrun_log).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python}"
ranks="${RANKS:-2}"
# msrun starts its workers with `python` from PATH: make it this one
export PATH="$(dirname "$(command -v "$python")"):$PATH"
MS_LOADPATCH_REPORT=1 exec "$python" -m ms_loadpatch run -- \
    "$python" -m mindspore.parallel.cluster.run --worker_num="$ranks" --local_worker_num="$ranks" \
    --master_addr=127.0.0.1 --master_port="${MASTER_PORT:-8118}" --join=True --cluster_time_out=300 \
    --log_dir="${LOG_DIR:-$PWD/msrun_log}" \
    "$here/train_distributed.py" "$@"
