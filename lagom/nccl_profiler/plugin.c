/*
 * Lagom's NCCL profiler plugin: one record per collective and per send or receive, with what NCCL ran and when
 * (see lagom_nccl_profiler.h for the events and the record).
 *
 * NCCL stops a Coll or P2p event on the launching thread before its kernel runs, and reports the kernel's
 * channels later from its proxy thread, with the event's handle as their parent. So an operation lives in an
 * in-flight slot from its start until its stop and every channel it announced (the descriptor's nChannels)
 * have reported; whichever of those calls comes last writes the record into the ring (ring.c). A network
 * ProxyOp of the operation, reported by the proxy thread before that channel's kernel-channel events, gives its
 * chunk while the slot waits.
 * Slots are a fixed pool taken with one CAS: nothing on NCCL's path allocates, locks, logs or does I/O, and
 * every entry point returns success. A full pool costs the collective its record (counted as no_slot); a
 * collective whose channels never all report keeps its slot until its communicator is finalized
 * (counted as abandoned).
 *
 * Handles. A Coll or P2p event's handle is its slot; a kernel channel's handle is the slot's ``channel`` member
 * (channels only move the slot's GPU times, so all of one collective's channels share it). stopEvent and
 * recordEventState accept only pointers into the pool, so a stray handle is ignored, not followed.
 *
 * Python reads the ring and the counters together through lagom_profiler_read, once per step (ctypes reaches the
 * instance NCCL loaded: the same file opened twice is one library); lagom_profiler_drain and lagom_profiler_stats
 * do each alone, and lagom_profiler_communicators copies the communicators NCCL initialised.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lagom_nccl_profiler.h"
#include "ring.h"

#define EXPORT __attribute__((visibility("default")))
#define PLUGIN_NAME "Lagom"
#define SLOTS 1024u
#define COMMUNICATORS 256u

enum { SLOT_FREE = 0, SLOT_TAKEN = 1 };

typedef struct slot slot;
typedef struct {
  slot* parent;
} channel_handle;

typedef struct {
  uint64_t comm_hash;
  uint32_t n_ranks, n_nodes;
  int32_t rank;
  int gpu_times;            /* whether kernel-channel (and network proxy) events were asked for */
  _Atomic uint64_t p2p_seq; /* sends and receives started: their records' sequence numbers */
} comm_context;

struct slot {
  _Atomic int state;
  _Atomic int pending; /* the Coll stop plus the channels still to report; the call that brings it to 0 publishes */
  _Atomic(const comm_context*) owner;
  lagom_prof_record record; /* written by startEvent before NCCL sees the handle */
  _Atomic uint64_t gpu_start, gpu_stop, host_stop;
  _Atomic uint32_t proxy_chunk;
  _Atomic int channel_events;
  channel_handle channel;
};

static slot pool[SLOTS];
static _Atomic uint32_t next_slot = 0;
static lagom_prof_comm_info communicators[COMMUNICATORS];
static size_t communicator_count = 0; /* under ``communicators_lock``: taken at init and by Python, never per event */
static pthread_mutex_t communicators_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t stat_no_slot = 0, stat_lost = 0, stat_abandoned = 0, stat_inits = 0, stat_version = 0;
static _Atomic uint64_t stat_overwritten = 0;
static _Atomic int64_t stat_in_flight = 0;
static _Atomic pid_t own_pid = 0; /* this process, as a ProxyOp names the process of its parent event (set at init) */

static uint64_t host_now_ns(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}

/* A string's index in ``names`` (NULL-terminated), or LAGOM_PROF_UNKNOWN. */
static uint8_t lookup(const char* text, const char* const* names) {
  if (text == NULL) return LAGOM_PROF_UNKNOWN;
  for (uint8_t i = 0; names[i] != NULL; i++) {
    if (names[i][0] != '\0' && strcmp(text, names[i]) == 0) return i;
  }
  return LAGOM_PROF_UNKNOWN;
}

/* NCCL's names, indexed by ncclFunc_t, NCCL_ALGO_* and NCCL_PROTO_* ("" marks an id NCCL never names here). */
static const char* const FUNCTIONS[] = {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce", "SendRecv",
                                        "Send", "Recv", "AlltoAll", "Scatter", "Gather", NULL};
static const char* const ALGORITHMS[] = {"TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE",
                                         "PAT", NULL};
static const char* const PROTOCOLS[] = {"LL", "LL128", "SIMPLE", NULL};

static uint8_t type_size(const char* datatype) {
  static const char* const ONE[] = {"ncclInt8", "ncclUint8", "ncclFloat8e4m3", "ncclFloat8e5m2", NULL};
  static const char* const TWO[] = {"ncclFloat16", "ncclBfloat16", NULL};
  static const char* const FOUR[] = {"ncclInt32", "ncclUint32", "ncclFloat32", NULL};
  static const char* const EIGHT[] = {"ncclInt64", "ncclUint64", "ncclFloat64", NULL};
  if (lookup(datatype, ONE) != LAGOM_PROF_UNKNOWN) return 1;
  if (lookup(datatype, TWO) != LAGOM_PROF_UNKNOWN) return 2;
  if (lookup(datatype, FOUR) != LAGOM_PROF_UNKNOWN) return 4;
  if (lookup(datatype, EIGHT) != LAGOM_PROF_UNKNOWN) return 8;
  return 0;
}

static void publish(const lagom_prof_record* record) {
  if (lagom_ring_push(record) != 0) atomic_fetch_add_explicit(&stat_lost, 1, memory_order_relaxed);
}

/* A free slot, taken; NULL when all SLOTS are in flight. */
static slot* take_slot(void) {
  uint32_t start = atomic_fetch_add_explicit(&next_slot, 1, memory_order_relaxed);
  for (uint32_t i = 0; i < SLOTS; i++) {
    slot* s = &pool[(start + i) % SLOTS];
    int free_state = SLOT_FREE;
    if (atomic_compare_exchange_strong_explicit(&s->state, &free_state, SLOT_TAKEN, memory_order_acquire,
                                                memory_order_relaxed)) {
      atomic_fetch_add_explicit(&stat_in_flight, 1, memory_order_relaxed);
      return s;
    }
  }
  atomic_fetch_add_explicit(&stat_no_slot, 1, memory_order_relaxed);
  return NULL;
}

static void release_slot(slot* s) {
  atomic_fetch_sub_explicit(&stat_in_flight, 1, memory_order_relaxed);
  atomic_store_explicit(&s->state, SLOT_FREE, memory_order_release);
}

/* Counts one of the slot's pending reports done; the last one writes the record and frees the slot. */
static void report_done(slot* s) {
  if (atomic_fetch_sub_explicit(&s->pending, 1, memory_order_acq_rel) != 1) return;
  lagom_prof_record record = s->record;
  record.host_stop_ns = atomic_load_explicit(&s->host_stop, memory_order_relaxed);
  int channels = atomic_load_explicit(&s->channel_events, memory_order_relaxed);
  record.channel_events = (uint8_t)(channels > 255 ? 255 : channels);
  record.proxy_chunk_bytes = atomic_load_explicit(&s->proxy_chunk, memory_order_relaxed);
  if (channels > 0) {
    record.gpu_start_ns = atomic_load_explicit(&s->gpu_start, memory_order_relaxed);
    record.gpu_stop_ns = atomic_load_explicit(&s->gpu_stop, memory_order_relaxed);
  }
  release_slot(s);
  publish(&record);
}

/* The slot a pointer from NCCL is, or NULL when it is not one of ours. */
static slot* as_slot(const void* handle) {
  uintptr_t p = (uintptr_t)handle, base = (uintptr_t)pool;
  if (p < base || p >= base + sizeof pool || (p - base) % sizeof(slot) != 0) return NULL;
  return (slot*)handle;
}

/* The slot whose channel handle a pointer is, or NULL. */
static slot* as_channel_parent(const void* handle) {
  uintptr_t p = (uintptr_t)handle, base = (uintptr_t)pool;
  if (p < base || p >= base + sizeof pool || (p - base) % sizeof(slot) != offsetof(slot, channel)) return NULL;
  return ((const channel_handle*)handle)->parent;
}

static void atomic_min(_Atomic uint64_t* target, uint64_t value) {
  uint64_t seen = atomic_load_explicit(target, memory_order_relaxed);
  while ((seen == 0 || value < seen) &&
         !atomic_compare_exchange_weak_explicit(target, &seen, value, memory_order_relaxed, memory_order_relaxed)) {
  }
}

static void atomic_max(_Atomic uint64_t* target, uint64_t value) {
  uint64_t seen = atomic_load_explicit(target, memory_order_relaxed);
  while (value > seen &&
         !atomic_compare_exchange_weak_explicit(target, &seen, value, memory_order_relaxed, memory_order_relaxed)) {
  }
}

/* A slot for a new operation of this communicator, its record's common fields set and its times cleared; the
   caller sets what its kind adds and publishes the slot by storing ``pending`` last. NULL when the pool is full. */
static slot* begin_record(const comm_context* ctx, void** handle, int rank, uint64_t seq_number, uint64_t count,
                          const char* func, const char* datatype, uint8_t kind) {
  slot* s = take_slot();
  *handle = s;
  if (s == NULL) return NULL;
  lagom_prof_record* r = &s->record;
  memset(r, 0, sizeof *r);
  r->comm_hash = ctx->comm_hash;
  r->n_ranks = ctx->n_ranks;
  r->rank = rank;
  r->seq_number = seq_number;
  r->count = count;
  r->func = lookup(func, FUNCTIONS);
  r->type_size = type_size(datatype);
  r->kind = kind;
  r->peer = -1;
  r->host_start_ns = host_now_ns();
  atomic_store_explicit(&s->owner, ctx, memory_order_relaxed);
  s->channel.parent = s;
  atomic_store_explicit(&s->gpu_start, 0, memory_order_relaxed);
  atomic_store_explicit(&s->gpu_stop, 0, memory_order_relaxed);
  atomic_store_explicit(&s->host_stop, 0, memory_order_relaxed);
  atomic_store_explicit(&s->proxy_chunk, 0, memory_order_relaxed);
  atomic_store_explicit(&s->channel_events, 0, memory_order_relaxed);
  return s;
}

/* A collective's fields as every version gives them (v4 .. v6 share the Coll layout up to proto). */
static void start_coll(const comm_context* ctx, void** handle, const lagom_prof_coll_v4* coll, int rank) {
  slot* s = begin_record(ctx, handle, rank, coll->seqNumber, coll->count, coll->func, coll->datatype,
                         LAGOM_PROF_KIND_KERNEL);
  if (s == NULL) return;
  s->record.algorithm = lookup(coll->algo, ALGORITHMS);
  s->record.protocol = lookup(coll->proto, PROTOCOLS);
  s->record.channels = coll->nChannels;
  s->record.warps = coll->nWarps;
  atomic_store_explicit(&s->pending, 1 + (ctx->gpu_times ? coll->nChannels : 0), memory_order_release);
}

/* A send or receive (v4 .. v6 share the P2p layout up to nChannels): no algorithm or protocol, no sequence number
   from NCCL (the communicator's own count stands in). */
static void start_p2p(comm_context* ctx, void** handle, const lagom_prof_p2p_v4* p2p, int rank) {
  uint64_t seq = atomic_fetch_add_explicit(&ctx->p2p_seq, 1, memory_order_relaxed);
  slot* s = begin_record(ctx, handle, rank, seq, p2p->count, p2p->func, p2p->datatype, LAGOM_PROF_KIND_KERNEL);
  if (s == NULL) return;
  s->record.algorithm = LAGOM_PROF_UNKNOWN;
  s->record.protocol = LAGOM_PROF_UNKNOWN;
  s->record.peer = p2p->peer;
  s->record.channels = p2p->nChannels;
  atomic_store_explicit(&s->pending, 1 + (ctx->gpu_times ? p2p->nChannels : 0), memory_order_release);
}

/* A copy-engine collective (v6): no algorithm, protocol or kernel channels; host times only. */
static void start_ce_coll(const comm_context* ctx, void** handle, const lagom_prof_ce_coll* ce, int rank) {
  slot* s = begin_record(ctx, handle, rank, ce->seqNumber, ce->count, ce->func, ce->datatype,
                         LAGOM_PROF_KIND_COPY_ENGINE);
  if (s == NULL) return;
  s->record.algorithm = LAGOM_PROF_UNKNOWN;
  s->record.protocol = LAGOM_PROF_UNKNOWN;
  atomic_store_explicit(&s->pending, 1, memory_order_release);
}

/* A network proxy operation of one of this process's operations: its chunk, kept while the operation still waits
   for its channels (the first one that reports; all of an operation's proxy operations share the chunk). No handle:
   the plugin needs neither its stop nor its states. A proxy operation of another process's operation (PXN, where
   this process's proxy moves a peer's data) names a parent in that process, and is ignored. */
static void start_proxy_op(void* parent_handle, const lagom_prof_proxy_op* op) {
  slot* parent = as_slot(parent_handle);
  if (parent == NULL || op->pid != atomic_load_explicit(&own_pid, memory_order_relaxed) || op->chunkSize <= 0) return;
  if (atomic_load_explicit(&parent->state, memory_order_acquire) != SLOT_TAKEN ||
      atomic_load_explicit(&parent->pending, memory_order_acquire) <= 0) {
    return;
  }
  uint32_t none = 0;
  atomic_compare_exchange_strong_explicit(&parent->proxy_chunk, &none, (uint32_t)op->chunkSize, memory_order_relaxed,
                                          memory_order_relaxed);
}

static void start_kernel_channel(void** handle, void* parent_handle, const lagom_prof_kernel_ch* ch) {
  slot* parent = as_slot(parent_handle);
  if (parent == NULL || atomic_load_explicit(&parent->state, memory_order_acquire) != SLOT_TAKEN) return;
  if (ch->pTimer != 0) atomic_min(&parent->gpu_start, ch->pTimer);
  atomic_fetch_add_explicit(&parent->channel_events, 1, memory_order_relaxed);
  *handle = &parent->channel;
}

/* One start for every version, given the descriptor's common fields and the member its type selects. */
static lagom_prof_result start_event(void* context, void** handle, uint64_t type, void* parent, int rank,
                                     const void* payload) {
  if (handle == NULL) return LAGOM_PROF_SUCCESS;
  *handle = NULL;
  comm_context* ctx = context;
  if (ctx == NULL || payload == NULL) return LAGOM_PROF_SUCCESS;
  switch (type) {
    case LAGOM_PROF_EVENT_COLL: start_coll(ctx, handle, payload, rank); break;
    case LAGOM_PROF_EVENT_P2P: start_p2p(ctx, handle, payload, rank); break;
    case LAGOM_PROF_EVENT_CE_COLL: start_ce_coll(ctx, handle, payload, rank); break;
    case LAGOM_PROF_EVENT_KERNEL_CH: start_kernel_channel(handle, parent, payload); break;
    case LAGOM_PROF_EVENT_PROXY_OP: start_proxy_op(parent, payload); break;
    default: break; /* groups, API events, proxy steps, and types this plugin does not know */
  }
  return LAGOM_PROF_SUCCESS;
}

static lagom_prof_result start_v6(void* context, void** handle, lagom_prof_descr_v6* descr) {
  if (descr == NULL) return start_event(context, handle, 0, NULL, 0, NULL);
  return start_event(context, handle, descr->type, descr->parentObj, descr->rank, &descr->coll);
}

static lagom_prof_result start_v5(void* context, void** handle, lagom_prof_descr_v6* descr) {
  /* NCCL never sends v5 a copy-engine event; a descriptor that says so is not trusted with v6's layout. */
  if (descr == NULL || descr->type == LAGOM_PROF_EVENT_CE_COLL) return start_event(context, handle, 0, NULL, 0, NULL);
  return start_v6(context, handle, descr);
}

static lagom_prof_result start_v4(void* context, void** handle, lagom_prof_descr_v4* descr) {
  /* v4's one-byte type cannot name a copy-engine event. */
  if (descr == NULL) return start_event(context, handle, 0, NULL, 0, NULL);
  return start_event(context, handle, descr->type, descr->parentObj, descr->rank, &descr->coll);
}

static lagom_prof_result stop_event(void* handle) {
  slot* s = as_slot(handle);
  if (s != NULL) {
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_TAKEN) return LAGOM_PROF_SUCCESS;
    atomic_store_explicit(&s->host_stop, host_now_ns(), memory_order_relaxed);
    report_done(s);
    return LAGOM_PROF_SUCCESS;
  }
  slot* parent = as_channel_parent(handle);
  if (parent != NULL && atomic_load_explicit(&parent->state, memory_order_acquire) == SLOT_TAKEN) report_done(parent);
  return LAGOM_PROF_SUCCESS;
}

static lagom_prof_result record_state(void* handle, int state, lagom_prof_state_args* args) {
  slot* parent = as_channel_parent(handle);
  if (parent == NULL || state != LAGOM_PROF_STATE_KERNEL_CH_STOP || args == NULL) return LAGOM_PROF_SUCCESS;
  if (atomic_load_explicit(&parent->state, memory_order_acquire) == SLOT_TAKEN && args->kernelCh.pTimer != 0) {
    atomic_max(&parent->gpu_stop, args->kernelCh.pTimer);
  }
  return LAGOM_PROF_SUCCESS;
}

static int gpu_times_wanted(void) {
  const char* text = getenv(LAGOM_PROF_GPU_TIMES_ENV);
  return text == NULL || strcmp(text, "0") != 0;
}

static void remember_communicator(const comm_context* ctx, const char* name) {
  pthread_mutex_lock(&communicators_lock);
  if (communicator_count == COMMUNICATORS) {
    pthread_mutex_unlock(&communicators_lock);
    return;
  }
  lagom_prof_comm_info* info = &communicators[communicator_count++];
  info->comm_hash = ctx->comm_hash;
  info->n_ranks = ctx->n_ranks;
  info->n_nodes = ctx->n_nodes;
  info->rank = ctx->rank;
  if (name != NULL) {
    strncpy(info->name, name, LAGOM_PROF_COMM_NAME_BYTES - 1);
    info->name[LAGOM_PROF_COMM_NAME_BYTES - 1] = '\0';
  }
  pthread_mutex_unlock(&communicators_lock);
}

static lagom_prof_result init_common(void** context, int* mask, uint64_t comm_hash, const char* name, int n_nodes,
                                     int n_ranks, int rank, lagom_prof_logger logger, int version) {
  atomic_fetch_add_explicit(&stat_inits, 1, memory_order_relaxed);
  atomic_store_explicit(&stat_version, (uint64_t)version, memory_order_relaxed);
  atomic_store_explicit(&own_pid, getpid(), memory_order_relaxed); /* again after a fork: the child's communicators */
  if (context == NULL) return LAGOM_PROF_SUCCESS;
  comm_context* ctx = calloc(1, sizeof *ctx); /* once per communicator, not per collective */
  *context = ctx;
  if (ctx == NULL) {
    if (mask != NULL) *mask = 0;
    if (logger != NULL) logger(LAGOM_PROF_LOG_WARN, LAGOM_PROF_SUBSYS_INIT, __FILE__, __LINE__, "%s",
                               "Lagom profiler: out of memory; this communicator is not profiled");
    return LAGOM_PROF_SUCCESS;
  }
  ctx->comm_hash = comm_hash;
  ctx->n_ranks = n_ranks > 0 ? (uint32_t)n_ranks : 0;
  ctx->n_nodes = n_nodes > 0 ? (uint32_t)n_nodes : 0;
  ctx->rank = rank;
  ctx->gpu_times = gpu_times_wanted();
  /* Network proxy operations only with kernel channels: without them a record is written at its stop, before the
     proxy thread sees the operation, and a later ProxyOp would find its slot freed or another operation's. */
  int wanted = LAGOM_PROF_EVENT_COLL | LAGOM_PROF_EVENT_P2P |
               (ctx->gpu_times ? LAGOM_PROF_EVENT_KERNEL_CH | LAGOM_PROF_EVENT_PROXY_OP : 0) |
               (version >= 6 ? LAGOM_PROF_EVENT_CE_COLL : 0);
  /* The mask is NCCL's, one for the process: keep what another communicator (or plugin user) asked for. */
  if (mask != NULL) *mask |= wanted;
  remember_communicator(ctx, name);
  if (logger != NULL) {
    logger(LAGOM_PROF_LOG_INFO, LAGOM_PROF_SUBSYS_INIT | LAGOM_PROF_SUBSYS_PROFILE, __FILE__, __LINE__,
           "Lagom profiler v%d: communicator %llx (%d ranks) recorded, %s times", version,
           (unsigned long long)comm_hash, n_ranks, ctx->gpu_times ? "GPU" : "host");
  }
  return LAGOM_PROF_SUCCESS;
}

static lagom_prof_result init_v6(void** context, uint64_t comm_id, int* mask, const char* name, int n_nodes,
                                 int n_ranks, int rank, lagom_prof_logger logger) {
  return init_common(context, mask, comm_id, name, n_nodes, n_ranks, rank, logger, 6);
}

static lagom_prof_result init_v5(void** context, uint64_t comm_id, int* mask, const char* name, int n_nodes,
                                 int n_ranks, int rank, lagom_prof_logger logger) {
  return init_common(context, mask, comm_id, name, n_nodes, n_ranks, rank, logger, 5);
}

static lagom_prof_result init_v4(void** context, int* mask, const char* name, uint64_t comm_hash, int n_nodes,
                                 int n_ranks, int rank, lagom_prof_logger logger) {
  return init_common(context, mask, comm_hash, name, n_nodes, n_ranks, rank, logger, 4);
}

/* Frees the communicator's context and the slots of its collectives still waiting for channel events (NCCL
 * sends no event of a communicator after its finalize). */
static lagom_prof_result finalize(void* context) {
  comm_context* ctx = context;
  if (ctx == NULL) return LAGOM_PROF_SUCCESS;
  for (uint32_t i = 0; i < SLOTS; i++) {
    slot* s = &pool[i];
    if (atomic_load_explicit(&s->state, memory_order_acquire) == SLOT_TAKEN &&
        atomic_load_explicit(&s->owner, memory_order_relaxed) == ctx) {
      atomic_fetch_add_explicit(&stat_abandoned, 1, memory_order_relaxed);
      release_slot(s);
    }
  }
  free(ctx);
  return LAGOM_PROF_SUCCESS;
}

/* Copies up to ``max`` records (oldest first) into ``out``; returns how many, and in *overwritten the records the
 * ring dropped since the last drain. One reader at a time. */
EXPORT size_t lagom_profiler_drain(lagom_prof_record* out, size_t max, uint64_t* overwritten) {
  uint64_t missed = 0;
  size_t n = out == NULL ? 0 : lagom_ring_drain(out, max, &missed);
  atomic_fetch_add_explicit(&stat_overwritten, missed, memory_order_relaxed);
  if (overwritten != NULL) *overwritten = missed;
  return n;
}

/* The counters, in lagom_prof_stats' order, into ``out`` (at most ``words`` of them); returns how many exist. */
EXPORT size_t lagom_profiler_stats(uint64_t* out, size_t words) {
  int64_t in_flight = atomic_load_explicit(&stat_in_flight, memory_order_relaxed);
  lagom_prof_stats stats = {
      .published = lagom_ring_written(),
      .overwritten = atomic_load_explicit(&stat_overwritten, memory_order_relaxed),
      .no_slot = atomic_load_explicit(&stat_no_slot, memory_order_relaxed),
      .lost_writes = atomic_load_explicit(&stat_lost, memory_order_relaxed),
      .abandoned = atomic_load_explicit(&stat_abandoned, memory_order_relaxed),
      .in_flight = in_flight > 0 ? (uint64_t)in_flight : 0,
      .communicators = atomic_load_explicit(&stat_inits, memory_order_relaxed),
      .version = atomic_load_explicit(&stat_version, memory_order_relaxed),
  };
  uint64_t words_all[LAGOM_PROF_STATS_WORDS];
  memcpy(words_all, &stats, sizeof stats);
  for (size_t i = 0; out != NULL && i < words && i < LAGOM_PROF_STATS_WORDS; i++) out[i] = words_all[i];
  return LAGOM_PROF_STATS_WORDS;
}

/* One drain and the counters after it, in one call (Python's reader, once per step): copies up to ``max`` records
 * into ``out`` as lagom_profiler_drain does, then writes into ``counters`` (at most ``words`` of them) the records
 * this drain found dropped, followed by lagom_profiler_stats' counters in their order. Returns the records copied. */
EXPORT size_t lagom_profiler_read(lagom_prof_record* out, size_t max, uint64_t* counters, size_t words) {
  uint64_t all[1 + LAGOM_PROF_STATS_WORDS];
  size_t n = lagom_profiler_drain(out, max, &all[0]);
  lagom_profiler_stats(&all[1], LAGOM_PROF_STATS_WORDS);
  for (size_t i = 0; counters != NULL && i < words && i < 1 + LAGOM_PROF_STATS_WORDS; i++) counters[i] = all[i];
  return n;
}

/* Copies the communicators NCCL initialised (hash, ranks, nodes, rank, name; at most ``max``); returns how many. */
EXPORT size_t lagom_profiler_communicators(lagom_prof_comm_info* out, size_t max) {
  pthread_mutex_lock(&communicators_lock);
  size_t n = communicator_count < max ? communicator_count : max;
  if (out != NULL && n > 0) memcpy(out, communicators, n * sizeof *out);
  pthread_mutex_unlock(&communicators_lock);
  return n;
}

/* Records the ring holds: one drain of this many takes everything. */
EXPORT size_t lagom_profiler_capacity(void) { return LAGOM_RING_CAPACITY; }

/* Test hook: writes ``record`` into the ring as a finished collective would (CPU tests and the benchmark). */
EXPORT void lagom_profiler_test_push(const lagom_prof_record* record) {
  if (record != NULL) publish(record);
}

EXPORT lagom_prof_plugin_v6 ncclProfiler_v6 = {PLUGIN_NAME, init_v6, start_v6, stop_event, record_state, finalize};
EXPORT lagom_prof_plugin_v6 ncclProfiler_v5 = {PLUGIN_NAME, init_v5, start_v5, stop_event, record_state, finalize};
EXPORT lagom_prof_plugin_v4 ncclProfiler_v4 = {PLUGIN_NAME, init_v4, start_v4, stop_event, record_state, finalize};
