/*
 * Lagom's profiler plugin against NCCL's own profiler headers: built with an NCCL checkout's
 * plugins/profiler/example/nccl/ headers, it checks at compile time that Lagom's restated ABI
 * (lagom_nccl_profiler.h) has NCCL's offsets and values, then loads the plugin and calls it through NCCL's
 * types as NCCL does (v6 with a collective's Coll and kernel-channel events, v4 and v5, no v7 symbol), and
 * checks the records. The threaded, malformed-input and full-ring runs are tests/nccl_profiler_stress.c,
 * which calls through Lagom's restated types: the offsets checked here make those calls NCCL's.
 * Built plain and with sanitizers by tests/test_nccl_profiler_abi.py.
 *
 * usage: nccl_profiler_abi PLUGIN.so   Exit 0 and "abi ok" when every check holds.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "nccl/err.h"
#include "nccl/profiler.h"
#include "lagom_nccl_profiler.h"

#define SAME_OFFSET(ours, ours_member, theirs, theirs_member)                                    \
  _Static_assert(offsetof(ours, ours_member) == offsetof(theirs, theirs_member),                 \
                 #ours_member " of " #ours " is not at NCCL's offset")

SAME_OFFSET(lagom_prof_descr_v6, type, ncclProfilerEventDescr_v6_t, type);
SAME_OFFSET(lagom_prof_descr_v6, parentObj, ncclProfilerEventDescr_v6_t, parentObj);
SAME_OFFSET(lagom_prof_descr_v6, rank, ncclProfilerEventDescr_v6_t, rank);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.seqNumber, ncclProfilerEventDescr_v6_t, coll.seqNumber);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.func, ncclProfilerEventDescr_v6_t, coll.func);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.count, ncclProfilerEventDescr_v6_t, coll.count);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.datatype, ncclProfilerEventDescr_v6_t, coll.datatype);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.nChannels, ncclProfilerEventDescr_v6_t, coll.nChannels);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.nWarps, ncclProfilerEventDescr_v6_t, coll.nWarps);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.algo, ncclProfilerEventDescr_v6_t, coll.algo);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.proto, ncclProfilerEventDescr_v6_t, coll.proto);
SAME_OFFSET(lagom_prof_descr_v6, coll.parentGroup, ncclProfilerEventDescr_v6_t, coll.parentGroup);
SAME_OFFSET(lagom_prof_descr_v6, kernelCh.channelId, ncclProfilerEventDescr_v6_t, kernelCh.channelId);
SAME_OFFSET(lagom_prof_descr_v6, kernelCh.pTimer, ncclProfilerEventDescr_v6_t, kernelCh.pTimer);
SAME_OFFSET(lagom_prof_descr_v6, ceColl.seqNumber, ncclProfilerEventDescr_v6_t, ceColl.seqNumber);
SAME_OFFSET(lagom_prof_descr_v6, ceColl.func, ncclProfilerEventDescr_v6_t, ceColl.func);
SAME_OFFSET(lagom_prof_descr_v6, ceColl.count, ncclProfilerEventDescr_v6_t, ceColl.count);
SAME_OFFSET(lagom_prof_descr_v6, ceColl.datatype, ncclProfilerEventDescr_v6_t, ceColl.datatype);
/* v5's descriptor: the same offsets for every member the plugin reads through the v6 type. */
SAME_OFFSET(lagom_prof_descr_v6, type, ncclProfilerEventDescr_v5_t, type);
SAME_OFFSET(lagom_prof_descr_v6, parentObj, ncclProfilerEventDescr_v5_t, parentObj);
SAME_OFFSET(lagom_prof_descr_v6, rank, ncclProfilerEventDescr_v5_t, rank);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.seqNumber, ncclProfilerEventDescr_v5_t, coll.seqNumber);
SAME_OFFSET(lagom_prof_descr_v6, coll.base.proto, ncclProfilerEventDescr_v5_t, coll.proto);
SAME_OFFSET(lagom_prof_descr_v6, coll.parentGroup, ncclProfilerEventDescr_v5_t, coll.parentGroup);
SAME_OFFSET(lagom_prof_descr_v6, kernelCh.pTimer, ncclProfilerEventDescr_v5_t, kernelCh.pTimer);
SAME_OFFSET(lagom_prof_descr_v4, type, ncclProfilerEventDescr_v4_t, type);
SAME_OFFSET(lagom_prof_descr_v4, parentObj, ncclProfilerEventDescr_v4_t, parentObj);
SAME_OFFSET(lagom_prof_descr_v4, rank, ncclProfilerEventDescr_v4_t, rank);
SAME_OFFSET(lagom_prof_descr_v4, coll.seqNumber, ncclProfilerEventDescr_v4_t, coll.seqNumber);
SAME_OFFSET(lagom_prof_descr_v4, coll.count, ncclProfilerEventDescr_v4_t, coll.count);
SAME_OFFSET(lagom_prof_descr_v4, coll.datatype, ncclProfilerEventDescr_v4_t, coll.datatype);
SAME_OFFSET(lagom_prof_descr_v4, coll.nChannels, ncclProfilerEventDescr_v4_t, coll.nChannels);
SAME_OFFSET(lagom_prof_descr_v4, coll.proto, ncclProfilerEventDescr_v4_t, coll.proto);
SAME_OFFSET(lagom_prof_descr_v4, kernelCh.pTimer, ncclProfilerEventDescr_v4_t, kernelCh.pTimer);
_Static_assert(sizeof(((lagom_prof_descr_v4*)0)->type) == sizeof(((ncclProfilerEventDescr_v4_t*)0)->type), "v4 type");
_Static_assert(sizeof(((lagom_prof_descr_v6*)0)->type) == sizeof(((ncclProfilerEventDescr_v6_t*)0)->type), "v6 type");
SAME_OFFSET(lagom_prof_state_args, kernelCh.pTimer, ncclProfilerEventStateArgs_v6_t, kernelCh.pTimer);
SAME_OFFSET(lagom_prof_plugin_v6, init, ncclProfiler_v6_t, init);
SAME_OFFSET(lagom_prof_plugin_v6, startEvent, ncclProfiler_v6_t, startEvent);
SAME_OFFSET(lagom_prof_plugin_v6, stopEvent, ncclProfiler_v6_t, stopEvent);
SAME_OFFSET(lagom_prof_plugin_v6, recordEventState, ncclProfiler_v6_t, recordEventState);
SAME_OFFSET(lagom_prof_plugin_v6, finalize, ncclProfiler_v6_t, finalize);
_Static_assert(sizeof(lagom_prof_plugin_v6) == sizeof(ncclProfiler_v6_t), "v6 size");
_Static_assert(sizeof(lagom_prof_plugin_v6) == sizeof(ncclProfiler_v5_t), "v5 size");
SAME_OFFSET(lagom_prof_plugin_v4, init, ncclProfiler_v4_t, init);
SAME_OFFSET(lagom_prof_plugin_v4, finalize, ncclProfiler_v4_t, finalize);
_Static_assert(sizeof(lagom_prof_plugin_v4) == sizeof(ncclProfiler_v4_t), "v4 size");
#define SAME_VALUE(ours, theirs) _Static_assert((int)(ours) == (int)(theirs), #ours " is not NCCL's " #theirs)
SAME_VALUE(LAGOM_PROF_EVENT_GROUP, ncclProfileGroup);
SAME_VALUE(LAGOM_PROF_EVENT_COLL, ncclProfileColl);
SAME_VALUE(LAGOM_PROF_EVENT_KERNEL_CH, ncclProfileKernelCh);
SAME_VALUE(LAGOM_PROF_EVENT_CE_COLL, ncclProfileCeColl);
SAME_VALUE(LAGOM_PROF_STATE_KERNEL_CH_STOP, ncclProfilerKernelChStop);
SAME_VALUE(LAGOM_PROF_LOG_WARN, NCCL_LOG_WARN);
SAME_VALUE(LAGOM_PROF_LOG_INFO, NCCL_LOG_INFO);
SAME_VALUE(LAGOM_PROF_SUBSYS_INIT, NCCL_INIT);
SAME_VALUE(LAGOM_PROF_SUBSYS_PROFILE, NCCL_PROFILE);

typedef size_t (*drain_fn)(lagom_prof_record*, size_t, uint64_t*);

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

static int fail(const char* what) {
  fprintf(stderr, "abi: %s\n", what);
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) return fail("usage: nccl_profiler_abi PLUGIN.so");
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return fail(dlerror());
  ncclProfiler_v6_t* v6 = dlsym(lib, "ncclProfiler_v6"); /* the symbol names NCCL looks up, newest first */
  ncclProfiler_v5_t* v5 = dlsym(lib, "ncclProfiler_v5");
  ncclProfiler_v4_t* v4 = dlsym(lib, "ncclProfiler_v4");
  drain_fn drain = (drain_fn)dlsym(lib, "lagom_profiler_drain");
  if (v6 == NULL || v5 == NULL || v4 == NULL || drain == NULL) return fail("symbols");
  if (dlsym(lib, "ncclProfiler_v7") != NULL) return fail("a v7 symbol: NCCL would read it with v7's layout");

  void* c6 = NULL;
  void* c5 = NULL;
  void* c4 = NULL;
  int mask = 0;
  v6->init(&c6, 0x66, &mask, "v6", 1, 4, 1, logger);
  if (c6 == NULL || mask != (ncclProfileColl | ncclProfileKernelCh | ncclProfileCeColl)) return fail("v6 init");
  v5->init(&c5, 0x55, &mask, "v5", 1, 4, 1, logger);
  v4->init(&c4, &mask, "v4", 0x44, 1, 4, 1, logger);

  ncclProfilerEventDescr_v6_t d;
  memset(&d, 0, sizeof d);
  d.type = ncclProfileColl;
  d.rank = 1;
  d.coll.seqNumber = 9;
  d.coll.func = "ReduceScatter";
  d.coll.count = 16;
  d.coll.datatype = "ncclInt64";
  d.coll.nChannels = 2;
  d.coll.nWarps = 4;
  d.coll.algo = "TREE";
  d.coll.proto = "SIMPLE";
  void* coll = NULL;
  v6->startEvent(c6, &coll, &d);
  v6->stopEvent(coll);
  for (int ch = 0; ch < 2; ch++) {
    ncclProfilerEventDescr_v6_t k;
    memset(&k, 0, sizeof k);
    k.type = ncclProfileKernelCh;
    k.parentObj = coll;
    k.kernelCh.channelId = (uint8_t)ch;
    k.kernelCh.pTimer = 100 + (uint64_t)ch;
    void* channel = NULL;
    v6->startEvent(c6, &channel, &k);
    ncclProfilerEventStateArgs_v6_t a;
    memset(&a, 0, sizeof a);
    a.kernelCh.pTimer = 200 + (uint64_t)ch;
    v6->recordEventState(channel, ncclProfilerKernelChStop, &a);
    v6->stopEvent(channel);
  }
  ncclProfilerEventDescr_v5_t d5;
  memset(&d5, 0, sizeof d5);
  d5.type = ncclProfileColl;
  d5.rank = 1;
  d5.coll.seqNumber = 9;
  d5.coll.func = "ReduceScatter";
  d5.coll.count = 16;
  d5.coll.datatype = "ncclInt64";
  d5.coll.nWarps = 4;
  d5.coll.algo = "TREE";
  d5.coll.proto = "SIMPLE";
  void* h = NULL;
  v5->startEvent(c5, &h, &d5);
  v5->stopEvent(h);
  ncclProfilerEventDescr_v4_t d4;
  memset(&d4, 0, sizeof d4);
  d4.type = ncclProfileColl;
  d4.rank = 1;
  d4.coll.seqNumber = 9;
  d4.coll.func = "ReduceScatter";
  d4.coll.count = 16;
  d4.coll.datatype = "ncclInt64";
  d4.coll.nWarps = 4;
  d4.coll.algo = "TREE";
  d4.coll.proto = "SIMPLE";
  v4->startEvent(c4, &h, &d4);
  v4->stopEvent(h);

  lagom_prof_record out[8];
  uint64_t missed = 0;
  size_t n = drain(out, 8, &missed);
  if (n != 3 || missed != 0) return fail("one record per collective");
  const uint64_t hashes[] = {0x66, 0x55, 0x44};
  for (size_t i = 0; i < n; i++) {
    const lagom_prof_record* r = &out[i];
    if (r->comm_hash != hashes[i] || r->rank != 1 || r->n_ranks != 4 || r->seq_number != 9 || r->count != 16 ||
        r->type_size != 8 || r->func != 3 || r->algorithm != 0 || r->protocol != 2 || r->warps != 4) {
      return fail("a record differs from its collective");
    }
  }
  if (out[0].channels != 2 || out[0].channel_events != 2 || out[0].gpu_start_ns != 100 || out[0].gpu_stop_ns != 201) {
    return fail("the v6 collective's channels and GPU times");
  }
  v6->finalize(c6);
  v5->finalize(c5);
  v4->finalize(c4);
  printf("abi ok\n");
  return 0;
}
