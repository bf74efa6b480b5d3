// Plain C: every machine has it (what the compiler vectorizes by itself, it does).
typedef float vf;
#define VL 1
#define NT_MAX 1
#define ISA_NAME "scalar"
#define ISA_TABLE isa_scalar

static inline vf vf_zero(void) { return 0.f; }
static inline vf vf_load(const float* p) { return *p; }
static inline vf vf_fma(vf acc, vf a, vf b) { return acc + a * b; }
static inline float vf_sum(vf v) { return v; }

#include "tiles.h"
