// A CUDA injection library (CUDA_INJECTION64_PATH) that records every kernel any CUDA program
// runs, graph replays included, with its start and end on the GPU's clock: a timeline where
// Nsight Systems is not installed. Writes "start_ns end_ns name" lines to $KERNEL_TRACE_FILE
// when the program exits. Built and read by scripts/timeline/trace.py.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define BUFFER_BYTES (16 << 20)

static FILE *trace;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = BUFFER_BYTES;
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    CUpti_Activity *record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        CUpti_ActivityKernel10 *kernel = (CUpti_ActivityKernel10 *)record;
        fprintf(trace, "%llu %llu %s\n", (unsigned long long)kernel->start, (unsigned long long)kernel->end,
                kernel->name);
    }
    free(buffer);
}

static void flush_at_exit(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    fclose(trace);
}

int InitializeInjection(void) {
    const char *path = getenv("KERNEL_TRACE_FILE");
    trace = fopen(path ? path : "kernel_trace.txt", "w");
    if (!trace) return 0;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    atexit(flush_at_exit);
    return 1;
}
