/* model: the order in which ggml's CPU argsort puts a row of router
 * probabilities, equal values included.
 *
 * llama.cpp picks a token's experts with ggml_argsort_top_k: an argsort of
 * the probabilities in descending order (indices 0..n-1 sorted by
 * std::sort with the comparator v[a] > v[b]), then the first k. std::sort is
 * not stable, so which of several equal probabilities come first is whatever
 * libstdc++'s introsort does with them. This file is that algorithm, step by
 * step (introsort loop with a median-of-three pivot and an unguarded
 * partition, heapsort below the depth limit, then the final insertion sort,
 * with the 16-element threshold), so that ties pick the experts llama.cpp
 * picks. For rows of at most 16 it is a plain insertion sort: stable, equal
 * values in index order. */
#include "model/model_internal.h"

#define SORT_THRESHOLD 16 /* libstdc++'s _S_threshold */

struct sorter {
    const float *v;
    int32_t *a;
};

/* the comparator: a sorts before b */
static bool before(const struct sorter *s, int32_t a, int32_t b) { return s->v[a] > s->v[b]; }

static void swap_at(int32_t *a, int i, int j)
{
    int32_t t = a[i];
    a[i] = a[j];
    a[j] = t;
}

/* ---- heapsort (std::__partial_sort with middle == last) ----------------------- */

static void push_heap(struct sorter *s, int first, int hole, int top, int32_t value)
{
    int parent = (hole - 1) / 2;
    while (hole > top && before(s, s->a[first + parent], value)) {
        s->a[first + hole] = s->a[first + parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    s->a[first + hole] = value;
}

static void adjust_heap(struct sorter *s, int first, int hole, int len, int32_t value)
{
    int top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(s, s->a[first + child], s->a[first + child - 1]))
            child--;
        s->a[first + hole] = s->a[first + child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        s->a[first + hole] = s->a[first + child - 1];
        hole = child - 1;
    }
    push_heap(s, first, hole, top, value);
}

static void heap_sort(struct sorter *s, int first, int last)
{
    int len = last - first;
    if (len < 2)
        return;
    for (int parent = (len - 2) / 2;; parent--) {
        adjust_heap(s, first, parent, len, s->a[first + parent]);
        if (parent == 0)
            break;
    }
    for (int end = last - 1; end - first > 0; end--) {
        int32_t value = s->a[end];
        s->a[end] = s->a[first];
        adjust_heap(s, first, 0, end - first, value);
    }
}

/* ---- introsort ------------------------------------------------------------------ */

static void move_median_to_first(struct sorter *s, int result, int a, int b, int c)
{
    const int32_t *x = s->a;
    if (before(s, x[a], x[b])) {
        if (before(s, x[b], x[c]))
            swap_at(s->a, result, b);
        else if (before(s, x[a], x[c]))
            swap_at(s->a, result, c);
        else
            swap_at(s->a, result, a);
    } else if (before(s, x[a], x[c])) {
        swap_at(s->a, result, a);
    } else if (before(s, x[b], x[c])) {
        swap_at(s->a, result, c);
    } else {
        swap_at(s->a, result, b);
    }
}

static int unguarded_partition(struct sorter *s, int first, int last, int pivot)
{
    for (;;) {
        while (before(s, s->a[first], s->a[pivot]))
            first++;
        last--;
        while (before(s, s->a[pivot], s->a[last]))
            last--;
        if (!(first < last))
            return first;
        swap_at(s->a, first, last);
        first++;
    }
}

static void introsort_loop(struct sorter *s, int first, int last, int depth_limit)
{
    while (last - first > SORT_THRESHOLD) {
        if (depth_limit == 0) {
            heap_sort(s, first, last);
            return;
        }
        depth_limit--;
        int mid = first + (last - first) / 2;
        move_median_to_first(s, first, first + 1, mid, last - 1);
        int cut = unguarded_partition(s, first + 1, last, first);
        introsort_loop(s, cut, last, depth_limit);
        last = cut;
    }
}

static void unguarded_linear_insert(struct sorter *s, int last)
{
    int32_t value = s->a[last];
    int next = last - 1;
    while (before(s, value, s->a[next])) {
        s->a[last] = s->a[next];
        last = next;
        next--;
    }
    s->a[last] = value;
}

static void insertion_sort(struct sorter *s, int first, int last)
{
    for (int i = first + 1; i < last; i++) {
        if (before(s, s->a[i], s->a[first])) {
            int32_t value = s->a[i];
            for (int j = i; j > first; j--)
                s->a[j] = s->a[j - 1];
            s->a[first] = value;
        } else {
            unguarded_linear_insert(s, i);
        }
    }
}

static int floor_log2(int n)
{
    int k = 0;
    while (n >>= 1)
        k++;
    return k;
}

void model_argsort_desc(const float *v, int n, int32_t *idx)
{
    for (int i = 0; i < n; i++)
        idx[i] = i;
    if (n < 2)
        return;
    struct sorter s = {v, idx};
    introsort_loop(&s, 0, n, 2 * floor_log2(n));
    if (n > SORT_THRESHOLD) {
        insertion_sort(&s, 0, SORT_THRESHOLD);
        for (int i = SORT_THRESHOLD; i < n; i++)
            unguarded_linear_insert(&s, i);
    } else {
        insertion_sort(&s, 0, n);
    }
}
