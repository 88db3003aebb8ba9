#!/usr/bin/env bash
# A standalone benchmark given a bad flag value exits 2 naming the flag, before it touches a GPU (so this runs
# on CPU-only machines too). usage: bench_flags_exit2.sh BINARY "FLAGS|EXPECTED" ...
set -u
bin=$1; shift
fail=0
for c in "$@"; do
  flags=${c%%|*}; want=${c#*|}
  out=$("$bin" $flags 2>&1); rc=$?
  if [ $rc -ne 2 ] || [[ $out != *"$want"* ]]; then
    echo "FAIL: $bin $flags: exit $rc (want 2), output: $out (want: $want)"; fail=1
  else
    echo "ok: $flags -> exit 2: $out"
  fi
done
exit $fail
