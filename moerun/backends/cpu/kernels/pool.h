// A pool of worker threads that run a job's tasks with the calling thread.
#pragma once
#include <stdatomic.h>
#include <stdint.h>

#define MAX_THREADS 256

// fn(context, task, next, thread) for every task in 0..tasks-1, spread over `threads` threads
// (the caller is thread 0); returns when all have run. Not reentrant: one job at a time.
// Threads take tasks in ascending order; `next` is the task this thread runs after this one
// (-1: none), taken ahead so that a task can fetch the next one's first data into the caches
// while it runs.
typedef void (*task_fn)(void* context, int64_t task, int64_t next, int thread);
void pool_run(int threads, int64_t tasks, task_fn fn, void* context);

// Within a task: wait until *counter >= value (acquire), spinning, with the CPU yielded now and
// then. A task may wait only for what tasks numbered before it do: those were taken already,
// and their threads wait for nothing later, so the wait ends.
void pool_wait(const atomic_int_fast64_t* counter, int64_t value);
