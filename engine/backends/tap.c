/* The llama.cpp backend's evaluation callback, answering in C which graph nodes a step wants.

   llama.cpp asks the callback about every node of every graph evaluation (about a thousand a step on the default
   model), and a call from C into Python costs more than the answer: these calls were most of what capturing cost
   (BENCHMARKS.md, "Why every capture costs"). Here the names are matched without Python; only a node that is wanted
   reaches Python's callback, once computed, to be read. engine/backends/llamacpp.py builds this file with the C
   compiler when one is there (its _Tap matches the same names in Python otherwise) and fills `struct lab_tap`. */

#include <stdbool.h>
#include <string.h>

#define LAB_MAX_LAYERS 4096

typedef bool (*lab_read)(void *tensor, bool ask, void *user_data);

struct lab_tap {
    int active;                          /* 0: no node is wanted, answer at once */
    int residual;                        /* the residual stream: every l_out-N and the embedding */
    long name_offset;                    /* offsetof(struct ggml_tensor, name), from the caller's mirror of it */
    lab_read read;                       /* Python's callback, for a wanted node once it is computed */
    unsigned char layers[LAB_MAX_LAYERS];   /* 1: this layer's attention (kq_soft_max-N) is wanted */
};

/* A layer number: decimal digits to the end of the name, below LAB_MAX_LAYERS; -1 otherwise. */
static long layer_of(const char *s) {
    long n = 0;
    if (*s == '\0') return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        n = n * 10 + (*s - '0');
        if (n >= LAB_MAX_LAYERS) return -1;
    }
    return n;
}

bool lab_tap_eval(void *tensor, bool ask, void *user_data) {
    struct lab_tap *tap = (struct lab_tap *) user_data;
    if (!tap->active) return false;
    if (!ask) return tap->read(tensor, false, NULL);
    const char *name = (const char *) tensor + tap->name_offset;
    if (strncmp(name, "kq_soft_max-", 12) == 0) {
        long n = layer_of(name + 12);
        return n >= 0 && tap->layers[n];
    }
    if (!tap->residual) return false;
    if (strncmp(name, "l_out-", 6) == 0) return layer_of(name + 6) >= 0;
    return strcmp(name, "embd") == 0 || strcmp(name, "inp_embd") == 0 || strcmp(name, "inp_scaled") == 0;
}
