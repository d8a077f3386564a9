/*
 * Lagom's NCCL tuner plugin: per-size algorithm, protocol, channels and chunk size from a Lagom plan.
 *
 * init reads the rules file named by LAGOM_NCCL_TUNER_FILE and keeps the rules for this
 * communicator's rank and node counts (see lagom_nccl_tuner.h for why nothing finer is possible).
 * getCollInfo makes the planned algorithm/protocol the cheapest entry of NCCL's cost table and sets
 * the channel count; getChunkSize sets the planned chunk. Calls no rule covers are left to NCCL. Any
 * problem (no file, a bad file, a file for another job, no memory) is one line in NCCL's log and
 * leaves the communicator to NCCL: every entry point returns success.
 *
 * getCollInfo's nBytes is the whole buffer (an all-gather's output, a reduce-scatter's input), as
 * Lagom's plan counts it. Collectives of one NCCL group with the same function, operation and type
 * and sizes within 4x of each other are aggregated: NCCL asks once, for their total.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "lagom_nccl_tuner.h"
#include "rules.h"

#define EXPORT __attribute__((visibility("default")))
#define PLUGIN_NAME "Lagom"

/* A rule of this communicator, and the last preparation round in which getCollInfo applied it. */
typedef struct {
  lagom_rule rule;
  uint64_t applied_round;
} comm_rule;

/*
 * NCCL prepares a group of collectives (getCollInfo for each) and then schedules them
 * (getChunkSize one to three times each), with nothing that ties a getChunkSize call to its
 * collective: its nBytes is a channel's share. So the context counts rounds: a getCollInfo after a
 * getChunkSize starts a new one. getChunkSize sets the chunk only when, in the current round, every
 * call of that collective was covered by an applied rule and all applied rules with NCCL's algorithm
 * and protocol agree on the chunk.
 */
typedef struct {
  comm_rule* rules;
  size_t count;
  uint64_t round;
  int scheduling;
  uint64_t uncovered_round[LAGOM_NCCL_TUNED_FUNCTIONS]; /* last round with a call no applied rule covered */
} tuner_context;

static void say(lagom_nccl_logger logger, int level, const char* fmt, ...) {
  if (logger == NULL) return;
  char message[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof message, fmt, args);
  va_end(args);
  /* Formatted here and passed as one %s argument, so the logger never reads our variadic arguments. */
  logger(level, LAGOM_NCCL_SUBSYS_INIT | LAGOM_NCCL_SUBSYS_TUNING, __FILE__, __LINE__, "%s", message);
}

/* The job's world size from the launcher's environment, or 0 when it does not say. */
static uint64_t launcher_world_size(void) {
  const char* text = getenv(LAGOM_WORLD_SIZE_ENV);
  if (text == NULL || *text == '\0') return 0;
  char* end = NULL;
  unsigned long long value = strtoull(text, &end, 10);
  return (*end == '\0' && text[0] >= '0' && text[0] <= '9') ? (uint64_t)value : 0;
}

/* Builds this communicator's context; NULL (and one logged line) when nothing applies. */
static tuner_context* load(size_t n_ranks, size_t n_nodes, lagom_nccl_logger logger) {
  const char* path = getenv(LAGOM_NCCL_TUNER_FILE_ENV);
  if (path == NULL || *path == '\0') {
    say(logger, LAGOM_NCCL_LOG_INFO, "Lagom tuner: %s is not set; NCCL tunes this communicator",
        LAGOM_NCCL_TUNER_FILE_ENV);
    return NULL;
  }
  lagom_rule_set set;
  char reason[512];
  if (lagom_rules_read(path, &set, reason, sizeof reason) != 0) {
    say(logger, LAGOM_NCCL_LOG_WARN, "Lagom tuner: ignoring %s; NCCL tunes this communicator", reason);
    return NULL;
  }
  uint64_t world = launcher_world_size();
  if ((world != 0 && world != set.world) || (uint64_t)n_ranks > set.world) {
    say(logger, LAGOM_NCCL_LOG_WARN,
        "Lagom tuner: ignoring %s: written for %llu ranks, this job has %llu; NCCL tunes this communicator", path,
        (unsigned long long)set.world, (unsigned long long)(world != 0 ? world : n_ranks));
    lagom_rules_free(&set);
    return NULL;
  }
  size_t matching = 0;
  for (size_t i = 0; i < set.count; i++) {
    matching += set.rules[i].ranks == n_ranks && set.rules[i].nodes == n_nodes;
  }
  tuner_context* ctx = NULL;
  if (matching > 0) {
    ctx = calloc(1, sizeof *ctx);
    comm_rule* rules = calloc(matching, sizeof *rules);
    if (ctx == NULL || rules == NULL) {
      free(ctx);
      free(rules);
      lagom_rules_free(&set);
      say(logger, LAGOM_NCCL_LOG_WARN, "Lagom tuner: out of memory; NCCL tunes this communicator");
      return NULL;
    }
    for (size_t i = 0; i < set.count; i++) {
      if (set.rules[i].ranks == n_ranks && set.rules[i].nodes == n_nodes) rules[ctx->count++].rule = set.rules[i];
    }
    ctx->rules = rules;
    ctx->round = 1;
  }
  say(logger, LAGOM_NCCL_LOG_INFO, "Lagom tuner: %s: %zu of %zu rules are for this communicator (%zu ranks, %zu nodes)",
      path, matching, set.count, n_ranks, n_nodes);
  lagom_rules_free(&set);
  return ctx;
}

static comm_rule* find(tuner_context* ctx, int collective, size_t n_bytes) {
  for (size_t i = 0; i < ctx->count; i++) {
    const lagom_rule* rule = &ctx->rules[i].rule;
    if (rule->collective == collective && rule->min_bytes <= n_bytes && n_bytes <= rule->max_bytes) {
      return &ctx->rules[i];
    }
  }
  return NULL;
}

static lagom_nccl_result get_coll_info(void* context, lagom_nccl_func coll_type, size_t n_bytes, int num_pipe_ops,
                                       float** cost_table, int num_algo, int num_proto, int reg_buff,
                                       int* n_channels) {
  (void)num_pipe_ops;
  (void)reg_buff;
  tuner_context* ctx = context;
  if (ctx == NULL || (int)coll_type < 0 || coll_type >= LAGOM_NCCL_TUNED_FUNCTIONS) return LAGOM_NCCL_SUCCESS;
  if (ctx->scheduling) {
    ctx->round++;
    ctx->scheduling = 0;
  }
  comm_rule* match = find(ctx, coll_type, n_bytes);
  if (match != NULL && cost_table != NULL && match->rule.algorithm < num_algo && match->rule.protocol < num_proto) {
    /* NCCL's table is float[num_algo][num_proto], passed as float**. */
    float* cost = (float*)cost_table + (size_t)match->rule.algorithm * (size_t)num_proto + (size_t)match->rule.protocol;
    if (*cost >= 0.0f) { /* negative: NCCL will not run it, so neither do we */
      *cost = 0.0f;
      if (n_channels != NULL) *n_channels = match->rule.channels;
      match->applied_round = ctx->round;
      return LAGOM_NCCL_SUCCESS;
    }
  }
  ctx->uncovered_round[coll_type] = ctx->round;
  return LAGOM_NCCL_SUCCESS;
}

static lagom_nccl_result get_chunk_size(void* context, lagom_nccl_func coll_type, size_t n_bytes, int algo, int proto,
                                        int n_channels, size_t* chunk_size) {
  (void)n_channels;
  tuner_context* ctx = context;
  if (ctx == NULL || chunk_size == NULL) return LAGOM_NCCL_SUCCESS;
  ctx->scheduling = 1;
  if ((int)coll_type < 0 || coll_type >= LAGOM_NCCL_TUNED_FUNCTIONS) return LAGOM_NCCL_SUCCESS;
  if (ctx->uncovered_round[coll_type] == ctx->round) return LAGOM_NCCL_SUCCESS;
  uint64_t chunk = 0;
  for (size_t i = 0; i < ctx->count; i++) {
    const lagom_rule* rule = &ctx->rules[i].rule;
    if (ctx->rules[i].applied_round != ctx->round || rule->collective != (int)coll_type || rule->algorithm != algo ||
        rule->protocol != proto || n_bytes > rule->max_bytes) {
      continue;
    }
    if (chunk != 0 && chunk != rule->chunk_bytes) return LAGOM_NCCL_SUCCESS; /* ambiguous: NCCL's chunk stays */
    chunk = rule->chunk_bytes;
  }
  if (chunk != 0) *chunk_size = (size_t)chunk;
  return LAGOM_NCCL_SUCCESS;
}

static lagom_nccl_result finalize(void* context) {
  tuner_context* ctx = context;
  if (ctx != NULL) {
    free(ctx->rules);
    free(ctx);
  }
  return LAGOM_NCCL_SUCCESS;
}

static lagom_nccl_result init_v5_v6(void** context, uint64_t comm_id, size_t n_ranks, size_t n_nodes,
                                    lagom_nccl_logger logger, struct lagom_nccl_nvl_domain_info* nvl_domain_info,
                                    struct lagom_nccl_tuner_constants* constants) {
  (void)comm_id; /* a per-run hash: see lagom_nccl_tuner.h */
  (void)nvl_domain_info;
  (void)constants;
  if (context != NULL) *context = load(n_ranks, n_nodes, logger);
  return LAGOM_NCCL_SUCCESS;
}

static lagom_nccl_result init_v4(size_t n_ranks, size_t n_nodes, lagom_nccl_logger logger, void** context) {
  if (context != NULL) *context = load(n_ranks, n_nodes, logger);
  return LAGOM_NCCL_SUCCESS;
}

EXPORT lagom_nccl_tuner_v6 ncclTunerPlugin_v6 = {PLUGIN_NAME, init_v5_v6, get_coll_info, finalize,
                                                 get_chunk_size};
EXPORT lagom_nccl_tuner_v5 ncclTunerPlugin_v5 = {PLUGIN_NAME, init_v5_v6, get_coll_info, finalize};
EXPORT lagom_nccl_tuner_v4 ncclTunerPlugin_v4 = {PLUGIN_NAME, init_v4, get_coll_info, finalize};
