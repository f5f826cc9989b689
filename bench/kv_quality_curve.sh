#!/bin/sh
# KV cache quality against memory: mean KL divergence (against an f32 cache)
# of `kvserve perplexity` for the static cache types and for the dynamic
# policy at fractions of the bytes one chunk needs at f16, as a table on
# stdout, a TSV and an SVG plot.
#
#   bench/kv_quality_curve.sh [BUILD_DIR] [MODEL.gguf] [TEXT] [OUT.svg]
#
# Defaults: build, ../shared/models/trained/tiny-llama-gqa-hd64-f32.gguf, its
# sample.txt, docs/kv_quality_curve.svg (the TSV goes beside it). Environment:
#   CTX (512)  chunk size;   BATCH (64)  -b of the runs (a server-like prefill
#   chunk);   SINK (32) HOT (64)  --kv-sink / --kv-hot of the dynamic runs;
#   FRACTIONS  the dynamic budgets as fractions of a chunk's f16 bytes;
#   ONE_BATCH (1)  also run the dynamic policy with -b CTX (the whole chunk at
#   once);   CHUNKS (all)  --chunks;   THREADS (2);   TITLE  the plot's title;
#   BASE  an f32-cache --save-logits file of the same text and -c to reuse
#   (skips that run);   F16_BYTES  one chunk's bytes at f16 (skips the run
#   that measures it; PAGE (32) is then the --kv-page);   STATIC_TYPES  the
#   static K/V pairs;   LADDER  --kv-ladder of the dynamic runs, its last type
#   their --kv-floor too (e.g. q8_0,q4_0,iq3_nl; the series is named "... to
#   iq3_nl");   STATIC (1)  0 skips the static rows;   APPEND (0)  1
#   adds rows to an existing TSV (e.g. more fractions) instead of starting it;
#   REFS  reference lines, "LABEL=KLD;LABEL=KLD" (default for the trained
#   model: llama.cpp's values from ../shared/ref/quality.md).
set -eu
BUILD=${1:-build}
MODEL=${2:-../shared/models/trained/tiny-llama-gqa-hd64-f32.gguf}
TEXT=${3:-../shared/models/trained/sample.txt}
SVG=${4:-docs/kv_quality_curve.svg}
CTX=${CTX:-512} BATCH=${BATCH:-64} SINK=${SINK:-32} HOT=${HOT:-64} THREADS=${THREADS:-2}
FRACTIONS=${FRACTIONS:-"0.28125 0.30 0.35 0.40 0.45 0.50 0.60 0.70"}
ONE_BATCH=${ONE_BATCH:-1}
TITLE=${TITLE:-"$(basename "$MODEL"), c=$CTX, sinks $SINK, hot $HOT"}
case $MODEL in
*tiny-llama-gqa-hd64-f32.gguf) DEFAULT_REFS="llama.cpp q8_0/q4_0=8.05e-4;llama.cpp q4_0/q4_0=3.935e-3" ;;
*) DEFAULT_REFS="" ;;
esac
REFS=${REFS-$DEFAULT_REFS}
BIN=$BUILD/kvserve
TSV=${SVG%.svg}.tsv
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
CHUNK_FLAG=${CHUNKS:+--chunks $CHUNKS}

# ppl ARGS...: one --json line of kvserve perplexity with the common flags
ppl() {
    # shellcheck disable=SC2086
    "$BIN" perplexity -m "$MODEL" -f "$TEXT" -c "$CTX" -t "$THREADS" $CHUNK_FLAG --json "$@"
}
field() { python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print($1)"; }

BASE_FILE=${BASE:-$WORK/base.bin}
[ -n "${BASE:-}" ] || ppl -ctk f32 -ctv f32 -b "$BATCH" --save-logits "$BASE_FILE" > /dev/null
# a static run's default budget is the chunk's pages plus one spare page
if [ -z "${F16_BYTES:-}" ]; then
    probe=$(ppl -ctk f16 -ctv f16 --chunks 1)
    PAGE=$(echo "$probe" | field "d['cache']['page']")
    F16_BYTES=$(echo "$probe" | field "d['cache']['mem'] * -(-$CTX // $PAGE) // (-(-$CTX // $PAGE) + 1)")
fi
PAGES=$(python3 -c "print(-(-$CTX // ${PAGE:-32}))")
echo "one chunk of $CTX tokens at f16: $F16_BYTES bytes" >&2

[ "${APPEND:-0}" = 1 ] || printf 'series\tk\tv\tfraction\tbytes\tppl\tkld_mean\tkld_p99\ttop1\n' > "$TSV"
# row SERIES K V ARGS...: run against the base and append a TSV row
row() {
    series=$1 k=$2 v=$3
    shift 3
    if ! out=$(ppl --kl-base "$BASE_FILE" -ctk "$k" -ctv "$v" "$@" 2> "$WORK/err"); then
        echo "$series $k/$v $*: $(tail -1 "$WORK/err")" >&2
        return 0
    fi
    spare=$([ "$series" = static ] && echo "$PAGES / ($PAGES + 1)" || echo 1)
    echo "$out" | field "'\t'.join(map(str, ['$series', '$k', '$v', d['cache']['mem'] * $spare / $F16_BYTES, d['cache']['mem'] * $spare,
        d['ppl'], d['kld_mean'], d['kld_p99'], d['top1']]))" >> "$TSV"
}

[ "${STATIC:-1}" = 0 ] || for kv in ${STATIC_TYPES:-f16/f16 q8_0/q8_0 q8_0/q4_0 q4_0/q4_0}; do
    row static "${kv%/*}" "${kv#*/}" -b "$BATCH"
done
LADDER_FLAGS="" SUFFIX=""
if [ -n "${LADDER:-}" ]; then
    LADDER_FLAGS="--kv-ladder $LADDER --kv-floor ${LADDER##*,}" SUFFIX=" to ${LADDER##*,}"
fi
for f in $FRACTIONS; do
    bytes=$(python3 -c "print(int($f * $F16_BYTES))")
    # shellcheck disable=SC2086
    row "dynamic -b $BATCH$SUFFIX" f16 f16 -b "$BATCH" --kv-policy dynamic --kv-mem "$bytes" --kv-sink "$SINK" \
        --kv-hot "$HOT" $LADDER_FLAGS
    if [ "$ONE_BATCH" = 1 ]; then
        # shellcheck disable=SC2086
        row "dynamic -b $CTX$SUFFIX" f16 f16 -b "$CTX" --kv-policy dynamic --kv-mem "$bytes" --kv-sink "$SINK" \
            --kv-hot "$HOT" $LADDER_FLAGS
    fi
done

IFS=';'
# shellcheck disable=SC2086
python3 "$(dirname "$0")/kv_quality_svg.py" "$TSV" "$SVG" "$TITLE" $REFS
unset IFS
python3 - "$TSV" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter='\t'))
print('| series | K/V | memory (of f16) | PPL | mean KLD | KLD p99 | same top-1 |')
print('|---|---|---|---|---|---|---|')
for r in rows:
    print('| %s | %s/%s | %.1f%% | %.4f | %.3e | %.3e | %.2f%% |' % (r['series'], r['k'], r['v'],
          100 * float(r['fraction']), float(r['ppl']), float(r['kld_mean']), float(r['kld_p99']), 100 * float(r['top1'])))
PY
echo "wrote $TSV and $SVG" >&2
