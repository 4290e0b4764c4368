#!/usr/bin/env bash
# Submit a training run to a running Ray cluster as a Ray job.
#   cluster/submit.sh http://HEAD:8265 configs/grpo.yaml rollout.num_generators=4 ...
# Ray's job server uses token authentication: the token is read from ~/.ray/auth_token (or RAY_AUTH_TOKEN).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RAY_DASHBOARD_ADDRESS CONFIG [section.key=value ...]" >&2
  exit 2
fi
address=$1
config=$2
shift 2
export RAY_AUTH_MODE=token
exec ray job submit --address "$address" --working-dir . -- grpo-dist train "$config" ray.address=auto "$@"
