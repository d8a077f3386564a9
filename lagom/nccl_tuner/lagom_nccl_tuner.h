/*
 * Lagom's NCCL tuner plugin: the binary interface it shares with NCCL.
 *
 * NCCL loads the library named by NCCL_TUNER_PLUGIN and looks up the newest interface it knows:
 * ncclTunerPlugin_v7 (NCCL >= 2.32), ncclTunerPlugin_v6 (2.30, 2.31), ncclTunerPlugin_v5 (2.28, 2.29),
 * ncclTunerPlugin_v4 (2.24 .. 2.27). A plugin without the newest symbol is still loaded through an older
 * one, but loses what that interface adds; v7 changes only the tuning-constants table init passes (rows
 * for more GPU generations), which this plugin never reads, so it exports v7 with v6's functions.
 * Each symbol is a struct of a name and function pointers. The declarations below restate that ABI
 * (member order, argument types, enum values, symbol names) under Lagom's own names; nothing here
 * needs NCCL's headers or CUDA.
 *
 * What tells communicators apart. NCCL calls init once per communicator with:
 *   - nRanks and nNodes: the communicator's rank count and node count;
 *   - commId (v5 .. v7): NCCL's commHash, a hash of the ncclUniqueId bytes (ncclCommInitRank*)
 *     or of the parent's hash, split count and color (ncclCommSplit). It changes from run to run,
 *     so a rules file written before the job cannot name it; the plugin does not use it.
 * NCCL (up to 2.30) does not pass the tuner the communicator's name (ncclConfig_t.commName, which
 * torch sets from ProcessGroupNCCL.Options().config.comm_name); only the profiler plugin receives it.
 * Rules therefore match a communicator by (nRanks, nNodes) alone. Communicators with the same rank
 * and node counts cannot be told apart and get the same rules: e.g. tensor- and context-parallel
 * groups of 2 ranks on one node, or a data-parallel and a tensor-parallel group of 8 ranks on one
 * node. Where a plan gives such groups different settings for overlapping sizes, `lagom tune
 * --emit` keeps the setting of the group with more predicted communication time (the file says so
 * in a comment).
 */
#ifndef LAGOM_NCCL_TUNER_H
#define LAGOM_NCCL_TUNER_H

#include <stddef.h>
#include <stdint.h>

/* ncclResult_t. The plugin only ever returns success: any other value would fail NCCL's call
 * (communicator creation for init, the collective for getCollInfo) instead of falling back. */
typedef enum { LAGOM_NCCL_SUCCESS = 0 } lagom_nccl_result;

/* ncclFunc_t: the collectives NCCL asks the tuner about (values up to AllReduce are stable since v2). */
typedef enum {
  LAGOM_NCCL_BROADCAST = 0,
  LAGOM_NCCL_REDUCE = 1,
  LAGOM_NCCL_ALL_GATHER = 2,
  LAGOM_NCCL_REDUCE_SCATTER = 3,
  LAGOM_NCCL_ALL_REDUCE = 4,
  LAGOM_NCCL_TUNED_FUNCTIONS = 5 /* collectives a tuner is consulted for */
} lagom_nccl_func;

/* Rows of the cost table (NCCL_ALGO_*), 7 of them in NCCL 2.24 .. 2.30. */
enum {
  LAGOM_NCCL_ALGO_TREE = 0,
  LAGOM_NCCL_ALGO_RING = 1,
  LAGOM_NCCL_ALGO_COLLNET_DIRECT = 2,
  LAGOM_NCCL_ALGO_COLLNET_CHAIN = 3,
  LAGOM_NCCL_ALGO_NVLS = 4,
  LAGOM_NCCL_ALGO_NVLS_TREE = 5,
  LAGOM_NCCL_ALGO_PAT = 6,
  LAGOM_NCCL_ALGORITHMS = 7
};

/* Columns of the cost table (NCCL_PROTO_*), 3 of them. */
enum { LAGOM_NCCL_PROTO_LL = 0, LAGOM_NCCL_PROTO_LL128 = 1, LAGOM_NCCL_PROTO_SIMPLE = 2, LAGOM_NCCL_PROTOCOLS = 3 };

/* NCCL_ALGO_PROTO_IGNORE: the cost NCCL gives a combination it will not run. NCCL only picks entries
 * that are >= 0, so the plugin treats any negative cost as "not available". */
#define LAGOM_NCCL_COST_IGNORED (-1.0f)

/* ncclDebugLogLevel and the ncclDebugLogSubSys bits the plugin logs under. */
enum { LAGOM_NCCL_LOG_WARN = 2, LAGOM_NCCL_LOG_INFO = 3 };
enum { LAGOM_NCCL_SUBSYS_INIT = 0x1, LAGOM_NCCL_SUBSYS_TUNING = 0x40 };

/* ncclDebugLogger_t: NCCL's printf-like logger (level, subsystem bits, file, line, format, ...). */
typedef void (*lagom_nccl_logger)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

/* The v5 .. v7 init also passes NVLink domain information and NCCL's tuning constants (which a tuner
 * may edit; v7's table has rows for more compute capabilities). Lagom reads neither, so they stay opaque. */
struct lagom_nccl_nvl_domain_info;
struct lagom_nccl_tuner_constants;

/* getCollInfo, the same in v4 .. v7. collCostTable is NCCL's float[numAlgo][numProto] passed
 * as float**; the plugin may lower costs (NCCL then picks the cheapest entry >= 0) and set
 * *nChannels (0 leaves NCCL's channel count). */
typedef lagom_nccl_result (*lagom_nccl_get_coll_info)(void* context, lagom_nccl_func collType, size_t nBytes,
                                                      int numPipeOps, float** collCostTable, int numAlgo,
                                                      int numProto, int regBuff, int* nChannels);

typedef struct {
  const char* name;
  lagom_nccl_result (*init)(void** context, uint64_t commId, size_t nRanks, size_t nNodes, lagom_nccl_logger logFunction,
                            struct lagom_nccl_nvl_domain_info* nvlDomainInfo,
                            struct lagom_nccl_tuner_constants* constants);
  lagom_nccl_get_coll_info getCollInfo;
  lagom_nccl_result (*finalize)(void* context);
  /* Optional (may be NULL). Called when NCCL splits a collective into chunks, after getCollInfo, with
   * NCCL's chunk size in *chunkSize. nBytes here is the share of one channel (or of the whole
   * collective for CollNet), not the size getCollInfo saw. */
  lagom_nccl_result (*getChunkSize)(void* context, lagom_nccl_func collType, size_t nBytes, int algo, int proto,
                                    int nChannels, size_t* chunkSize);
} lagom_nccl_tuner_v6;

/* v7: v6's members, in v6's order and with v6's types (its constants pointer names a larger table). */
typedef lagom_nccl_tuner_v6 lagom_nccl_tuner_v7;

typedef struct {
  const char* name;
  lagom_nccl_result (*init)(void** context, uint64_t commId, size_t nRanks, size_t nNodes, lagom_nccl_logger logFunction,
                            struct lagom_nccl_nvl_domain_info* nvlDomainInfo,
                            struct lagom_nccl_tuner_constants* constants);
  lagom_nccl_get_coll_info getCollInfo;
  lagom_nccl_result (*finalize)(void* context);
} lagom_nccl_tuner_v5;

typedef struct {
  const char* name;
  lagom_nccl_result (*init)(size_t nRanks, size_t nNodes, lagom_nccl_logger logFunction, void** context);
  lagom_nccl_get_coll_info getCollInfo;
  lagom_nccl_result (*destroy)(void* context);
} lagom_nccl_tuner_v4;

/* The environment variable naming the rules file (written by `lagom tune --emit` and by
 * lagom.runtime.init), and the one naming the job's world size (set by torchrun and DeepSpeed). */
#define LAGOM_NCCL_TUNER_FILE_ENV "LAGOM_NCCL_TUNER_FILE"
#define LAGOM_WORLD_SIZE_ENV "WORLD_SIZE"

#endif
