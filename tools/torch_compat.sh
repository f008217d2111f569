#!/usr/bin/env bash
# make torch-compat: the torch backend against the newest torch the registry serves and
# against the oldest release it supports (the lower bound of pyproject's `torch` extra),
# each in a scratch venv: tests/torch, then the DDP example under `aiocollect run -n 2`.
# Prints each version with pass/fail; exits non-zero when anything failed (docs/torch.md,
# "Supported torch releases").
#
# Environment: PYTHON (python3.11), TORCH_COMPAT_DIR (the scratch venvs:
# /tmp/aiocollect-torch-compat, kept for a rerun; delete it when done), TORCH_COMPAT_VERSIONS
# (pip specs to try instead of "newest oldest", e.g. "torch==2.13.0"), PYTEST_ARGS.
# A pip configuration that caps torch (a constraints file) caps "newest" too:
# PIP_CONFIG_FILE=/dev/null ignores it.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3.11}
WORK=${TORCH_COMPAT_DIR:-/tmp/aiocollect-torch-compat}
OLDEST=$(sed -n 's/^torch = \["torch>=\([0-9.]*\),.*/\1/p' "$ROOT/pyproject.toml")
[ -n "$OLDEST" ] || { echo "torch-compat: no 'torch>=X,<Y' extra in pyproject.toml"; exit 2; }
SPECS=${TORCH_COMPAT_VERSIONS:-"torch<3 torch==$OLDEST.*"}
DEPS="numpy msgpack uvloop ml_dtypes pytest pytest-timeout pytest-asyncio pytest-xdist"
summary=()
failed=0
for spec in $SPECS; do
    venv="$WORK/$(echo "$spec" | tr -c 'A-Za-z0-9.\n' '_')"
    echo "== $spec: $venv"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || exit 2
    if ! "$venv/bin/pip" install -q --upgrade "$spec" $DEPS \
        || ! "$venv/bin/pip" install -q --no-deps -e "$ROOT"; then
        summary+=("$spec: install failed")
        failed=1
        continue
    fi
    version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    cd "$ROOT" || exit 2
    # shellcheck disable=SC2086
    if PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q -n 0 -p no:cacheprovider \
        tests/torch ${PYTEST_ARGS:-}; then tests=pass; else tests=FAIL; failed=1; fi
    if PYTHONPATH="$ROOT" "$venv/bin/aiocollect" run -n 2 examples/torch_ddp.py; then
        ddp=pass
    else
        ddp=FAIL
        failed=1
    fi
    summary+=("torch $version: tests/torch $tests, aiocollect run -n 2 examples/torch_ddp.py $ddp")
done
echo "== torch-compat"
printf '%s\n' "${summary[@]}"
exit $failed
