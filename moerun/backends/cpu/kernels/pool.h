// A pool of worker threads that run a job's tasks with the calling thread.
#pragma once
#include <stdint.h>

#define MAX_THREADS 256

// fn(context, task, thread) for every task in 0..tasks-1, spread over `threads` threads
// (the caller is thread 0); returns when all have run. Not reentrant: one job at a time.
typedef void (*task_fn)(void* context, int64_t task, int thread);
void pool_run(int threads, int64_t tasks, task_fn fn, void* context);
