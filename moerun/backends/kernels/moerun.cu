// Every kernel moerun launches, as one module for CuPy's RawModule and for hipcc.
#include "gemv.cu"
#include "gemv_q8.cu"
#include "dequant.cu"
#include "layers.cu"
#include "moe_prefill.cu"
#include "moe_mm.cu"
#include "remote.cu"
#include "route.cu"
