# Shared by the bench scripts that run kvserve and llama.cpp side by side (sourced, not run).
# The caller sets: tmp (a scratch directory), anchor (llama.cpp's bin directory), bin (kvserve),
# model, THREADS; and may set LLAMA_CPU to keep only that CPU variant of llama.cpp (haswell = AVX2).

# The anchor's shared-library links may arrive as small text files naming their target (a copy that
# lost its symlinks): run llama.cpp from a mirror with real links, the executables copied beside them.
anchor_mirror() {
  local m=$tmp/anchor f n
  mkdir -p "$m"
  for f in "$anchor"/*; do
    n=$(basename "$f")
    if [ -n "${LLAMA_CPU:-}" ] && [[ $n == libggml-cpu-* ]] && [ "$n" != "libggml-cpu-$LLAMA_CPU.so" ]; then continue; fi
    if [ "$(stat -c %s "$f")" -lt 64 ] && grep -qx '[A-Za-z0-9._-]*' "$f"; then ln -sf "$(cat "$f")" "$m/$n"
    elif [ -x "$f" ] && [[ $n != *.so* ]]; then cp "$f" "$m/$n" # $ORIGIN must be the mirror
    else ln -sf "$f" "$m/$n"; fi
  done
  anchor=$m
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # url
  for _ in $(seq 1200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && return 0
    kill -0 "$pid" 2>/dev/null || { echo "server exited"; cat "$tmp/server.log"; exit 1; }
    sleep 0.1
  done
  echo "server not ready in 120 s"; cat "$tmp/server.log"; exit 1
}
start_kvserve() { # args...
  port=$(free_port); url=http://127.0.0.1:$port
  "$bin" serve -m "$model" --port "$port" -t "$THREADS" "$@" 2>"$tmp/server.log" & pid=$!
  wait_ready "$url"
}
start_llama() { # args...
  port=$(free_port); url=http://127.0.0.1:$port
  "$anchor/llama-server" -m "$model" --port "$port" -t "$THREADS" --metrics "$@" >"$tmp/server.log" 2>&1 & pid=$!
  wait_ready "$url"
}
stop() { kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=; }
metric() { # name -> value (0 if absent)
  curl -s "$url/metrics" | awk -v n="$1" '$1 == n { v = $2 } END { printf "%.0f\n", v + 0 }'
}
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
now() { date +%s.%N; }
cpu() { echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(grep -o -m1 'avx512f' /proc/cpuinfo || echo 'no avx512')"; }
# REPS rounds of "FN kvserve K" then "FN llama K"; their lines go to $tmp/kv and $tmp/ll.
interleave() { # fn k
  : >"$tmp/kv"; : >"$tmp/ll"
  for _ in $(seq "$REPS"); do
    "$1" kvserve "$2" >>"$tmp/kv"
    "$1" llama "$2" >>"$tmp/ll"
  done
}
col_median() { cut -d' ' -f"$2" "$1" | median; } # file column
