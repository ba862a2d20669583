#!/usr/bin/env bash
# Clone vLLM at the pinned tag and refuse it if the tag no longer points at the
# pinned commit (the full hash once resolved, its abbreviation until then).
# Usage: clone-vllm.sh REPO TAG COMMIT COMMIT_ABBREV DEST
set -euo pipefail
repo=$1 tag=$2 commit=$3 abbrev=$4 dest=$5
git clone --depth 1 --branch "${tag}" "${repo}" "${dest}"
head=$(git -C "${dest}" rev-parse HEAD)
if [ "${commit}" != "unresolved" ]; then
  [ "${head}" = "${commit}" ] || { echo "tag ${tag} moved: ${head} != ${commit}" >&2; exit 1; }
else
  case "${head}" in
    "${abbrev}"*) ;;
    *) echo "tag ${tag} moved: ${head} does not start with ${abbrev}" >&2; exit 1 ;;
  esac
fi
echo "vLLM ${tag} at ${head}"
