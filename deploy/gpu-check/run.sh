#!/usr/bin/env bash
# The GPU check (loadtests/gpu_check.py; docs/backends.md#the-gpu-check) on a machine with a CUDA build of torch and
# nothing else: finds the python that has torch, puts the wheels `make gpu-wheels` carried in deploy/gpu-check/carry/
# on its path (no pip, no network), runs every part within GPU_CHECK_LIMIT_S seconds (480). Arguments go to
# gpu_check.py: --dry-run runs every part on the CPU at tiny sizes.
set -uo pipefail
cd "$(dirname "$0")/../.."
limit=${GPU_CHECK_LIMIT_S:-480}
here=deploy/gpu-check
dry=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry=1; done

py=""
tried="${GPU_CHECK_PYTHON:-} python3 python .venv/bin/python"
for cand in $tried; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then
    py=$(command -v "$cand"); break
  fi
done
if [ -z "$py" ]; then
  echo "gpu-check: no python here imports torch (tried: $tried); set GPU_CHECK_PYTHON to one that does" >&2
  exit 2
fi
if [ "$dry" = 0 ] && ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) in $py sees no CUDA device" \
       "(torch.cuda.is_available() is False); this check needs a CUDA GPU (--dry-run runs it on the CPU)" >&2
  exit 2
fi
site=${GPU_CHECK_SITE:-runs/gpu-check/site}
# a wheel missing for this Python is reported; the parts that need it then fail with their own error
"$py" $here/install.py --wheels $here/carry/wheels --requirements $here/carry/requirements.txt --site "$site"
export PYTHONPATH="$PWD/$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
left=$(( limit - SECONDS - 15 ))
exec timeout -k 5 $(( left + 10 )) "$py" loadtests/gpu_check.py --budget "$left" "$@"
