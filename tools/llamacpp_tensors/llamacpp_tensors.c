/* llamacpp_tensors: every intermediate tensor llama.cpp computes, to compare
 * kvserve with it op by op (which op first stops being bit-identical).
 *
 * A preload library for the anchor's dumpref (../shared/anchor/bin): it wraps
 * llama_init_from_model, sets the context's eval callback, and writes each
 * contiguous f32 tensor the graph computes to $LLAMACPP_TENSORS_OUT as
 * records of
 *   char name[64]  ggml's tensor name ("attn_norm-0", "Qcur-0", "kqv_out-0",
 *                  "ffn_swiglu-0", "l_out-0", ...; a name can repeat: the
 *                  first record is the op's output, later ones views of it)
 *   int32 graph    -1 for the prompt's batch, then 0, 1, ... per decode step
 *   int64 ne[4]    ggml's shape, ne[0] fastest (a row per token for 2-D ones)
 *   float data[ne0 * ne1 * ne2 * ne3]
 * dumpref's logits and greedy ids come out unchanged (the callback only
 * reads), so the records are those of the reference run.
 *
 *   gcc -shared -fPIC -O1 tools/llamacpp_tensors/llamacpp_tensors.c -o /tmp/lt.so \
 *       -L../shared/anchor/bin -l:libggml-base.so.0 -Wl,-rpath,$PWD/../shared/anchor/bin
 *   LLAMACPP_TENSORS_OUT=/tmp/q2k.bin LD_PRELOAD=/tmp/lt.so \
 *       ../shared/anchor/bin/dumpref -m Q2_K.gguf --ids 1,598,340 -o /tmp/q2k
 *
 * llama.h is not on this machine, so the one field set is found by offset:
 * cb_eval at CB_EVAL_OFFSET of struct llama_context_params in the anchor's
 * build (34af94cd). The wrapper checks that the fields around it hold
 * llama_context_default_params()'s values (NULL callback and user data,
 * type_k = type_v = f16 right after) and refuses to run otherwise. Not part
 * of kvserve or its tests: a tool for exactness work (README, "Correctness
 * against llama.cpp"). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CB_EVAL_OFFSET 88
#define GGML_TYPE_F32 0
#define GGML_TYPE_F16 1

/* Large enough for llama_context_params; passed by value, on the stack. */
struct params_bytes {
    unsigned char b[512];
};

struct ggml_tensor;
const char *ggml_get_name(const struct ggml_tensor *t);
void *ggml_get_data(const struct ggml_tensor *t);
bool ggml_is_contiguous(const struct ggml_tensor *t);

static FILE *g_out;
static int32_t g_graph = -1; /* the prompt; each graph ends with "result_output" */

/* ggml_tensor starts with its type (int) and, at byte 16, ne[4] (int64):
 * ggml.h's layout since its first release. */
static void tensor_shape(const struct ggml_tensor *t, int *type, int64_t ne[4])
{
    memcpy(type, t, sizeof *type);
    memcpy(ne, (const unsigned char *)t + 16, 4 * sizeof ne[0]);
}

static bool on_tensor(struct ggml_tensor *t, bool ask, void *user)
{
    (void)user;
    if (ask)
        return true; /* every tensor */
    const char *name = ggml_get_name(t);
    int type;
    int64_t ne[4];
    tensor_shape(t, &type, ne);
    if (type != GGML_TYPE_F32 || !ggml_is_contiguous(t))
        return true;
    char rec_name[64] = {0};
    snprintf(rec_name, sizeof rec_name, "%s", name);
    fwrite(rec_name, 1, sizeof rec_name, g_out);
    fwrite(&g_graph, sizeof g_graph, 1, g_out);
    fwrite(ne, sizeof ne[0], 4, g_out);
    fwrite(ggml_get_data(t), sizeof(float), (size_t)(ne[0] * ne[1] * ne[2] * ne[3]), g_out);
    if (!strcmp(name, "result_output"))
        g_graph++;
    return true;
}

static bool layout_as_expected(const struct params_bytes *p)
{
    void *cb, *user;
    int32_t type_k, type_v;
    memcpy(&cb, p->b + CB_EVAL_OFFSET, sizeof cb);
    memcpy(&user, p->b + CB_EVAL_OFFSET + 8, sizeof user);
    memcpy(&type_k, p->b + CB_EVAL_OFFSET + 16, sizeof type_k);
    memcpy(&type_v, p->b + CB_EVAL_OFFSET + 20, sizeof type_v);
    struct params_bytes (*defaults)(void) = (struct params_bytes (*)(void))dlsym(RTLD_NEXT,
                                                                                 "llama_context_default_params");
    if (!defaults || cb || user)
        return false;
    struct params_bytes d = defaults();
    int32_t dk, dv;
    memcpy(&dk, d.b + CB_EVAL_OFFSET + 16, sizeof dk);
    memcpy(&dv, d.b + CB_EVAL_OFFSET + 20, sizeof dv);
    /* dumpref sets the cache types; the defaults must be f16 there */
    return dk == GGML_TYPE_F16 && dv == GGML_TYPE_F16 && type_k >= 0 && type_v >= 0;
}

void *llama_init_from_model(void *model, struct params_bytes params)
{
    void *(*real)(void *, struct params_bytes) =
        (void *(*)(void *, struct params_bytes))dlsym(RTLD_NEXT, "llama_init_from_model");
    const char *path = getenv("LLAMACPP_TENSORS_OUT");
    if (!real || !path || !layout_as_expected(&params)) {
        fprintf(stderr, "llamacpp_tensors: LLAMACPP_TENSORS_OUT unset or llama_context_params not as expected; "
                        "not recording\n");
        return real ? real(model, params) : NULL;
    }
    if (!(g_out = fopen(path, "wb"))) {
        perror(path);
        exit(1);
    }
    void *cb = (void *)on_tensor;
    memcpy(params.b + CB_EVAL_OFFSET, &cb, sizeof cb);
    return real(model, params);
}
