// x86-64 with AVX-512 F/BW/VL (Skylake-X, Zen 4 and later): 16 floats, 32 registers.
#include "avx512.h"

#define ISA_NAME "avx512"
#define ISA_TABLE isa_avx512

#include "tiles.h"
