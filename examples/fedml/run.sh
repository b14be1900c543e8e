#!/usr/bin/env bash
# Run examples/fedml/experiment.yaml on FedML: mpirun with FedML's cross-silo server on
# rank 0 and 2 worker ranks, all on loopback. Extra arguments go to the launcher, e.g.
#   examples/fedml/run.sh --algorithm fedgsp --out runs/fedml-fedgsp
# Needs the FedML environment: `make fedml-venv` (run from the repository root).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ ! -x .venv-fedml/bin/python ]]; then
    echo "no .venv-fedml: run \`make fedml-venv\` first" >&2
    exit 1
fi
out=runs/fedml-example
for argument in "$@"; do
    if [[ "$argument" == "--out" || "$argument" == --out=* ]]; then out=""; fi
done
exec .venv-fedml/bin/python -m fedplug.adapters.fedml run examples/fedml/experiment.yaml \
    --workers 2 ${out:+--out "$out"} "$@"
