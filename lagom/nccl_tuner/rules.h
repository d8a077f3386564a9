/*
 * The rules file `lagom tune --emit` and lagom.runtime.init write (nccl_tuner.lagom): plain text,
 * one rule per line, `#` starts a comment.
 *
 *   lagom-nccl-tuner 1
 *   world 16
 *   # collective min_bytes max_bytes ranks nodes algorithm protocol channels chunk_bytes
 *   allreduce 996147 1101005 8 1 ring simple 8 2097152  # dp/all_reduce/1048576
 *
 * A rule applies to a communicator of `ranks` ranks on `nodes` nodes, to calls of `collective`
 * (broadcast, reduce, allgather, reducescatter, allreduce) of min_bytes..max_bytes bytes (both
 * included, counted as NCCL counts them: the whole buffer). algorithm is one of tree, ring,
 * collnet_direct, collnet_chain, nvls, nvls_tree, pat; protocol one of ll, ll128, simple (any case).
 * `world` is the job's rank count the plan was made for. The first rule that covers a call wins;
 * the files Lagom writes never overlap. An nvls or nvls_tree rule's chunk is read as at most
 * NCCL_NVLS_CHUNKSIZE (128 KiB when unset, or not a positive count): NCCL sizes NVLS buffer slots by
 * it yet would take a tuner chunk up to NCCL_BUFFSIZE / 8.
 */
#ifndef LAGOM_NCCL_TUNER_RULES_H
#define LAGOM_NCCL_TUNER_RULES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define LAGOM_RULES_VERSION 1
#define LAGOM_MAX_CHANNELS 64 /* NCCL's MAXCHANNELS: no communicator has more, on any algorithm */

typedef struct {
  int collective; /* lagom_nccl_func */
  uint64_t min_bytes, max_bytes;
  uint64_t ranks, nodes;
  int algorithm, protocol; /* cost-table row and column */
  int channels;
  uint64_t chunk_bytes;
} lagom_rule;

typedef struct {
  uint64_t world;
  lagom_rule* rules;
  size_t count;
} lagom_rule_set;

/* Reads a rules file. On success fills *out (free it with lagom_rules_free) and returns 0. On any
 * problem returns -1, leaves *out empty and writes one line saying where and what into reason. */
int lagom_rules_read(const char* path, lagom_rule_set* out, char* reason, size_t reason_len);

/* The same from a file already open (``name`` is what the reason calls it). */
int lagom_rules_read_file(FILE* file, const char* name, lagom_rule_set* out, char* reason, size_t reason_len);

/* The rule for a call: the first of ``rules`` for this collective, rank and node count whose sizes cover
 * n_bytes, or NULL. getCollInfo and lagom_tuner_lookup both pick with it. */
const lagom_rule* lagom_rules_pick(const lagom_rule* rules, size_t count, int collective, uint64_t n_bytes,
                                   uint64_t n_ranks, uint64_t n_nodes);

/* The largest NVLS chunk a rule may ask for: NCCL_NVLS_CHUNKSIZE, else NCCL's default of 128 KiB. */
uint64_t lagom_rules_nvls_chunk(void);

void lagom_rules_free(lagom_rule_set* set);

#endif
