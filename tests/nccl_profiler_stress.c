/*
 * The profiler plugin called as NCCL calls it, from several threads, through Lagom's restatement of the ABI
 * (lagom_nccl_profiler.h; tests/nccl_profiler_abi.c checks that restatement against NCCL's headers):
 *   - launcher threads, one communicator each, start and stop Coll events, and every seventh a send or
 *     receive's P2p event; a proxy thread per launcher reports each one's network proxy operation (its chunk)
 *     and its kernel channels afterwards (start, KernelChStop state, stop); a reader
 *     thread drains the ring all along and checks every record against the values its collective was
 *     started with (a torn or mixed record fails), and every collective is drained or counted as dropped;
 *   - v4 and v5 give the same record as v6; v6's copy-engine collectives are recorded;
 *   - malformed calls (no descriptor, an unknown event type, stray handles), a full ring and a later
 *     interface version (no ncclProfiler_v7: NCCL then uses v6) change nothing and crash nothing.
 * Built plain, with -fsanitize=address,undefined and with -fsanitize=thread by tests/test_nccl_profiler.py.
 *
 * usage: nccl_profiler_stress PLUGIN.so   Exit 0 and "stress ok" when every check holds.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "lagom_nccl_profiler.h"

#define LAUNCHERS 4
#define COLLECTIVES 3000
#define LEAD 64 /* how far a launcher may run ahead of its proxy thread (NCCL's queue depth stands in) */

typedef size_t (*drain_fn)(lagom_prof_record*, size_t, uint64_t*);
typedef size_t (*stats_fn)(uint64_t*, size_t);
typedef size_t (*read_fn)(lagom_prof_record*, size_t, uint64_t*, size_t);

static lagom_prof_plugin_v6* v6;
static drain_fn drain;
static stats_fn stats;
static read_fn read_all;
static uint64_t reads = 0;
static int failures = 0;

static const char* FUNCS[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce"};
static const uint8_t FUNC_IDS[] = {4, 2, 3, 0, 1};
static const char* ALGOS[] = {"RING", "TREE", "NVLS", "PAT"};
static const uint8_t ALGO_IDS[] = {1, 0, 4, 6};

static void logger(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

static void fail(const char* what, unsigned long long a, unsigned long long b) {
  fprintf(stderr, "stress: %s (%llu, %llu)\n", what, a, b);
  __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
}

/* A collective's fields follow from its communicator and sequence number, so a reader can check any record. */
static uint64_t count_of(uint64_t seq) { return seq * 3 + 1; }
static int channels_of(uint64_t seq) { return 1 + (int)(seq % 4); }
static uint64_t gpu_start_of(uint64_t seq) { return 1000000 + seq * 1000; }
static int chunk_of(uint64_t seq) { return 4096 * (1 + (int)(seq % 16)); }
static bool is_p2p(uint64_t seq) { return seq % 7 == 6; }

typedef struct {
  int index;
  void* context;
  void* handles[COLLECTIVES];
  _Atomic int launched, reported;
} launcher;

static void* launch(void* arg) {
  launcher* l = arg;
  for (int seq = 0; seq < COLLECTIVES; seq++) {
    while (seq - atomic_load(&l->reported) >= LEAD) sched_yield();
    lagom_prof_descr_v6 d;
    memset(&d, 0, sizeof d);
    d.rank = l->index;
    if (is_p2p((uint64_t)seq)) {
      d.type = LAGOM_PROF_EVENT_P2P;
      d.p2p.base.func = seq % 2 ? "Send" : "Recv";
      d.p2p.base.count = count_of((uint64_t)seq);
      d.p2p.base.datatype = "ncclFloat16";
      d.p2p.base.peer = seq % 8;
      d.p2p.base.nChannels = (uint8_t)channels_of((uint64_t)seq);
    } else {
      d.type = LAGOM_PROF_EVENT_COLL;
      d.coll.base.seqNumber = (uint64_t)seq;
      d.coll.base.func = FUNCS[seq % 5];
      d.coll.base.count = count_of((uint64_t)seq);
      d.coll.base.datatype = "ncclFloat16";
      d.coll.base.nChannels = (uint8_t)channels_of((uint64_t)seq);
      d.coll.base.nWarps = 8;
      d.coll.base.algo = ALGOS[seq % 4];
      d.coll.base.proto = "LL128";
    }
    void* handle = NULL;
    v6->startEvent(l->context, &handle, &d);
    if (handle == NULL) fail("no handle for a collective", (unsigned long long)l->index, (unsigned long long)seq);
    v6->stopEvent(handle); /* as NCCL: before the kernel's channels report */
    l->handles[seq] = handle;
    atomic_store(&l->launched, seq + 1);
  }
  return NULL;
}

/* NCCL's proxy thread: each channel of each collective, once the launcher handed it over. */
static void* proxy(void* arg) {
  launcher* l = arg;
  for (int seq = 0; seq < COLLECTIVES; seq++) {
    while (atomic_load(&l->launched) <= seq) sched_yield();
    void* parent = l->handles[seq];
    for (int ch = 0; ch < channels_of((uint64_t)seq); ch++) { /* the network's operations come first (see the header) */
      lagom_prof_descr_v6 op;
      memset(&op, 0, sizeof op);
      op.type = LAGOM_PROF_EVENT_PROXY_OP;
      op.parentObj = parent;
      op.proxyOp.pid = getpid();
      op.proxyOp.channelId = (uint8_t)ch;
      op.proxyOp.chunkSize = chunk_of((uint64_t)seq);
      void* none = NULL;
      v6->startEvent(l->context, &none, &op);
    }
    for (int ch = 0; ch < channels_of((uint64_t)seq); ch++) {
      lagom_prof_descr_v6 d;
      memset(&d, 0, sizeof d);
      d.type = LAGOM_PROF_EVENT_KERNEL_CH;
      d.parentObj = parent;
      d.kernelCh.channelId = (uint8_t)ch;
      d.kernelCh.pTimer = gpu_start_of((uint64_t)seq) + (uint64_t)ch;
      void* handle = NULL;
      v6->startEvent(l->context, &handle, &d);
      lagom_prof_state_args args;
      memset(&args, 0, sizeof args);
      args.kernelCh.pTimer = gpu_start_of((uint64_t)seq) + 500 + (uint64_t)ch;
      v6->recordEventState(handle, LAGOM_PROF_STATE_KERNEL_CH_STOP, &args);
      v6->stopEvent(handle);
    }
    atomic_store(&l->reported, seq + 1);
  }
  return NULL;
}

static _Atomic int launching_done = 0;
static uint64_t drained = 0, overwritten = 0;

/* A send or receive has no sequence number from NCCL: its count says which it was, its record's number is the
   communicator's count of them. */
static bool p2p_differs(const lagom_prof_record* r, uint64_t seq) {
  return !is_p2p(seq) || r->seq_number != seq / 7 || r->func != (seq % 2 ? 6 : 7) || r->peer != (int)(seq % 8) ||
         r->algorithm != 255 || r->protocol != 255 || r->warps != 0;
}

static bool coll_differs(const lagom_prof_record* r, uint64_t seq) {
  return is_p2p(seq) || r->func != FUNC_IDS[seq % 5] || r->algorithm != ALGO_IDS[seq % 4] || r->protocol != 1 ||
         r->warps != 8 || r->peer != -1;
}

static void check(const lagom_prof_record* r) {
  bool p2p = r->func == 6 || r->func == 7;
  uint64_t seq = p2p ? (r->count - 1) / 3 : r->seq_number;
  int launcher_index = (int)(r->comm_hash - 0x100);
  if (launcher_index < 0 || launcher_index >= LAUNCHERS || r->rank != launcher_index || seq >= COLLECTIVES) {
    fail("a record from no collective", (unsigned long long)r->comm_hash, (unsigned long long)seq);
    return;
  }
  int channels = channels_of(seq);
  if (r->count != count_of(seq) || (p2p ? p2p_differs(r, seq) : coll_differs(r, seq)) ||
      r->proxy_chunk_bytes != (uint32_t)chunk_of(seq) || r->type_size != 2 || r->channels != channels ||
      r->n_ranks != 8 ||
      r->channel_events != channels || r->gpu_start_ns != gpu_start_of(seq) ||
      r->gpu_stop_ns != gpu_start_of(seq) + 500 + (uint64_t)(channels - 1) || r->host_stop_ns < r->host_start_ns ||
      r->kind != LAGOM_PROF_KIND_KERNEL) {
    fail("a record differs from its collective", (unsigned long long)r->comm_hash, (unsigned long long)seq);
  }
}

static void* read_ring(void* arg) {
  (void)arg;
  static lagom_prof_record out[1024];
  for (;;) {
    int done = atomic_load(&launching_done);
    uint64_t missed = 0;
    size_t n;
    if ((reads++ & 1) == 0) {
      n = drain(out, 1024, &missed);
    } else { /* Python's one call: the drain, then the counters */
      uint64_t counters[1 + LAGOM_PROF_STATS_WORDS];
      n = read_all(out, 1024, counters, 1 + LAGOM_PROF_STATS_WORDS);
      missed = counters[0];
      lagom_prof_stats s;
      memcpy(&s, &counters[1], sizeof s);
      if (s.published < drained + n || s.overwritten != overwritten + missed) fail("counters after a read", n, missed);
    }
    overwritten += missed;
    drained += n;
    for (size_t i = 0; i < n; i++) check(&out[i]);
    if (done && n == 0) return NULL;
  }
}

static void* init_comm(uint64_t hash, int n_ranks) {
  void* ctx = NULL;
  int mask = 0;
  v6->init(&ctx, hash, &mask, "lagom-abi", 1, n_ranks, 0, logger);
  int wanted = LAGOM_PROF_EVENT_COLL | LAGOM_PROF_EVENT_P2P | LAGOM_PROF_EVENT_PROXY_OP | LAGOM_PROF_EVENT_KERNEL_CH |
               LAGOM_PROF_EVENT_CE_COLL;
  if (ctx == NULL || mask != wanted) fail("v6 init", 0, 0);
  return ctx;
}

/* One collective through the v4 and v5 interfaces: the same record as v6 gives. */
static void older_interfaces(void* lib) {
  lagom_prof_plugin_v4* v4 = dlsym(lib, "ncclProfiler_v4");
  lagom_prof_plugin_v6* v5 = dlsym(lib, "ncclProfiler_v5");
  if (v4 == NULL || v5 == NULL) return fail("v4 or v5 symbol", 0, 0);
  void* c4 = NULL;
  void* c5 = NULL;
  int mask = 0;
  v4->init(&c4, &mask, "v4", 0x44, 1, 2, 0, logger);
  v5->init(&c5, 0x55, &mask, "v5", 1, 2, 0, logger);
  lagom_prof_descr_v4 d4;
  memset(&d4, 0, sizeof d4);
  d4.type = LAGOM_PROF_EVENT_COLL;
  d4.coll.seqNumber = 9;
  d4.coll.func = "AllReduce";
  d4.coll.count = 16;
  d4.coll.datatype = "ncclInt64";
  d4.coll.nChannels = 0; /* no channel to wait for: published at stop */
  d4.coll.algo = "TREE";
  d4.coll.proto = "SIMPLE";
  void* h = NULL;
  v4->startEvent(c4, &h, &d4);
  v4->stopEvent(h);
  lagom_prof_descr_v6 d5;
  memset(&d5, 0, sizeof d5);
  d5.type = LAGOM_PROF_EVENT_COLL;
  d5.coll.base.seqNumber = 9;
  d5.coll.base.func = "AllReduce";
  d5.coll.base.count = 16;
  d5.coll.base.datatype = "ncclInt64";
  d5.coll.base.algo = "TREE";
  d5.coll.base.proto = "SIMPLE";
  v5->startEvent(c5, &h, &d5);
  v5->stopEvent(h);
  lagom_prof_record out[4];
  uint64_t missed = 0;
  size_t n = drain(out, 4, &missed);
  if (n != 2) return fail("v4 and v5 records", n, 2);
  for (size_t i = 0; i < 2; i++) {
    if (out[i].seq_number != 9 || out[i].count != 16 || out[i].type_size != 8 || out[i].func != 4 ||
        out[i].algorithm != 0 || out[i].protocol != 2 || out[i].comm_hash != (i == 0 ? 0x44u : 0x55u)) {
      fail("a v4/v5 record", i, out[i].comm_hash);
    }
  }
  v4->finalize(c4);
  v5->finalize(c5);
}

static void copy_engine_and_malformed(void* ctx) {
  lagom_prof_descr_v6 d;
  memset(&d, 0, sizeof d);
  d.type = LAGOM_PROF_EVENT_CE_COLL;
  d.ceColl.seqNumber = 5;
  d.ceColl.func = "AllGather";
  d.ceColl.count = 64;
  d.ceColl.datatype = "ncclUint8";
  void* h = NULL;
  v6->startEvent(ctx, &h, &d);
  v6->stopEvent(h);
  /* malformed: none of these records anything */
  v6->startEvent(ctx, &h, NULL);
  if (h != NULL) fail("a handle without a descriptor", 0, 0);
  memset(&d, 0, sizeof d);
  d.type = (uint64_t)1 << 40; /* an event type from a later NCCL */
  v6->startEvent(ctx, &h, &d);
  if (h != NULL) fail("a handle for an unknown type", 0, 0);
  char stray[256];
  memset(stray, 0, sizeof stray);
  d.type = LAGOM_PROF_EVENT_KERNEL_CH;
  d.parentObj = stray;
  v6->startEvent(ctx, &h, &d);
  if (h != NULL) fail("a channel of a parent the plugin never made", 0, 0);
  d.type = LAGOM_PROF_EVENT_PROXY_OP; /* a network operation of a parent that is not ours, or of none */
  d.proxyOp.pid = getpid();
  d.proxyOp.chunkSize = 1 << 20;
  v6->startEvent(ctx, &h, &d);
  d.parentObj = NULL;
  v6->startEvent(ctx, &h, &d);
  if (h != NULL) fail("a handle for a network proxy operation", 0, 0);
  v6->stopEvent(stray);
  v6->stopEvent(NULL);
  v6->recordEventState(stray, LAGOM_PROF_STATE_KERNEL_CH_STOP, NULL);
  v6->recordEventState(NULL, LAGOM_PROF_STATE_KERNEL_CH_STOP, NULL);
  v6->startEvent(ctx, NULL, &d);
  v6->finalize(NULL);
  lagom_prof_record out[4];
  uint64_t missed = 0;
  size_t n = drain(out, 4, &missed);
  if (n != 1 || out[0].kind != LAGOM_PROF_KIND_COPY_ENGINE || out[0].seq_number != 5 || out[0].func != 2 ||
      out[0].count != 64 || out[0].type_size != 1 || out[0].gpu_stop_ns != 0) {
    fail("the copy-engine record, or a record from malformed calls", n, 1);
  }
}

/* More collectives than the ring holds, none drained: the oldest are dropped and counted. */
static void full_ring(void* ctx) {
  const int extra = 77;
  const int total = 8192 + extra;
  for (int seq = 0; seq < total; seq++) {
    lagom_prof_descr_v6 d;
    memset(&d, 0, sizeof d);
    d.type = LAGOM_PROF_EVENT_COLL;
    d.coll.base.seqNumber = (uint64_t)seq;
    d.coll.base.func = "AllReduce";
    d.coll.base.count = (size_t)seq;
    d.coll.base.datatype = "ncclFloat32";
    void* h = NULL;
    v6->startEvent(ctx, &h, &d);
    v6->stopEvent(h);
  }
  static lagom_prof_record out[8192 + 100];
  uint64_t missed = 0;
  size_t n = drain(out, 8192 + 100, &missed);
  if (n != 8192 || missed != (uint64_t)extra || out[0].seq_number != (uint64_t)extra ||
      out[n - 1].seq_number != (uint64_t)total - 1) {
    fail("a full ring", n, missed);
  }
  for (size_t i = 0; i < n; i++) {
    if (out[i].count != out[i].seq_number) fail("a torn record in a full ring", i, out[i].count);
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: nccl_profiler_stress PLUGIN.so\n");
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "stress: %s\n", dlerror());
    return 1;
  }
  v6 = dlsym(lib, "ncclProfiler_v6"); /* the symbol names NCCL looks up, newest first */
  drain = (drain_fn)dlsym(lib, "lagom_profiler_drain");
  stats = (stats_fn)dlsym(lib, "lagom_profiler_stats");
  read_all = (read_fn)dlsym(lib, "lagom_profiler_read");
  if (v6 == NULL || drain == NULL || stats == NULL || read_all == NULL) return fprintf(stderr, "stress: symbols\n"), 1;
  if (dlsym(lib, "ncclProfiler_v7") != NULL) fail("a v7 symbol with v6's layout", 0, 0);
  if (strcmp(v6->name, "Lagom") != 0) fail("name", 0, 0);

  launcher launchers[LAUNCHERS];
  pthread_t threads[2 * LAUNCHERS + 1];
  for (int i = 0; i < LAUNCHERS; i++) {
    memset(&launchers[i], 0, sizeof launchers[i]);
    launchers[i].index = i;
    launchers[i].context = init_comm(0x100 + (uint64_t)i, 8);
  }
  pthread_create(&threads[2 * LAUNCHERS], NULL, read_ring, NULL);
  for (int i = 0; i < LAUNCHERS; i++) {
    pthread_create(&threads[2 * i], NULL, launch, &launchers[i]);
    pthread_create(&threads[2 * i + 1], NULL, proxy, &launchers[i]);
  }
  for (int i = 0; i < 2 * LAUNCHERS; i++) pthread_join(threads[i], NULL);
  atomic_store(&launching_done, 1);
  pthread_join(threads[2 * LAUNCHERS], NULL);
  uint64_t counters[LAGOM_PROF_STATS_WORDS];
  stats(counters, LAGOM_PROF_STATS_WORDS);
  lagom_prof_stats s;
  memcpy(&s, counters, sizeof s);
  if (drained + overwritten + s.lost_writes + s.no_slot != (uint64_t)LAUNCHERS * COLLECTIVES || s.in_flight != 0 ||
      s.version != 6 || s.communicators != LAUNCHERS) {
    fail("every collective drained or counted as dropped", drained, overwritten);
  }
  printf("threads: %llu drained, %llu overwritten, %llu lost, %llu without a slot\n", (unsigned long long)drained,
         (unsigned long long)overwritten, (unsigned long long)s.lost_writes, (unsigned long long)s.no_slot);

  void* ctx = init_comm(0x200, 2);
  older_interfaces(lib);
  copy_engine_and_malformed(ctx);
  full_ring(ctx);
  for (int i = 0; i < LAUNCHERS; i++) v6->finalize(launchers[i].context);
  v6->finalize(ctx);
  if (failures != 0) return 1;
  printf("stress ok\n");
  return 0;
}
