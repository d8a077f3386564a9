/*
 * Lagom's tuner plugin against NCCL's own tuner headers: built with an NCCL checkout's
 * plugins/tuner/example/nccl/tuner.h (v5, v6; v7 from NCCL 2.32, where the test defines
 * LAGOM_NCCL_HAS_TUNER_V7) and src/include/plugin/tuner/tuner_v4.h, it checks at compile time that Lagom's
 * restated ABI (lagom_nccl_tuner.h) has NCCL's layout, enum values and symbol types, then loads the plugin and
 * calls it through NCCL's own types as NCCL does (init, getCollInfo, getChunkSize, finalize for v7 and v6;
 * v4's init and destroy), and reads the counters NCCL's calls raised. Against older headers v7 is called
 * through v6's type, the layout lagom_nccl_tuner.h gives it.
 *
 * usage: nccl_tuner_abi PLUGIN.so   (LAGOM_NCCL_TUNER_FILE names a rules file with an allreduce rule for
 * 4 ranks on 1 node at 1 MiB: ring simple 2 channels, chunk 131072). Exit 0 when every check holds.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

#include "nccl/tuner.h"
#include "plugin/tuner/tuner_v4.h"
#include "lagom_nccl_tuner.h"

#define SAME_MEMBER(ours, theirs, member) \
  _Static_assert(offsetof(ours, member) == offsetof(theirs, member), #member " of " #ours " is not NCCL's")

/* v6 and v7 have the same members (v7 changes only the constants table init passes) */
#define SAME_TUNER(ours, theirs)                         \
  SAME_MEMBER(ours, theirs, name);                       \
  SAME_MEMBER(ours, theirs, init);                       \
  SAME_MEMBER(ours, theirs, getCollInfo);                \
  SAME_MEMBER(ours, theirs, finalize);                   \
  SAME_MEMBER(ours, theirs, getChunkSize);               \
  _Static_assert(sizeof(ours) == sizeof(theirs), #ours " size")

SAME_TUNER(lagom_nccl_tuner_v6, ncclTuner_v6_t);
#ifdef LAGOM_NCCL_HAS_TUNER_V7
SAME_TUNER(lagom_nccl_tuner_v7, ncclTuner_v7_t);
typedef ncclTuner_v7_t tuner_v7;
#else
typedef ncclTuner_v6_t tuner_v7;
#endif
SAME_MEMBER(lagom_nccl_tuner_v5, ncclTuner_v5_t, init);
SAME_MEMBER(lagom_nccl_tuner_v5, ncclTuner_v5_t, getCollInfo);
SAME_MEMBER(lagom_nccl_tuner_v5, ncclTuner_v5_t, finalize);
_Static_assert(sizeof(lagom_nccl_tuner_v5) == sizeof(ncclTuner_v5_t), "v5 size");
SAME_MEMBER(lagom_nccl_tuner_v4, ncclTuner_v4_t, init);
SAME_MEMBER(lagom_nccl_tuner_v4, ncclTuner_v4_t, getCollInfo);
SAME_MEMBER(lagom_nccl_tuner_v4, ncclTuner_v4_t, destroy);
_Static_assert(sizeof(lagom_nccl_tuner_v4) == sizeof(ncclTuner_v4_t), "v4 size");
_Static_assert((int)LAGOM_NCCL_ALL_REDUCE == (int)ncclFuncAllReduce &&
               (int)LAGOM_NCCL_ALL_GATHER == (int)ncclFuncAllGather &&
               (int)LAGOM_NCCL_REDUCE_SCATTER == (int)ncclFuncReduceScatter &&
               (int)LAGOM_NCCL_BROADCAST == (int)ncclFuncBroadcast && (int)LAGOM_NCCL_REDUCE == (int)ncclFuncReduce,
               "ncclFunc_t values");
_Static_assert(LAGOM_NCCL_ALGO_TREE == NCCL_ALGO_TREE && LAGOM_NCCL_ALGO_RING == NCCL_ALGO_RING &&
               LAGOM_NCCL_ALGO_NVLS == NCCL_ALGO_NVLS && LAGOM_NCCL_ALGO_NVLS_TREE == NCCL_ALGO_NVLS_TREE &&
               LAGOM_NCCL_ALGO_PAT == NCCL_ALGO_PAT && LAGOM_NCCL_ALGORITHMS == NCCL_NUM_ALGORITHMS,
               "NCCL_ALGO_* values");
_Static_assert(LAGOM_NCCL_PROTO_LL == NCCL_PROTO_LL && LAGOM_NCCL_PROTO_LL128 == NCCL_PROTO_LL128 &&
               LAGOM_NCCL_PROTO_SIMPLE == NCCL_PROTO_SIMPLE && LAGOM_NCCL_PROTOCOLS == NCCL_NUM_PROTOCOLS,
               "NCCL_PROTO_* values");

static int logged = 0;
static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
  logged++;
}

static int fail(const char* what) {
  fprintf(stderr, "abi: %s\n", what);
  return 1;
}

/* One communicator's calls through an interface with v6's members (v6, and v7 whose layout is v6's). */
static int call_v6_layout(ncclTuner_v6_t* tuner, const char* version) {
  void* ctx = NULL;
  if (tuner->init(&ctx, 0x5eed, 4, 1, logger, NULL, NULL) != ncclSuccess || ctx == NULL) return fail(version);
  float table[NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS];
  for (int a = 0; a < NCCL_NUM_ALGORITHMS; a++)
    for (int p = 0; p < NCCL_NUM_PROTOCOLS; p++) table[a][p] = 1.0f + (float)(a * NCCL_NUM_PROTOCOLS + p);
  int channels = 0;
  if (tuner->getCollInfo(ctx, ncclFuncAllReduce, 1 << 20, 1, (float**)table, NCCL_NUM_ALGORITHMS, NCCL_NUM_PROTOCOLS,
                         0, &channels) != ncclSuccess)
    return fail("getCollInfo");
  if (table[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] != 0.0f || channels != 2) return fail("the rule was not applied");
  size_t chunk = 1 << 19;
  if (tuner->getChunkSize(ctx, ncclFuncAllReduce, 1 << 19, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE, 2, &chunk) != ncclSuccess ||
      chunk != 131072)
    return fail("getChunkSize");
  return tuner->finalize(ctx) == ncclSuccess ? 0 : fail("finalize");
}

int main(int argc, char** argv) {
  if (argc != 2) return fail("usage: nccl_tuner_abi PLUGIN.so");
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return fail(dlerror());
  ncclTuner_v6_t* v6 = dlsym(lib, "ncclTunerPlugin_v6");  /* the symbol names NCCL looks up */
  tuner_v7* v7 = dlsym(lib, "ncclTunerPlugin_v7");
  ncclTuner_v4_t* v4 = dlsym(lib, "ncclTunerPlugin_v4");
  void (*counters)(uint64_t*, uint64_t*, uint64_t*) = (void (*)(uint64_t*, uint64_t*, uint64_t*))dlsym(lib, "lagom_tuner_counters");
  if (v6 == NULL || v7 == NULL || v4 == NULL || dlsym(lib, "ncclTunerPlugin_v5") == NULL || counters == NULL)
    return fail("symbols");
  if (call_v6_layout(v6, "v6") != 0 || call_v6_layout((ncclTuner_v6_t*)v7, "v7") != 0) return 1;
  void* old = NULL;
  if (v4->init(4, 1, logger, &old) != ncclSuccess || old == NULL || v4->destroy(old) != ncclSuccess) return fail("v4");
  uint64_t inits = 0, calls = 0, applied = 0;
  counters(&inits, &calls, &applied);
  if (inits != 3 || calls != 2 || applied != 2) return fail("counters");
  printf("abi ok: v4/v5/v6/v7 layouts, enums and calls as NCCL's headers declare them; %d log lines\n", logged);
  return 0;
}
