// Which instruction set's kernels run: the best this CPU has among those built (the build
// leaves out a variant its compiler cannot make, hence the weak references), or one named.
#include <string.h>
#include "moe_cpu.h"
#if defined(__x86_64__)
#include <cpuid.h>
#endif

extern const struct isa_kernels isa_scalar;
#if defined(__x86_64__)
extern const struct isa_kernels isa_avx2 __attribute__((weak));
extern const struct isa_kernels isa_avx512 __attribute__((weak));
extern const struct isa_kernels isa_amx __attribute__((weak));
int amx_usable(void) __attribute__((weak));        // isa_amx.c: the tiles usable by this process
#elif defined(__aarch64__)
extern const struct isa_kernels isa_neon __attribute__((weak));
#endif

// Best first.
static const struct isa_kernels* candidates[4];
static int usable[4];
static int n_candidates;
static const struct isa_kernels* selected;

static void add(const struct isa_kernels* isa, int runs_here) {
    if (isa) {
        candidates[n_candidates] = isa;
        usable[n_candidates++] = runs_here;
    }
}

static void find_candidates(void) {
    if (n_candidates) return;
#if defined(__x86_64__)
    __builtin_cpu_init();
    unsigned eax, ebx, ecx = 0, edx;
    __get_cpuid(1, &eax, &ebx, &ecx, &edx);       // F16C: clang's __builtin_cpu_supports does not know it
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && (ecx & bit_F16C);
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    add(&isa_amx, avx512 && amx_usable && amx_usable());
    add(&isa_avx512, avx512);
    add(&isa_avx2, avx2);
#elif defined(__aarch64__)
    add(&isa_neon, 1);
#endif
    add(&isa_scalar, 1);
}

const struct isa_kernels* current_isa(void) {
    if (!selected) {
        find_candidates();
        for (int i = 0; !selected; i++)
            if (usable[i]) selected = candidates[i];
    }
    return selected;
}

int moe_isa_count(void) {
    find_candidates();
    int count = 0;
    for (int i = 0; i < n_candidates; i++) count += usable[i];
    return count;
}

const char* moe_isa_name(int index) {
    find_candidates();
    for (int i = 0; i < n_candidates; i++)
        if (usable[i] && index-- == 0) return candidates[i]->name;
    return NULL;
}

const char* moe_current_isa(void) { return current_isa()->name; }

int64_t moe_unit_tokens(void) { return current_isa()->unit ? current_isa()->unit->least_tokens : 0; }

int moe_use_isa(const char* name) {
    find_candidates();
    for (int i = 0; i < n_candidates; i++)
        if (usable[i] && strcmp(candidates[i]->name, name) == 0) {
            selected = candidates[i];
            return 1;
        }
    return 0;
}
