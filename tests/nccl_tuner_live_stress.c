/*
 * The live table under fire: THREADS threads call getCollInfo (each on its own communicator, as NCCL's
 * threads do) while the main thread puts two tables in force in turn, RELOADS times. Table A gives every
 * call ring/simple on 2 channels, table B tree/ll on 7: each call must see one of them whole (the cost
 * entry it zeroes and the channels it sets from the same table). For tests/test_live_table.py to run under
 * ThreadSanitizer and AddressSanitizer/UBSan, and for benchmarks/tuner_percall.py to time a call.
 *
 * usage: nccl_tuner_live_stress PLUGIN.so TABLE_A TABLE_B THREADS CALLS RELOADS
 * Each thread makes at least CALLS calls, and goes on until the main thread has made its RELOADS.
 * Prints "calls N mixed M a A b B ns_per_call X"; exit 0 when no call saw a mix.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "lagom_nccl_tuner.h"

typedef int (*reload_fn)(const char*, int, char*, size_t);
typedef int (*publish_fn)(void);

static lagom_nccl_tuner_v6* tuner;
static long calls_per_thread;
static atomic_long mixed, saw_a, saw_b, total_calls;
static atomic_int stop;

static void* caller(void* arg) {
  (void)arg;
  void* ctx = NULL;
  tuner->init(&ctx, 0, 4, 1, NULL, NULL, NULL);
  long i = 0;
  for (; i < calls_per_thread || !atomic_load(&stop); i++) { /* at least CALLS, and until the reloads are over */
    float table[LAGOM_NCCL_ALGORITHMS][LAGOM_NCCL_PROTOCOLS];
    for (int a = 0; a < LAGOM_NCCL_ALGORITHMS; a++) {
      for (int p = 0; p < LAGOM_NCCL_PROTOCOLS; p++) table[a][p] = 1.0f;
    }
    int channels = 0;
    tuner->getCollInfo(ctx, LAGOM_NCCL_ALL_REDUCE, 1u << 20, 1, (float**)table, LAGOM_NCCL_ALGORITHMS,
                       LAGOM_NCCL_PROTOCOLS, 0, &channels);
    int ring_simple = table[LAGOM_NCCL_ALGO_RING][LAGOM_NCCL_PROTO_SIMPLE] == 0.0f;
    int tree_ll = table[LAGOM_NCCL_ALGO_TREE][LAGOM_NCCL_PROTO_LL] == 0.0f;
    if (ring_simple && !tree_ll && channels == 2) {
      atomic_fetch_add(&saw_a, 1);
    } else if (tree_ll && !ring_simple && channels == 7) {
      atomic_fetch_add(&saw_b, 1);
    } else {
      atomic_fetch_add(&mixed, 1);
    }
  }
  atomic_fetch_add(&total_calls, i);
  tuner->finalize(ctx);
  return NULL;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s PLUGIN.so TABLE_A TABLE_B THREADS CALLS RELOADS\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  tuner = dlsym(lib, "ncclTunerPlugin_v6");
  reload_fn reload = (reload_fn)dlsym(lib, "lagom_tuner_live_reload");
  reload_fn stage = (reload_fn)dlsym(lib, "lagom_tuner_live_stage");
  publish_fn publish = (publish_fn)dlsym(lib, "lagom_tuner_live_publish");
  if (tuner == NULL || reload == NULL || stage == NULL || publish == NULL) {
    fprintf(stderr, "missing symbols\n");
    return 2;
  }
  int threads = atoi(argv[4]);
  calls_per_thread = atol(argv[5]);
  long reloads = atol(argv[6]);
  char reason[512];
  if (reload(argv[2], 4, reason, sizeof reason) != 0) {
    fprintf(stderr, "table A refused: %s\n", reason);
    return 2;
  }
  pthread_t* ids = calloc((size_t)threads, sizeof *ids);
  double start = now();
  for (int t = 0; t < threads; t++) pthread_create(&ids[t], NULL, caller, NULL);
  for (long r = 0; r < reloads; r++) { /* every other switch in two phases, as a job of several ranks does */
    const char* table = argv[2 + (r + 1) % 2];
    int refused = r % 2 ? (stage(table, 4, reason, sizeof reason) != 0 || publish() != 1)
                        : reload(table, 4, reason, sizeof reason) != 0;
    if (refused) {
      fprintf(stderr, "switch refused: %s\n", reason);
      return 2;
    }
  }
  atomic_store(&stop, 1);
  for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
  double seconds = now() - start;
  long total = atomic_load(&total_calls);
  printf("calls %ld mixed %ld a %ld b %ld ns_per_call %.1f\n", total, atomic_load(&mixed), atomic_load(&saw_a),
         atomic_load(&saw_b), seconds * 1e9 * threads / (double)total);
  free(ids);
  return atomic_load(&mixed) == 0 ? 0 : 1;
}
