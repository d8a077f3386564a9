/*
 * Drives Lagom's NCCL tuner plugin the way NCCL does (dlopen, the ncclTunerPlugin_v* symbols, init,
 * getCollInfo, getChunkSize, finalize) many times over, for tests/test_nccl_tuner.py to run under
 * AddressSanitizer/LeakSanitizer or valgrind.
 *
 * usage: nccl_tuner_stress PLUGIN.so ROUNDS RANKS NODES RULES_FILE...
 * Each round, for each rules file: a v6, a v5 and a v4 communicator of RANKS ranks on NODES nodes,
 * asked about every collective at sizes from 1 byte to 4 GiB, and for the chunk of what NCCL would pick.
 * Prints what it did; exit 0 on success.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "lagom_nccl_tuner.h"

static unsigned long log_lines = 0;

static void count_log(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level;
  (void)flags;
  (void)file;
  (void)line;
  char message[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof message, fmt, args);
  va_end(args);
  log_lines++;
}

static unsigned long applied = 0, chunks_set = 0, calls = 0;

static void ask(void* ctx, lagom_nccl_get_coll_info get_coll_info,
                lagom_nccl_result (*get_chunk_size)(void*, lagom_nccl_func, size_t, int, int, int, size_t*)) {
  for (int coll = 0; coll < LAGOM_NCCL_TUNED_FUNCTIONS; coll++) {
    for (size_t bytes = 1; bytes <= ((size_t)1 << 32); bytes += bytes / 12 + 1) { /* steps < 10%: every range is hit */
      float table[LAGOM_NCCL_ALGORITHMS][LAGOM_NCCL_PROTOCOLS];
      for (int a = 0; a < LAGOM_NCCL_ALGORITHMS; a++) {
        for (int p = 0; p < LAGOM_NCCL_PROTOCOLS; p++) {
          int ignored = a == LAGOM_NCCL_ALGO_NVLS || (a == LAGOM_NCCL_ALGO_TREE && p == LAGOM_NCCL_PROTO_LL128);
          table[a][p] = ignored ? LAGOM_NCCL_COST_IGNORED : 1.0f + (float)(a + p);
        }
      }
      int channels = 0;
      get_coll_info(ctx, coll, bytes, 1, (float**)table, LAGOM_NCCL_ALGORITHMS, LAGOM_NCCL_PROTOCOLS, 0, &channels);
      calls++;
      applied += channels != 0;
      if (get_chunk_size != NULL) {
        int algo = 0, proto = 0; /* NCCL's pick: the first cheapest entry >= 0 */
        for (int a = 0; a < LAGOM_NCCL_ALGORITHMS; a++) {
          for (int p = 0; p < LAGOM_NCCL_PROTOCOLS; p++) {
            if (table[a][p] >= 0.0f && (table[algo][proto] < 0.0f || table[a][p] < table[algo][proto])) {
              algo = a;
              proto = p;
            }
          }
        }
        size_t chunk = 12345;
        get_chunk_size(ctx, coll, bytes / 4 + 1, algo, proto, 1, &chunk);
        chunks_set += chunk != 12345;
      }
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s PLUGIN.so ROUNDS RANKS NODES RULES_FILE...\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  lagom_nccl_tuner_v6* v6 = dlsym(lib, "ncclTunerPlugin_v6");
  lagom_nccl_tuner_v5* v5 = dlsym(lib, "ncclTunerPlugin_v5");
  lagom_nccl_tuner_v4* v4 = dlsym(lib, "ncclTunerPlugin_v4");
  if (v6 == NULL || v5 == NULL || v4 == NULL) {
    fprintf(stderr, "missing ncclTunerPlugin_v4/v5/v6\n");
    return 2;
  }
  long rounds = strtol(argv[2], NULL, 10);
  size_t ranks = strtoul(argv[3], NULL, 10), nodes = strtoul(argv[4], NULL, 10);
  unsigned long inits = 0;
  for (long round = 0; round < rounds; round++) {
    for (int f = 5; f < argc; f++) {
      setenv(LAGOM_NCCL_TUNER_FILE_ENV, argv[f], 1);
      void* ctx = NULL;
      v6->init(&ctx, (uint64_t)round, ranks, nodes, count_log, NULL, NULL);
      ask(ctx, v6->getCollInfo, v6->getChunkSize);
      v6->finalize(ctx);
      v5->init(&ctx, (uint64_t)round, ranks, nodes, count_log, NULL, NULL);
      ask(ctx, v5->getCollInfo, NULL);
      v5->finalize(ctx);
      v4->init(ranks, nodes, count_log, &ctx);
      ask(ctx, v4->getCollInfo, NULL);
      v4->destroy(ctx);
      inits += 3;
    }
  }
  dlclose(lib);
  printf("inits=%lu calls=%lu applied=%lu chunks=%lu log_lines=%lu\n", inits, calls, applied, chunks_set, log_lines);
  return 0;
}
