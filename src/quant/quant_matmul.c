/* quant: matrix multiply over the traits table. */
#include <string.h>

#include "quant/quant_internal.h"

size_t quant_matmul_work_size(enum quant_type wtype, int64_t cols, int64_t n_tokens)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || cols <= 0 || n_tokens <= 0)
        return 0;
    size_t row = quant_row_size(tr->vec_dot_type, cols);
    return row * (size_t)n_tokens;
}

ks_status quant_matmul(threads_pool *pool, const void *W, enum quant_type wtype, int64_t rows,
                       int64_t cols, const float *X, int64_t n_tokens, float *Y, void *work,
                       size_t work_size)
{
    (void)pool;
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || !tr->vec_dot)
        return ks_fail(KS_ERR_UNSUPPORTED, "matmul: weight type %s has no kernels", quant_type_name(wtype));
    const struct quant_traits *dt = quant_traits(tr->vec_dot_type);
    size_t wrow = quant_row_size(wtype, cols), xrow = quant_row_size(tr->vec_dot_type, cols);
    if (wrow == 0 || xrow == 0 || rows <= 0 || n_tokens <= 0)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul: bad shape %lld x %lld for %s", (long long)rows,
                       (long long)cols, tr->name);
    if (work_size < quant_matmul_work_size(wtype, cols, n_tokens))
        return ks_fail(KS_ERR_INVALID_ARG, "matmul: work buffer too small");
    for (int64_t t = 0; t < n_tokens; t++) {
        if (tr->vec_dot_type == QUANT_F32)
            memcpy((char *)work + t * xrow, X + t * cols, xrow);
        else
            dt->from_float(X + t * cols, (char *)work + t * xrow, cols);
    }
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t r = 0; r < rows; r++)
            tr->vec_dot((int)cols, &Y[t * rows + r], (const char *)W + r * wrow, (const char *)work + t * xrow);
    return KS_OK;
}

ks_status quant_get_row(const void *W, enum quant_type wtype, int64_t cols, int64_t r, float *y)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || !tr->to_float)
        return ks_fail(KS_ERR_UNSUPPORTED, "get_row: type %s cannot be converted to f32", quant_type_name(wtype));
    size_t wrow = quant_row_size(wtype, cols);
    if (wrow == 0 || r < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "get_row: bad row %lld of width %lld for %s", (long long)r,
                       (long long)cols, tr->name);
    tr->to_float((const char *)W + r * wrow, y, cols);
    return KS_OK;
}
