#!/usr/bin/env bash
# Fail the image build when vLLM's compiled kernels carry no code the target GPU
# runs: on aarch64 (GB10, sm_121) the SM 12.x family (sm_120, sm_120f, sm_121*),
# on x86_64 Hopper or Blackwell (sm_90*, sm_100*, sm_120*). cuobjdump lists the
# cubins of each vLLM extension; no GPU is needed.
# Usage: check-cubins.sh ARCH   (uname -m of the image)
set -euo pipefail
case "$1" in
  aarch64) want='sm_12[01][af]?' ;;
  x86_64) want='sm_(90|100|120)[af]?' ;;
  *) echo "check-cubins: no rule for $1" >&2; exit 2 ;;
esac
pkg=$(python -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("vllm").origin))')
# A library without CUDA code makes cuobjdump exit non-zero: that counts as no code.
found=""
while IFS= read -r -d '' so; do
  found+=" $(cuobjdump --list-elf "${so}" 2>/dev/null | grep -oE 'sm_[0-9]+[af]?' | tr '\n' ' ' || true)"
done < <(find "${pkg}" -maxdepth 1 -name '_C*.so' -print0)
found=$(tr ' ' '\n' <<< "${found}" | sed '/^$/d' | sort -u | tr '\n' ' ')
echo "vLLM kernels carry: ${found:-nothing}"
if ! grep -qE "${want}" <<< "${found}"; then
  echo "no ${want} code in ${pkg}/_C*.so: wrong wheel, or the source build's arch list was folded" >&2
  exit 1
fi
