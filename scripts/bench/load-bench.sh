#!/usr/bin/env bash
# Load rate against dd of the same files (docs/benchmarks.md "Load"): for each binary given,
# `epserve launch --ranks R --model DIR` from a cold page cache (the files' pages evicted with
# posix_fadvise DONTNEED, which needs no root) and again warm, each until it serves; dd of the
# same files cold and warm beside. Prints one line per run: what, seconds to serve, the ranks'
# "checkpoint read" rate and "weights loaded" lines.
#   load-bench.sh DIR RANKS [EXTRA_FLAGS] -- "NAME=BINARY [ITS FLAGS]"...
set -uo pipefail
dir=$1 ranks=$2; shift 2
extra=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done
shift || true
files=("$dir"/*.safetensors)
evict() { python3 -c 'import os,sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "${files[@]}"; }
ddrate() { local t0 t1 bytes; bytes=$(cat "${files[@]}" | wc -c); t0=$(date +%s.%N)
  for f in "${files[@]}"; do dd if="$f" of=/dev/null bs=16M status=none; done; t1=$(date +%s.%N)
  python3 -c "print(f'{$bytes/($t1-$t0)/1e9:.2f} GB/s ({$bytes/1e9:.2f} GB in {$t1-$t0:.2f} s)')"; }
evict; echo "dd cold: $(ddrate)"; echo "dd warm: $(ddrate)"
for spec in "$@"; do
  name=${spec%%=*} bin=${spec#*=}
  for state in cold warm; do
    [ "$state" = cold ] && evict
    log=$(mktemp); t0=$(date +%s.%N)
    read -r -a cmd <<< "$bin"
    "${cmd[0]}" launch --ranks "$ranks" --model "$dir" --listen 127.0.0.1:0 --metrics-listen off \
      --http-listen off "${extra[@]}" "${cmd[@]:1}" >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 6000); do grep -q "serving gRPC on" "$log" && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
    t1=$(date +%s.%N)
    echo "$name $state: serving after $(python3 -c "print(f'{$t1-$t0:.1f}')") s"
    grep -E "checkpoint read|weights loaded" "$log" | sed 's/^/    /' | cut -c1-260
    kill -INT $pid; wait $pid 2>/dev/null; rm -f "$log"
  done
done
