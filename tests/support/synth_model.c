#include "support/synth_model.h"

#include <stdlib.h>
#include <unistd.h>

ks_status ks_synth_model(const char *preset, int n_layer, uint64_t seed, threads_pool *pool, struct model **out)
{
    struct model_synth_spec spec;
    ks_status st = model_synth_preset(preset, &spec);
    if (st)
        return st;
    if (n_layer > 0)
        spec.n_layer = n_layer;
    if (seed > 0)
        spec.seed = seed;
    char path[] = "/tmp/ks_synth_model_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0)
        return ks_fail(KS_ERR_IO, "no temporary file for the synthesized model");
    close(fd);
    st = model_synth(&spec, "q8_0", NULL, path, pool);
    if (!st)
        st = model_load(path, out);
    unlink(path);
    return st;
}
