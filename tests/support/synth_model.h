/* A `kvserve synth` model made for a test and loaded: the preset at q8_0
 * (repacked: batch-invariant), written to a temporary file that is removed
 * once loaded. */
#ifndef KS_TEST_SYNTH_MODEL_H
#define KS_TEST_SYNTH_MODEL_H

#include <stdint.h>

#include "model/model.h"
#include "status/status.h"
#include "threads/threads.h"

/* n_layer, seed: > 0 to override the preset's. model_synth_preset's,
 * model_synth's and model_load's errors; KS_ERR_IO when no temporary file. */
ks_status ks_synth_model(const char *preset, int n_layer, uint64_t seed, threads_pool *pool, struct model **out);

#endif
