// The pool behind pool_run. Workers are started on first need and live as long as the
// process. A job is published by bumping `generation`; workers take tasks from a shared
// counter, each one task ahead of the one it runs, and count the tasks they finish: the job is
// done when all are, and pool_run returns then. Every started worker acknowledges every job,
// and the next job is published only once all have (so none can lag a job behind): a worker
// that wakes late does not hold up the job it woke for, only, rarely, the next one.
// Between jobs a worker spins for SPIN_NS, then sleeps on a condition variable: a CPU daemon
// gets a call every few hundred microseconds while its parent decodes, a CPU parent calls the
// kernels several times a layer, and a sleeping worker takes tens of microseconds to wake.
// Spinning threads yield the CPU every YIELD_EVERY turns: where threads outnumber free cores
// (daemons and a parent on one host, other programs), a spinning waiter would otherwise hold
// the core the thread it waits for needs.
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define SPIN_NS 2000000
#define YIELD_EVERY 256

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int sleeping;                       // workers waiting on `wake` (under `lock`)
    int workers;                        // started, numbered 1..workers
    uint64_t started_at;                // the generation before the newest workers' first job
    atomic_uint_fast64_t generation;    // bumped once per job
    // the current job
    task_fn fn;
    void* context;
    int64_t tasks;
    int threads;
    atomic_int_fast64_t next_task;
    atomic_int_fast64_t done_tasks;     // tasks of the current job run to the end
    atomic_int acknowledged;            // workers done with the current job
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

// One turn of a spin: a pause, and every YIELD_EVERY turns the CPU to whoever waits for it.
static inline void relax(int turn) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
    if (turn % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_tasks(int thread) {
    int64_t task = atomic_fetch_add_explicit(&pool.next_task, 1, memory_order_relaxed), next, ran = 0;
    for (; task < pool.tasks; task = next, ran++) {
        next = atomic_fetch_add_explicit(&pool.next_task, 1, memory_order_relaxed);
        pool.fn(pool.context, task, next < pool.tasks ? next : -1, thread);
    }
    if (ran) atomic_fetch_add_explicit(&pool.done_tasks, ran, memory_order_release);
}

void pool_wait(const atomic_int_fast64_t* counter, int64_t value) {
    for (int i = 0; atomic_load_explicit(counter, memory_order_acquire) < value; i++) relax(i);
}

static uint64_t wait_for_job(uint64_t seen) {
    int64_t spin_until = now_ns() + SPIN_NS;
    for (int i = 0;; i++) {
        uint64_t generation = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (generation != seen) return generation;
        relax(i);
        if (i % YIELD_EVERY == YIELD_EVERY - 1 && now_ns() > spin_until) break;
    }
    pthread_mutex_lock(&pool.lock);
    pool.sleeping++;
    while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    pool.sleeping--;
    pthread_mutex_unlock(&pool.lock);
    return atomic_load_explicit(&pool.generation, memory_order_acquire);
}

static void* worker(void* arg) {
    int thread = (int)(intptr_t)arg;
    uint64_t seen = pool.started_at;    // not the generation now: the first job may be out already
    for (;;) {
        seen = wait_for_job(seen);
        if (thread < pool.threads) run_tasks(thread);
        atomic_fetch_add_explicit(&pool.acknowledged, 1, memory_order_release);
    }
    return NULL;
}

static void start_workers(int wanted) {
    pool.started_at = atomic_load_explicit(&pool.generation, memory_order_relaxed);
    while (pool.workers < wanted) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, worker, (void*)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) return;             // run with the workers there are
        pool.workers++;
    }
}

// A forked child has none of the parent's threads.
static void forget_workers(void) {
    pool.workers = 0;
    pool.sleeping = 0;
    atomic_store_explicit(&pool.acknowledged, 0, memory_order_relaxed);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_workers); }

void pool_run(int threads, int64_t tasks, task_fn fn, void* context) {
    static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > tasks) threads = (int)tasks;
    if (threads <= 1) {
        for (int64_t task = 0; task < tasks; task++) fn(context, task, task + 1 < tasks ? task + 1 : -1, 0);
        return;
    }
    pthread_once(&fork_handler, watch_forks);
    for (int i = 0; atomic_load_explicit(&pool.acknowledged, memory_order_acquire) < pool.workers; i++) relax(i);
    start_workers(threads - 1);
    if (threads > pool.workers + 1) threads = pool.workers + 1;
    pool.fn = fn;
    pool.context = context;
    pool.tasks = tasks;
    pool.threads = threads;
    atomic_store_explicit(&pool.next_task, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.done_tasks, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.acknowledged, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_tasks(0);
    for (int i = 0; atomic_load_explicit(&pool.done_tasks, memory_order_acquire) < tasks; i++) relax(i);
}
