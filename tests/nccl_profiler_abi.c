/*
 * Lagom's profiler plugin against NCCL's own profiler headers: built with an NCCL checkout's
 * plugins/profiler/example/nccl/ headers, it checks at compile time that Lagom's restated ABI
 * (lagom_nccl_profiler.h) has NCCL's offsets and values, then loads the plugin and calls it through NCCL's
 * types as NCCL does (v6 with a collective's Coll, network ProxyOp and kernel-channel events, a send's P2p
 * events, v4 and v5, no v7 symbol), and checks the records. The threaded, malformed-input and full-ring runs are tests/nccl_profiler_stress.c,
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
#include <unistd.h>

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
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.func, ncclProfilerEventDescr_v6_t, p2p.func);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.datatype, ncclProfilerEventDescr_v6_t, p2p.datatype);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.count, ncclProfilerEventDescr_v6_t, p2p.count);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.peer, ncclProfilerEventDescr_v6_t, p2p.peer);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.nChannels, ncclProfilerEventDescr_v6_t, p2p.nChannels);
SAME_OFFSET(lagom_prof_descr_v6, p2p.parentGroup, ncclProfilerEventDescr_v6_t, p2p.parentGroup);
SAME_OFFSET(lagom_prof_descr_v6, proxyOp.pid, ncclProfilerEventDescr_v6_t, proxyOp.pid);
SAME_OFFSET(lagom_prof_descr_v6, proxyOp.chunkSize, ncclProfilerEventDescr_v6_t, proxyOp.chunkSize);
_Static_assert(sizeof(((lagom_prof_descr_v6*)0)->proxyOp.pid) == sizeof(((ncclProfilerEventDescr_v6_t*)0)->proxyOp.pid),
               "proxyOp.pid");
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
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.func, ncclProfilerEventDescr_v5_t, p2p.func);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.datatype, ncclProfilerEventDescr_v5_t, p2p.datatype);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.count, ncclProfilerEventDescr_v5_t, p2p.count);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.peer, ncclProfilerEventDescr_v5_t, p2p.peer);
SAME_OFFSET(lagom_prof_descr_v6, p2p.base.nChannels, ncclProfilerEventDescr_v5_t, p2p.nChannels);
SAME_OFFSET(lagom_prof_descr_v6, p2p.parentGroup, ncclProfilerEventDescr_v5_t, p2p.parentGroup);
SAME_OFFSET(lagom_prof_descr_v6, proxyOp.pid, ncclProfilerEventDescr_v5_t, proxyOp.pid);
SAME_OFFSET(lagom_prof_descr_v6, proxyOp.chunkSize, ncclProfilerEventDescr_v5_t, proxyOp.chunkSize);
SAME_OFFSET(lagom_prof_descr_v4, type, ncclProfilerEventDescr_v4_t, type);
SAME_OFFSET(lagom_prof_descr_v4, parentObj, ncclProfilerEventDescr_v4_t, parentObj);
SAME_OFFSET(lagom_prof_descr_v4, rank, ncclProfilerEventDescr_v4_t, rank);
SAME_OFFSET(lagom_prof_descr_v4, coll.seqNumber, ncclProfilerEventDescr_v4_t, coll.seqNumber);
SAME_OFFSET(lagom_prof_descr_v4, coll.count, ncclProfilerEventDescr_v4_t, coll.count);
SAME_OFFSET(lagom_prof_descr_v4, coll.datatype, ncclProfilerEventDescr_v4_t, coll.datatype);
SAME_OFFSET(lagom_prof_descr_v4, coll.nChannels, ncclProfilerEventDescr_v4_t, coll.nChannels);
SAME_OFFSET(lagom_prof_descr_v4, coll.proto, ncclProfilerEventDescr_v4_t, coll.proto);
SAME_OFFSET(lagom_prof_descr_v4, kernelCh.pTimer, ncclProfilerEventDescr_v4_t, kernelCh.pTimer);
SAME_OFFSET(lagom_prof_descr_v4, p2p.func, ncclProfilerEventDescr_v4_t, p2p.func);
SAME_OFFSET(lagom_prof_descr_v4, p2p.datatype, ncclProfilerEventDescr_v4_t, p2p.datatype);
SAME_OFFSET(lagom_prof_descr_v4, p2p.count, ncclProfilerEventDescr_v4_t, p2p.count);
SAME_OFFSET(lagom_prof_descr_v4, p2p.peer, ncclProfilerEventDescr_v4_t, p2p.peer);
SAME_OFFSET(lagom_prof_descr_v4, p2p.nChannels, ncclProfilerEventDescr_v4_t, p2p.nChannels);
SAME_OFFSET(lagom_prof_descr_v4, proxyOp.pid, ncclProfilerEventDescr_v4_t, proxyOp.pid);
SAME_OFFSET(lagom_prof_descr_v4, proxyOp.chunkSize, ncclProfilerEventDescr_v4_t, proxyOp.chunkSize);
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
SAME_VALUE(LAGOM_PROF_EVENT_P2P, ncclProfileP2p);
SAME_VALUE(LAGOM_PROF_EVENT_PROXY_OP, ncclProfileProxyOp);
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
  if (c6 == NULL ||
      mask != (ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileKernelCh | ncclProfileCeColl)) {
    return fail("v6 init");
  }
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
  /* the network proxy's operations of the collective: another process's first (PXN: ignored), then this one's */
  for (int pass = 0; pass < 2; pass++) {
    ncclProfilerEventDescr_v6_t op;
    memset(&op, 0, sizeof op);
    op.type = ncclProfileProxyOp;
    op.parentObj = coll;
    op.proxyOp.pid = pass == 0 ? getpid() + 1 : getpid();
    op.proxyOp.chunkSize = pass == 0 ? 4096 : 262144;
    op.proxyOp.nSteps = 8;
    void* none = (void*)&op;
    v6->startEvent(c6, &none, &op);
    if (none != NULL) return fail("a ProxyOp handle: NCCL would stop and update it");
  }
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

  /* a send of 3 channels (v6), a receive (v5) and a send (v4), no network proxy */
  ncclProfilerEventDescr_v6_t p6;
  memset(&p6, 0, sizeof p6);
  p6.type = ncclProfileP2p;
  p6.rank = 1;
  p6.p2p.func = "Send";
  p6.p2p.count = 4096;
  p6.p2p.datatype = "ncclBfloat16";
  p6.p2p.peer = 2;
  p6.p2p.nChannels = 3;
  void* send = NULL;
  v6->startEvent(c6, &send, &p6);
  v6->stopEvent(send);
  for (int ch = 0; ch < 3; ch++) {
    ncclProfilerEventDescr_v6_t k;
    memset(&k, 0, sizeof k);
    k.type = ncclProfileKernelCh;
    k.parentObj = send;
    k.kernelCh.pTimer = 1000 + (uint64_t)ch;
    void* channel = NULL;
    v6->startEvent(c6, &channel, &k);
    ncclProfilerEventStateArgs_v6_t a;
    memset(&a, 0, sizeof a);
    a.kernelCh.pTimer = 3000 - (uint64_t)ch;
    v6->recordEventState(channel, ncclProfilerKernelChStop, &a);
    v6->stopEvent(channel);
  }
  ncclProfilerEventDescr_v5_t p5;
  memset(&p5, 0, sizeof p5);
  p5.type = ncclProfileP2p;
  p5.rank = 1;
  p5.p2p.func = "Recv";
  p5.p2p.count = 4096;
  p5.p2p.datatype = "ncclBfloat16";
  p5.p2p.peer = 0;
  v5->startEvent(c5, &h, &p5);
  v5->stopEvent(h);
  ncclProfilerEventDescr_v4_t p4;
  memset(&p4, 0, sizeof p4);
  p4.type = ncclProfileP2p;
  p4.rank = 1;
  p4.p2p.func = "Send";
  p4.p2p.count = 4096;
  p4.p2p.datatype = "ncclBfloat16";
  p4.p2p.peer = 3;
  v4->startEvent(c4, &h, &p4);
  v4->stopEvent(h);

  lagom_prof_record out[8];
  uint64_t missed = 0;
  size_t n = drain(out, 8, &missed);
  if (n != 6 || missed != 0) return fail("one record per collective, send and receive");
  const uint64_t hashes[] = {0x66, 0x55, 0x44};
  for (size_t i = 0; i < 3; i++) {
    const lagom_prof_record* r = &out[i];
    if (r->comm_hash != hashes[i] || r->rank != 1 || r->n_ranks != 4 || r->seq_number != 9 || r->count != 16 ||
        r->type_size != 8 || r->func != 3 || r->algorithm != 0 || r->protocol != 2 || r->warps != 4 ||
        r->peer != -1) {
      return fail("a record differs from its collective");
    }
  }
  if (out[0].proxy_chunk_bytes != 262144 || out[1].proxy_chunk_bytes != 0) {
    return fail("the chunk of this process's network proxy operation, and no other");
  }
  const uint8_t p2p_funcs[] = {6, 7, 6}; /* ncclFuncSend, ncclFuncRecv */
  const int peers[] = {2, 0, 3};
  for (size_t i = 3; i < n; i++) {
    const lagom_prof_record* r = &out[i];
    if (r->comm_hash != hashes[i - 3] || r->func != p2p_funcs[i - 3] || r->peer != peers[i - 3] || r->count != 4096 ||
        r->type_size != 2 || r->algorithm != 255 || r->protocol != 255 || r->seq_number != 0 || r->rank != 1) {
      return fail("a send or receive record differs from its P2p event");
    }
  }
  if (out[3].channels != 3 || out[3].channel_events != 3 || out[3].gpu_start_ns != 1000 || out[3].gpu_stop_ns != 3000) {
    return fail("the send's channels and GPU times");
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
