/* Eval callback for llama.cpp that copies one named tensor (l_out-<L>) out of each graph
 * computation. Compiled on first use by srsd_local/capture.py; ggml's functions are passed in
 * as pointers, so nothing is linked. Python falls back to its own callback without a compiler. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *t);
typedef size_t (*nbytes_fn)(const void *t);
typedef void (*tensor_get_fn)(const void *t, void *data, size_t offset, size_t size);

struct srsd_capture {
    get_name_fn get_name;
    nbytes_fn nbytes;
    tensor_get_fn tensor_get;
    char name[64];
    int32_t enabled;
    int32_t type;
    char *buf;
    size_t cap;
    size_t used;
    int64_t ne0;
    int64_t rows;
    int32_t overflow;
};

bool srsd_capture_cb(void *t, bool ask, void *user) {
    struct srsd_capture *c = (struct srsd_capture *)user;
    if (!c->enabled) return !ask;
    if (strcmp(c->get_name(t), c->name) != 0) return !ask;
    if (ask) return true;
    const int64_t *ne = (const int64_t *)((const char *)t + 16);
    size_t nb = c->nbytes(t);
    if (c->used + nb > c->cap) {
        c->overflow = 1;
        return true;
    }
    c->tensor_get(t, c->buf + c->used, 0, nb);
    c->used += nb;
    c->ne0 = ne[0];
    c->rows += ne[1];
    c->type = *(const int32_t *)t;
    return true;
}
