#!/usr/bin/env bash
# Formats every tracked C++/CUDA file under include/ tests/ examples/ benchmarks/ in place with
# the repo's .clang-format, using clang-format 14 (Debian 12's; other versions format
# differently). Files may be named to format only those.
#   bash scripts/format.sh            format everything
#   bash scripts/format.sh --check    change nothing; list the files that are not formatted and
#                                     exit 1 if there are any (scripts/check-format.sh, CI)
set -euo pipefail
cd "$(dirname "$0")/.."

check=0
if [ "${1:-}" = "--check" ]; then
  check=1
  shift
fi

clang_format=${CLANG_FORMAT:-}
if [ -z "$clang_format" ]; then
  for c in clang-format-14 clang-format; do
    command -v "$c" >/dev/null && { clang_format=$c; break; }
  done
fi
if [ -z "$clang_format" ]; then
  echo "format: clang-format not found; run bash scripts/install-deps.sh (Debian 12: clang-format)" >&2
  exit 2
fi
version=$("$clang_format" --version 2>/dev/null | sed -n 's/.*clang-format version \([0-9]*\).*/\1/p' || true)
if [ "$version" != 14 ]; then
  echo "format: $clang_format is version ${version:-unknown}; zero is formatted with clang-format 14" \
       "(Debian 12's), whose output other versions do not reproduce. Set CLANG_FORMAT to a" \
       "clang-format 14." >&2
  exit 2
fi

if [ $# -gt 0 ]; then
  files=("$@")
else
  git rev-parse --git-dir >/dev/null 2>&1 ||
    { echo "format: lists the files with git ls-files: needs a git checkout" >&2; exit 2; }
  mapfile -t files < <(git ls-files -- include tests examples benchmarks |
                         grep -E '\.(hpp|cpp|cuh|cu|h)$')
fi

if [ $check -eq 0 ]; then
  "$clang_format" -i "${files[@]}"
  exit 0
fi

unformatted=()
for f in "${files[@]}"; do
  "$clang_format" --dry-run --Werror "$f" >/dev/null 2>&1 || unformatted+=("$f")
done
if [ ${#unformatted[@]} -gt 0 ]; then
  echo "check-format: ${#unformatted[@]} of ${#files[@]} files are not formatted with .clang-format:" >&2
  printf '  %s\n' "${unformatted[@]}" >&2
  echo "check-format: to fix, run bash scripts/format.sh (in place; name files to format only those)" >&2
  exit 1
fi
echo "check-format: all ${#files[@]} files are formatted"
