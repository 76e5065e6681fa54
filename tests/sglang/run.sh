#!/usr/bin/env bash
# The SGLang diffusion integration tests (kopt/integrations/sglang.py) in their own environment:
# sglang pins torch 2.14.1 (a CUDA build, which runs on the CPU) and ~11 GB of packages that the
# main .venv (torch 2.13.0, CPU) must not get. Builds .venv-sglang in the repository root from the
# pinned tests/sglang/requirements.txt (again only when that file changes), installs kopt into it
# without dependencies (torch, triton, networkx and sympy come with sglang's pins), runs the tests.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-sglang
lock=tests/sglang/requirements.txt
stamp="$venv/.kopt-requirements.sha256"
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -r "$lock"
    echo "$want" > "$stamp"
fi
"$venv/bin/pip" install -q -e . --no-deps
"$venv/bin/python" -m pytest -q tests/sglang "$@"
