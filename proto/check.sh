#!/usr/bin/env bash
# Lints proto/ and checks it against the last release for changes that break clients (buf.yaml at
# the repository root holds the rules). Exits non-zero when either check fails.
#   BUF:                       the buf binary; default: buf on PATH, else the one
#                              clients/typescript's `npm ci` installs.
#   ENVSERVE_PROTO_BASELINE:   a buf input to compare with; default: the release tag v0.1.0 where the
#                              clone has it, else the release's commit.
set -euo pipefail
cd "$(dirname "$0")/.."

# Release 0.1.0 (pyproject.toml's version at this commit) was never tagged.
RELEASE_0_1_0=447ec7cef75233849fcaa3a368addabb967e0f40

buf=${BUF:-$(command -v buf || true)}
[ -n "$buf" ] || buf=clients/typescript/node_modules/.bin/buf
if [ ! -x "$buf" ] && ! command -v "$buf" >/dev/null; then
  echo "proto/check.sh: buf not found: put it on PATH, set BUF, or run npm ci in clients/typescript" >&2
  exit 2
fi

if [ -n "${ENVSERVE_PROTO_BASELINE:-}" ]; then
  against=$ENVSERVE_PROTO_BASELINE
elif git rev-parse -q --verify "refs/tags/v0.1.0" >/dev/null; then
  against=".git#tag=v0.1.0,subdir=proto"
else
  # A shallow clone lacks the commit: fetch it (`git fetch --depth=1 origin $RELEASE_0_1_0`) or
  # set ENVSERVE_PROTO_BASELINE.
  against=".git#ref=$RELEASE_0_1_0,subdir=proto"
fi

status=0
echo "buf lint"
"$buf" lint || status=1
echo "buf breaking --against $against"
"$buf" breaking --against "$against" || status=1
exit $status
