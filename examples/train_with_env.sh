#!/usr/bin/env bash
# train.py, unchanged, with the plugin turned on from outside the script.
#
#   ./train_with_env.sh [--model PATH] [--steps N]
#
# `ms-loadpatch run` works with any install (it puts a sitecustomize on
# PYTHONPATH). With a wheel install, the .pth hook makes the variable alone enough:
#   MS_LOADPATCH=1 python train.py
# MS_LOADPATCH_REPORT=1 logs one line per accelerated load (phases, tensors cast, technique).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
MS_LOADPATCH_REPORT=1 exec ms-loadpatch run -- "${PYTHON:-python}" "$here/train.py" "$@"
