#!/bin/sh
# KV quality with and without smoothing (--kv-smooth): PPL, mean and p99 KL
# divergence against an f32 cache, and top-1 agreement of `kvserve perplexity`
# for each K/V pair and smoothing mode, as a markdown table on stdout.
#
#   bench/kv_smooth_table.sh [BUILD_DIR] [MODEL.gguf] [TEXT]
#
# Defaults: build, ../shared/models/trained/tiny-llama-gqa-hd64-f32.gguf, its
# sample.txt. Environment: CHUNKS (40), CTX (512), THREADS (1), PAIRS (the K/V
# pairs), MODES (off k v kv), EXTRA (more flags for every compared run, e.g.
# the dynamic policy's), BASE (an f32-cache --save-logits file to reuse).
set -eu
BUILD=${1:-build}
MODEL=${2:-../shared/models/trained/tiny-llama-gqa-hd64-f32.gguf}
TEXT=${3:-../shared/models/trained/sample.txt}
CHUNKS=${CHUNKS:-40} CTX=${CTX:-512} THREADS=${THREADS:-1}
PAIRS=${PAIRS:-"q8_0/q8_0 q8_0/q4_0 q4_0/q4_0 q5_0/q5_0 q4_1/q4_1 iq4_nl/iq4_nl"}
MODES=${MODES:-"off k v kv"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

ppl() {
    "$BUILD/kvserve" perplexity -m "$MODEL" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" --json "$@"
}
BASE_FILE=${BASE:-$WORK/base.bin}
[ -n "${BASE:-}" ] || ppl -ctk f32 -ctv f32 --save-logits "$BASE_FILE" > /dev/null

echo "| K / V | smooth | PPL | mean KLD | KLD p99 | same top-1 |"
echo "|---|---|---|---|---|---|"
for kv in $PAIRS; do
    for mode in $MODES; do
        # shellcheck disable=SC2086
        ppl -ctk "${kv%/*}" -ctv "${kv#*/}" --kv-smooth "$mode" --kl-base "$BASE_FILE" ${EXTRA:-} |
            python3 -c "import json,sys; d=json.loads(sys.stdin.read()); \
print('| $kv | $mode | %.4f | %.4e | %.4e | %.2f%% |' % (d['ppl'], d['kld_mean'], d['kld_p99'], 100 * d['top1']))"
    done
done
