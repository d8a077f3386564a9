/*
 * Lagom's NCCL profiler plugin: the binary interface it shares with NCCL, and the record it hands to Python.
 *
 * NCCL loads the library named by NCCL_PROFILER_PLUGIN and looks up the newest interface it knows:
 * ncclProfiler_v6 (NCCL 2.29, 2.30), ncclProfiler_v5 (2.28), ncclProfiler_v4 (2.27). Each symbol is a struct
 * of a name and five function pointers (init, startEvent, stopEvent, recordEventState, finalize). v6 is the
 * newest any release defines: NVIDIA/nccl's tags up to v2.30.7-1 and its master branch (June 2026) have
 * profiler_v1.h .. profiler_v6.h; a v7 header exists only in an unmerged pull request, so there is no v7 to
 * export (an ncclProfiler_v7 symbol with another layout would be read with v7's). The declarations below
 * restate the parts of that ABI the plugin reads (member order and types, enum values, symbol names) under
 * Lagom's own names; nothing here needs NCCL's headers or CUDA. tests/nccl_profiler_abi.c checks every offset
 * against NCCL's own headers.
 *
 * The events the plugin asks for, and when NCCL sends them (v4 .. v6):
 *   - Coll: started and stopped on the thread that launches a plan, before the kernel runs. The
 *     descriptor carries the sequence number, function, element count and datatype, and what NCCL chose:
 *     algorithm, protocol, channels and warps (names as strings). It has no chunk.
 *   - P2p: one send or receive of a launch, started and stopped beside the Coll events: function ("Send",
 *     "Recv"), element count and datatype, the peer's rank and the channels NCCL split it over. No sequence
 *     number, algorithm or protocol (NCCL's p2p has neither).
 *   - KernelCh: one per channel a Coll or P2p uses (as many as its descriptor's nChannels), started and
 *     stopped by NCCL's proxy thread once the kernel has run; parentObj is the Coll or P2p event's handle.
 *     Start gives the channel's start GPU timestamp (globaltimer, ns), the KernelChStop state its end.
 *   - ProxyOp (asked for with KernelCh): one per channel and peer of the operations NCCL's proxy thread moves
 *     over the network; parentObj is the Coll or P2p event's handle, pid the process that made it. Its
 *     chunkSize is the only place any version gives the chunk NCCL ran: NCCL's chunk times its slice steps
 *     (2 for ring all-reduce, all-gather and reduce-scatter on SIMPLE, else 1). Transfers inside a node
 *     (NVLink, PCIe, shared memory) have no proxy operation, so their chunk is not reported at all.
 *     NCCL appends a channel's network operations to its proxy before that channel's kernel-channel
 *     operation, so they report while the collective still waits for its channels.
 *   - CeColl (v6): a collective run by copy engines (CTA policy ZERO); no channels and no GPU timer.
 * Every other event the mask does not exclude (Group, CollApi, ProxyStep, ...) gets a NULL handle, which
 * NCCL never stops; a ProxyOp gets one too (the plugin reads its descriptor at start and needs no stop).
 */
#ifndef LAGOM_NCCL_PROFILER_H
#define LAGOM_NCCL_PROFILER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* ncclResult_t. Every entry point returns success: an error would cost the job its collectives. */
typedef enum { LAGOM_PROF_SUCCESS = 0 } lagom_prof_result;

/* ncclDebugLogger_t (level, subsystem bits, file, line, printf format, ...). */
typedef void (*lagom_prof_logger)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);
enum { LAGOM_PROF_LOG_WARN = 2, LAGOM_PROF_LOG_INFO = 3 };
enum { LAGOM_PROF_SUBSYS_INIT = 0x1, LAGOM_PROF_SUBSYS_PROFILE = 0x4000 };

/* Event type bits (the descriptor's type and the activation mask). */
enum {
  LAGOM_PROF_EVENT_GROUP = 1 << 0,
  LAGOM_PROF_EVENT_COLL = 1 << 1,
  LAGOM_PROF_EVENT_P2P = 1 << 2,
  LAGOM_PROF_EVENT_PROXY_OP = 1 << 3,
  LAGOM_PROF_EVENT_KERNEL_CH = 1 << 6,
  LAGOM_PROF_EVENT_CE_COLL = 1 << 12, /* v6 */
};

/* The state recorded when a kernel channel ends (its state argument carries the end GPU timestamp). */
enum { LAGOM_PROF_STATE_KERNEL_CH_STOP = 22 };

/* The Coll descriptor's fields, in v4's order; v5 and v6 append parentGroup. */
typedef struct {
  uint64_t seqNumber;
  const char* func;
  const void* sendBuff;
  void* recvBuff;
  size_t count; /* elements: per rank for all-gather (its send count) and reduce-scatter (its receive count) */
  int root;
  const char* datatype;
  uint8_t nChannels;
  uint8_t nWarps;
  const char* algo;
  const char* proto;
} lagom_prof_coll_v4;

typedef struct {
  lagom_prof_coll_v4 base;
  void* parentGroup;
} lagom_prof_coll_v5;

/* The P2p descriptor's fields, in v4's order; v5 and v6 append parentGroup. */
typedef struct {
  const char* func; /* "Send" or "Recv" */
  void* buff;
  const char* datatype;
  size_t count; /* elements */
  int peer;     /* the other rank, in the communicator */
  uint8_t nChannels;
} lagom_prof_p2p_v4;

typedef struct {
  lagom_prof_p2p_v4 base;
  void* parentGroup;
} lagom_prof_p2p_v5;

/* A network proxy operation (the same in v4 .. v6). */
typedef struct {
  pid_t pid; /* the process whose Coll or P2p event parentObj is */
  uint8_t channelId;
  int peer;
  int nSteps;
  int chunkSize; /* NCCL's chunk times its slice steps, bytes */
  int isSend;
} lagom_prof_proxy_op;

typedef struct {
  uint8_t channelId;
  uint64_t pTimer; /* start GPU timestamp */
} lagom_prof_kernel_ch;

/* v6's copy-engine collective. */
typedef struct {
  uint64_t seqNumber;
  const char* func;
  const void* sendBuff;
  void* recvBuff;
  size_t count;
  int root;
  const char* datatype;
  const char* syncStrategy;
  bool intraBatchSync;
  uint32_t batchSize;
  uint32_t numBatches;
  uint32_t ceSeqNum;
  void* stream;
} lagom_prof_ce_coll;

/* v4's event descriptor: a one-byte type. */
typedef struct {
  uint8_t type;
  void* parentObj;
  int rank;
  union {
    lagom_prof_coll_v4 coll;
    lagom_prof_p2p_v4 p2p;
    lagom_prof_proxy_op proxyOp;
    lagom_prof_kernel_ch kernelCh;
  };
} lagom_prof_descr_v4;

/* v5's and v6's event descriptor: an eight-byte type. v5 has no ceColl member, and NCCL never sends a v5
 * plugin a copy-engine event; the members the plugin reads sit at the same offsets in both. */
typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    lagom_prof_coll_v5 coll;
    lagom_prof_p2p_v5 p2p;
    lagom_prof_proxy_op proxyOp;
    lagom_prof_kernel_ch kernelCh;
    lagom_prof_ce_coll ceColl;
  };
} lagom_prof_descr_v6;

/* recordEventState's argument, the same union in v4 .. v6; the plugin reads the kernel channel's end time. */
typedef union {
  struct {
    size_t transSize;
  } proxyStep;
  struct {
    uint64_t pTimer;
  } kernelCh;
} lagom_prof_state_args;

typedef struct {
  const char* name;
  lagom_prof_result (*init)(void** context, uint64_t commId, int* eActivationMask, const char* commName, int nNodes,
                            int nRanks, int rank, lagom_prof_logger logFunction);
  lagom_prof_result (*startEvent)(void* context, void** eHandle, lagom_prof_descr_v6* eDescr);
  lagom_prof_result (*stopEvent)(void* eHandle);
  lagom_prof_result (*recordEventState)(void* eHandle, int eState, lagom_prof_state_args* eStateArgs);
  lagom_prof_result (*finalize)(void* context);
} lagom_prof_plugin_v6; /* also v5's layout (ncclProfiler_v5) */

typedef struct {
  const char* name;
  /* v4's init takes the communicator hash after the name. */
  lagom_prof_result (*init)(void** context, int* eActivationMask, const char* commName, uint64_t commHash, int nNodes,
                            int nRanks, int rank, lagom_prof_logger logFunction);
  lagom_prof_result (*startEvent)(void* context, void** eHandle, lagom_prof_descr_v4* eDescr);
  lagom_prof_result (*stopEvent)(void* eHandle);
  lagom_prof_result (*recordEventState)(void* eHandle, int eState, lagom_prof_state_args* eStateArgs);
  lagom_prof_result (*finalize)(void* context);
} lagom_prof_plugin_v4;

/* ---- Lagom's side: what Python drains (lagom/nccl_profiler/drain.py restates it with ctypes) ---- */

/* Ids the record uses: NCCL's own enum values (ncclFunc_t, NCCL_ALGO_*, NCCL_PROTO_*), found from the
 * descriptor's strings; UNKNOWN where the string is one this plugin does not know. */
enum { LAGOM_PROF_UNKNOWN = 255 };
enum { LAGOM_PROF_KIND_KERNEL = 0, LAGOM_PROF_KIND_COPY_ENGINE = 1 };
/* Where the record's times come from. */
enum { LAGOM_PROF_TIME_HOST = 0, LAGOM_PROF_TIME_GPU = 1 };

/* One collective or send/receive, 80 bytes. Host times are CLOCK_MONOTONIC (Python's time.monotonic_ns): the
 * Coll, P2p or CeColl event's start and stop, i.e. when NCCL prepared and handed off its launch. GPU times are the
 * earliest channel start and latest channel end (globaltimer ns), 0 when no channel reported. */
typedef struct {
  uint64_t comm_hash;
  uint64_t seq_number; /* NCCL's per-function sequence number; for a send/receive (which has none) the plugin's
                          count of this communicator's sends and receives */
  uint64_t count;      /* elements */
  uint64_t host_start_ns;
  uint64_t host_stop_ns;
  uint64_t gpu_start_ns;
  uint64_t gpu_stop_ns;
  uint32_t n_ranks;
  int32_t rank;
  int32_t peer;               /* a send/receive's other rank; -1 for a collective */
  uint32_t proxy_chunk_bytes; /* a network ProxyOp's chunkSize (NCCL's chunk times its slice steps); 0: none came */
  uint8_t func;      /* ncclFunc_t */
  uint8_t algorithm; /* NCCL_ALGO_*; UNKNOWN for a send/receive */
  uint8_t protocol;  /* NCCL_PROTO_*; UNKNOWN for a send/receive */
  uint8_t type_size; /* bytes per element, 0 for an unknown datatype */
  uint8_t channels;
  uint8_t warps;
  uint8_t kind;           /* LAGOM_PROF_KIND_* */
  uint8_t channel_events; /* kernel channels that reported a GPU time (time source GPU when > 0) */
} lagom_prof_record;

#define LAGOM_PROF_RECORD_WORDS (sizeof(lagom_prof_record) / sizeof(uint64_t))

/* Counters since the library was loaded (lagom_profiler_stats fills them in this order). */
typedef struct {
  uint64_t published;        /* records written into the ring */
  uint64_t overwritten;      /* records the ring dropped before a drain read them (oldest first) */
  uint64_t no_slot;          /* collectives not recorded: every in-flight slot was taken */
  uint64_t lost_writes;      /* records dropped because an older write to the same cell was still under way */
  uint64_t abandoned;        /* collectives whose channel events never all came, freed at finalize */
  uint64_t in_flight;        /* collectives started and not yet published */
  uint64_t communicators;    /* init calls */
  uint64_t version;          /* the interface NCCL used last (4, 5, 6), 0 before any init */
} lagom_prof_stats;

#define LAGOM_PROF_STATS_WORDS (sizeof(lagom_prof_stats) / sizeof(uint64_t))

/* A communicator as NCCL described it at init (lagom_profiler_communicators), for Python to map hashes to
 * group names: the name is ncclConfig_t.commName, empty when the job set none. */
#define LAGOM_PROF_COMM_NAME_BYTES 64
typedef struct {
  uint64_t comm_hash;
  uint32_t n_ranks;
  uint32_t n_nodes;
  int32_t rank;
  char name[LAGOM_PROF_COMM_NAME_BYTES];
} lagom_prof_comm_info;

/* Environment: set to 0 to leave kernel-channel events off (host times only, no extra proxy work in NCCL). */
#define LAGOM_PROF_GPU_TIMES_ENV "LAGOM_NCCL_PROFILER_GPU_TIMES"

#endif
