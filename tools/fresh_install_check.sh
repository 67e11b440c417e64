#!/usr/bin/env bash
# Run README.md's two set-up commands, exactly as written, in a fresh virtual environment and a fresh clone
# of this repository, the way a new user (or CI) would. Slow: torch alone is several GB.
#
#   bash tools/fresh_install_check.sh [WORKDIR]     # WORKDIR defaults to a new folder under /tmp
#
# The clone is placed beside a link to ../shared (when this checkout has one), so the coco128 tests run too.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/fastload-fresh-XXXX)}
mkdir -p "$work"
git clone --quiet "$repo" "$work/fastload"
[ -d "$repo/../shared" ] && ln -sfn "$(cd "$repo/../shared" && pwd)" "$work/shared"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
cd "$work/fastload"
mapfile -t setup < <(sed -n '/^```bash$/,/^```$/p' README.md | sed -n '2,3p')
for command in "${setup[@]}"; do
  echo "+ $command"
  (cd "$work/fastload" && eval "$command")
done
echo "fresh install check passed in $work"
