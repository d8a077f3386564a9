/*
 * What the profiler plugin costs NCCL per event, in nanoseconds: the driver for benchmarks/profiler_overhead.py.
 *
 * Each thread plays one communicator: per operation (a collective, or a send with KIND p2p), its Coll or P2p
 * start and stop (the launching thread's share), then per channel a network ProxyOp start (a channel between
 * nodes: the most events the plugin asks for) and the kernel channel's start, KernelChStop state and stop
 * (NCCL's proxy thread's share), through the exported ncclProfiler_v6 as NCCL calls it. Prints: threads,
 * operations, ns per operation on the launching thread, ns per event overall.
 *
 * usage: profiler_overhead PLUGIN.so THREADS OPERATIONS CHANNELS coll|p2p
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lagom_nccl_profiler.h"

typedef size_t (*drain_fn)(lagom_prof_record*, size_t, uint64_t*);

static lagom_prof_plugin_v6* plugin;
static drain_fn drain;
static long collectives, channels;
static int p2p;

typedef struct {
  void* context;
  double launch_ns, all_ns;
} worker;

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void* run(void* arg) {
  worker* w = arg;
  lagom_prof_descr_v6 coll, ch, op;
  memset(&coll, 0, sizeof coll);
  if (p2p) {
    coll.type = LAGOM_PROF_EVENT_P2P;
    coll.p2p.base.func = "Send";
    coll.p2p.base.count = 1 << 20;
    coll.p2p.base.datatype = "ncclBfloat16";
    coll.p2p.base.peer = 1;
    coll.p2p.base.nChannels = (uint8_t)channels;
  } else {
    coll.type = LAGOM_PROF_EVENT_COLL;
    coll.coll.base.func = "AllReduce";
    coll.coll.base.count = 1 << 20;
    coll.coll.base.datatype = "ncclBfloat16";
    coll.coll.base.nChannels = (uint8_t)channels;
    coll.coll.base.nWarps = 16;
    coll.coll.base.algo = "RING";
    coll.coll.base.proto = "SIMPLE";
  }
  memset(&op, 0, sizeof op);
  op.type = LAGOM_PROF_EVENT_PROXY_OP;
  op.proxyOp.pid = getpid();
  op.proxyOp.chunkSize = 1 << 20;
  memset(&ch, 0, sizeof ch);
  ch.type = LAGOM_PROF_EVENT_KERNEL_CH;
  lagom_prof_state_args stop_args;
  memset(&stop_args, 0, sizeof stop_args);
  double launch = 0, start = now_ns();
  for (long seq = 0; seq < collectives; seq++) {
    double t0 = now_ns();
    void* handle = NULL;
    if (!p2p) coll.coll.base.seqNumber = (uint64_t)seq;
    plugin->startEvent(w->context, &handle, &coll);
    plugin->stopEvent(handle);
    launch += now_ns() - t0;
    ch.parentObj = op.parentObj = handle;
    for (long c = 0; c < channels; c++) {
      void* none = NULL;
      op.proxyOp.channelId = (uint8_t)c;
      plugin->startEvent(w->context, &none, &op);
      void* channel = NULL;
      ch.kernelCh.channelId = (uint8_t)c;
      ch.kernelCh.pTimer = 1000 + (uint64_t)seq;
      plugin->startEvent(w->context, &channel, &ch);
      stop_args.kernelCh.pTimer = 2000 + (uint64_t)seq;
      plugin->recordEventState(channel, LAGOM_PROF_STATE_KERNEL_CH_STOP, &stop_args);
      plugin->stopEvent(channel);
    }
  }
  w->all_ns = now_ns() - start;
  w->launch_ns = launch;
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 6 || (strcmp(argv[5], "coll") != 0 && strcmp(argv[5], "p2p") != 0)) {
    return fprintf(stderr, "usage: profiler_overhead PLUGIN.so THREADS OPERATIONS CHANNELS coll|p2p\n"), 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return fprintf(stderr, "%s\n", dlerror()), 1;
  plugin = dlsym(lib, "ncclProfiler_v6");
  drain = (drain_fn)dlsym(lib, "lagom_profiler_drain");
  if (plugin == NULL || drain == NULL) return fprintf(stderr, "symbols\n"), 1;
  int threads = atoi(argv[2]);
  collectives = atol(argv[3]);
  channels = atol(argv[4]);
  p2p = strcmp(argv[5], "p2p") == 0;
  worker* workers = calloc((size_t)threads, sizeof *workers);
  pthread_t* ids = calloc((size_t)threads, sizeof *ids);
  int mask = 0;
  for (int i = 0; i < threads; i++) plugin->init(&workers[i].context, 0x100 + (uint64_t)i, &mask, "", 1, 8, 0, NULL);
  for (int i = 0; i < threads; i++) pthread_create(&ids[i], NULL, run, &workers[i]);
  static lagom_prof_record out[8192];
  uint64_t drained = 0, missed_total = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(ids[i], NULL);
  }
  for (;;) { /* what is left after the run: the ring keeps the newest */
    uint64_t missed = 0;
    size_t n = drain(out, 8192, &missed);
    drained += n;
    missed_total += missed;
    if (n == 0) break;
  }
  double launch = 0, all = 0;
  for (int i = 0; i < threads; i++) {
    launch += workers[i].launch_ns;
    all += workers[i].all_ns;
    plugin->finalize(workers[i].context);
  }
  double per_coll_events = 2.0 + 4.0 * (double)channels;
  printf("threads %d operations %ld kind %s channels %ld launch_ns_per_operation %.1f ns_per_event %.1f "
         "drained %llu overwritten %llu\n",
         threads, collectives * threads, argv[5], channels, launch / (double)(collectives * threads),
         all / ((double)(collectives * threads) * per_coll_events), (unsigned long long)drained,
         (unsigned long long)missed_total);
  free(workers);
  free(ids);
  return 0;
}
