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
 * The live table. A running job may replace the rules between steps, in two phases, so that ranks never
 * disagree: it writes a rules file of its own (private to its user) and asks this process's instance to
 * stage it (lagom_tuner_live_stage; ctypes reaches the instance NCCL loaded: the same file dlopen'ed twice
 * is one library). Staging checks the file (owner, mode, format, world size) and reads it whole, or refuses
 * it and keeps nothing. Once every rank has staged, each publishes (lagom_tuner_live_publish): one atomic
 * store of the parsed table, which cannot fail; a rank whose peers could not stage discards instead
 * (lagom_tuner_live_discard). Staging "no file" stages the start rules: publishing it takes the live table
 * out of force. getCollInfo reads the table in force with one atomic load, so a call sees the old table or
 * the new one, whole, and never reads a file. While a live table is in force it replaces the start rules
 * for every communicator (an empty one leaves every call to NCCL). A reader counts itself in ``readers``
 * before it loads the table and out after its call; a publish frees the tables it replaced only when, after
 * publishing, it sees no reader, since a reader that arrives later can only load the new table.
 *
 * Counters. init and getCollInfo count their calls (and getCollInfo the calls a rule was applied to) in
 * process-wide relaxed atomics, read by lagom_tuner_counters: a job learns whether NCCL consults this
 * plugin at all (NCCL remembers a failed plugin load for the whole process) before it tries settings live.
 *
 * getCollInfo's nBytes is the whole buffer (an all-gather's output, a reduce-scatter's input), as
 * Lagom's plan counts it. Collectives of one NCCL group with the same function, operation and type
 * and sizes within 4x of each other are aggregated: NCCL asks once, for their total.
 */
#define _POSIX_C_SOURCE 200809L

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lagom_nccl_tuner.h"
#include "rules.h"

#define EXPORT __attribute__((visibility("default")))
#define PLUGIN_NAME "Lagom"

/*
 * NCCL prepares a group of collectives (getCollInfo for each) and then schedules them
 * (getChunkSize one to three times each), with nothing that ties a getChunkSize call to its
 * collective: its nBytes is a channel's share. So the context counts rounds: a getCollInfo after a
 * getChunkSize starts a new one. getChunkSize sets the chunk only when, in the current round, every
 * call of that collective was covered by an applied rule and all applied rules with NCCL's algorithm
 * and protocol agree on the chunk.
 */
typedef struct {
  size_t n_ranks, n_nodes;
  lagom_rule* rules; /* the start rules for this communicator's rank and node counts */
  size_t count;
  lagom_rule* applied; /* copies of the rules applied in the current round */
  size_t applied_count, applied_capacity;
  uint64_t round;
  int scheduling;
  uint64_t uncovered_round[LAGOM_NCCL_TUNED_FUNCTIONS]; /* last round with a call no applied rule covered */
} tuner_context;

typedef struct live_table {
  lagom_rule_set set;
  struct live_table* retired_next;
} live_table;

static _Atomic(live_table*) live_in_force = NULL;
static atomic_long readers = 0; /* calls between their load of live_in_force and their last use of it */
static pthread_mutex_t reloading = PTHREAD_MUTEX_INITIALIZER;
static live_table* retired = NULL; /* newest first; under ``reloading`` */
static live_table* staged = NULL;  /* the parsed table waiting to be published (NULL: the start rules); under ``reloading`` */
static int staged_pending = 0;     /* whether something is staged; under ``reloading`` */

static atomic_ullong init_calls = 0;      /* communicators NCCL initialised this plugin for */
static atomic_ullong coll_info_calls = 0; /* getCollInfo calls */
static atomic_ullong applied_calls = 0;   /* getCollInfo calls a rule was applied to */

static void say_at(lagom_nccl_logger logger, int level, const char* file, int line, const char* fmt, ...) {
  if (logger == NULL) return;
  char message[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof message, fmt, args);
  va_end(args);
  /* Formatted here and passed as one %s argument, so the logger never reads our variadic arguments. */
  logger(level, LAGOM_NCCL_SUBSYS_INIT | LAGOM_NCCL_SUBSYS_TUNING, file, line, "%s", message);
}
#define say(logger, level, ...) say_at(logger, level, __FILE__, __LINE__, __VA_ARGS__)

/* The job's world size from the launcher's environment, or 0 when it does not say. */
static uint64_t launcher_world_size(void) {
  const char* text = getenv(LAGOM_WORLD_SIZE_ENV);
  if (text == NULL || *text == '\0') return 0;
  char* end = NULL;
  unsigned long long value = strtoull(text, &end, 10);
  return (*end == '\0' && text[0] >= '0' && text[0] <= '9') ? (uint64_t)value : 0;
}

/* This communicator's start rules from the rules file, into ctx (none, and one logged line, when none apply). */
static void load_start_rules(tuner_context* ctx, lagom_nccl_logger logger) {
  const char* path = getenv(LAGOM_NCCL_TUNER_FILE_ENV);
  if (path == NULL || *path == '\0') {
    say(logger, LAGOM_NCCL_LOG_INFO, "Lagom tuner: %s is not set; NCCL tunes this communicator",
        LAGOM_NCCL_TUNER_FILE_ENV);
    return;
  }
  lagom_rule_set set;
  char reason[512];
  if (lagom_rules_read(path, &set, reason, sizeof reason) != 0) {
    say(logger, LAGOM_NCCL_LOG_WARN, "Lagom tuner: ignoring %s; NCCL tunes this communicator", reason);
    return;
  }
  uint64_t world = launcher_world_size();
  if ((world != 0 && world != set.world) || (uint64_t)ctx->n_ranks > set.world) {
    say(logger, LAGOM_NCCL_LOG_WARN,
        "Lagom tuner: ignoring %s: written for %llu ranks, this job has %llu; NCCL tunes this communicator", path,
        (unsigned long long)set.world, (unsigned long long)(world != 0 ? world : ctx->n_ranks));
    lagom_rules_free(&set);
    return;
  }
  size_t matching = 0;
  for (size_t i = 0; i < set.count; i++) {
    matching += set.rules[i].ranks == ctx->n_ranks && set.rules[i].nodes == ctx->n_nodes;
  }
  if (matching > 0) {
    ctx->rules = calloc(matching, sizeof *ctx->rules);
    if (ctx->rules == NULL) {
      lagom_rules_free(&set);
      say(logger, LAGOM_NCCL_LOG_WARN, "Lagom tuner: out of memory; NCCL tunes this communicator");
      return;
    }
    for (size_t i = 0; i < set.count; i++) {
      if (set.rules[i].ranks == ctx->n_ranks && set.rules[i].nodes == ctx->n_nodes) ctx->rules[ctx->count++] = set.rules[i];
    }
  }
  say(logger, LAGOM_NCCL_LOG_INFO, "Lagom tuner: %s: %zu of %zu rules are for this communicator (%zu ranks, %zu nodes)",
      path, matching, set.count, ctx->n_ranks, ctx->n_nodes);
  lagom_rules_free(&set);
}

/* Builds this communicator's context; NULL (and one logged line) without memory. */
static tuner_context* load(size_t n_ranks, size_t n_nodes, lagom_nccl_logger logger) {
  atomic_fetch_add_explicit(&init_calls, 1, memory_order_relaxed);
  tuner_context* ctx = calloc(1, sizeof *ctx);
  if (ctx == NULL) {
    say(logger, LAGOM_NCCL_LOG_WARN, "Lagom tuner: out of memory; NCCL tunes this communicator");
    return NULL;
  }
  ctx->n_ranks = n_ranks;
  ctx->n_nodes = n_nodes;
  ctx->round = 1;
  load_start_rules(ctx, logger);
  return ctx;
}

/* Keeps a copy of an applied rule for getChunkSize; 0 when it could not (the call then counts as uncovered). */
static int remember(tuner_context* ctx, const lagom_rule* rule) {
  if (ctx->applied_count == ctx->applied_capacity) {
    size_t grown = ctx->applied_capacity == 0 ? 8 : ctx->applied_capacity * 2;
    lagom_rule* applied = realloc(ctx->applied, grown * sizeof *applied);
    if (applied == NULL) return 0;
    ctx->applied = applied;
    ctx->applied_capacity = grown;
  }
  ctx->applied[ctx->applied_count++] = *rule;
  return 1;
}

static lagom_nccl_result get_coll_info(void* context, lagom_nccl_func coll_type, size_t n_bytes, int num_pipe_ops,
                                       float** cost_table, int num_algo, int num_proto, int reg_buff,
                                       int* n_channels) {
  (void)num_pipe_ops;
  (void)reg_buff;
  tuner_context* ctx = context;
  atomic_fetch_add_explicit(&coll_info_calls, 1, memory_order_relaxed);
  if (ctx == NULL || (int)coll_type < 0 || coll_type >= LAGOM_NCCL_TUNED_FUNCTIONS) return LAGOM_NCCL_SUCCESS;
  if (ctx->scheduling) {
    ctx->round++;
    ctx->scheduling = 0;
    ctx->applied_count = 0;
  }
  atomic_fetch_add(&readers, 1);
  const live_table* live = atomic_load(&live_in_force);
  const lagom_rule* match =
      live != NULL ? lagom_rules_pick(live->set.rules, live->set.count, coll_type, n_bytes, ctx->n_ranks, ctx->n_nodes)
                   : lagom_rules_pick(ctx->rules, ctx->count, coll_type, n_bytes, ctx->n_ranks, ctx->n_nodes);
  int applied = 0;
  if (match != NULL && cost_table != NULL && match->algorithm < num_algo && match->protocol < num_proto) {
    /* NCCL's table is float[num_algo][num_proto], passed as float**. */
    float* cost = (float*)cost_table + (size_t)match->algorithm * (size_t)num_proto + (size_t)match->protocol;
    if (*cost >= 0.0f && remember(ctx, match)) { /* negative: NCCL will not run it, so neither do we */
      *cost = 0.0f;
      if (n_channels != NULL) *n_channels = match->channels;
      applied = 1;
    }
  }
  atomic_fetch_sub_explicit(&readers, 1, memory_order_release);
  if (applied) {
    atomic_fetch_add_explicit(&applied_calls, 1, memory_order_relaxed);
  } else {
    ctx->uncovered_round[coll_type] = ctx->round;
  }
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
  for (size_t i = 0; i < ctx->applied_count; i++) {
    const lagom_rule* rule = &ctx->applied[i];
    if (rule->collective != (int)coll_type || rule->algorithm != algo || rule->protocol != proto ||
        n_bytes > rule->max_bytes) {
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
    free(ctx->applied);
    free(ctx);
  }
  return LAGOM_NCCL_SUCCESS;
}

static lagom_nccl_result init_with_comm_id(void** context, uint64_t comm_id, size_t n_ranks, size_t n_nodes,
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

/* Retires ``old``; frees every retired table when no reader is counted (after the new table is published, a
 * reader that arrives can only load the new one). Under ``reloading``. */
static void retire(live_table* old) {
  if (old != NULL) {
    old->retired_next = retired;
    retired = old;
  }
  if (atomic_load(&readers) != 0) return; /* someone may still hold a retired table: free it at a later reload */
  while (retired != NULL) {
    live_table* next = retired->retired_next;
    lagom_rules_free(&retired->set);
    free(retired);
    retired = next;
  }
}

static int refuse(char* reason, size_t reason_len, const char* fmt, ...) {
  if (reason != NULL && reason_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(reason, reason_len, fmt, args);
    va_end(args);
  }
  return -1;
}

/* Reads and checks the live table at ``path`` into *out; 0, or -1 with one line in ``reason``. Under ``reloading``. */
static int read_live(const char* path, int world_size, live_table** out, char* reason, size_t reason_len) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return refuse(reason, reason_len, "%s: cannot open it as a regular file of this user", path);
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return refuse(reason, reason_len, "%s: not a regular file", path);
  }
  if (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    close(fd);
    return refuse(reason, reason_len, "%s: owned by another user or writable by group or others (mode %o): only "
                  "the job's own user may change its NCCL settings", path, (unsigned)(st.st_mode & 07777));
  }
  FILE* file = fdopen(fd, "r");
  if (file == NULL) {
    close(fd);
    return refuse(reason, reason_len, "%s: cannot read it", path);
  }
  live_table* table = calloc(1, sizeof *table);
  if (table == NULL) {
    fclose(file);
    return refuse(reason, reason_len, "%s: out of memory", path);
  }
  int status = lagom_rules_read_file(file, path, &table->set, reason, reason_len);
  fclose(file);
  if (status == 0 && world_size > 0 && table->set.world != (uint64_t)world_size) {
    status = refuse(reason, reason_len, "%s: written for %llu ranks, this job has %d", path,
                    (unsigned long long)table->set.world, world_size);
  }
  if (status != 0) {
    lagom_rules_free(&table->set);
    free(table);
    return -1;
  }
  *out = table;
  return 0;
}

/* Drops what is staged. Under ``reloading``. */
static void discard_locked(void) {
  if (staged != NULL) {
    lagom_rules_free(&staged->set);
    free(staged);
    staged = NULL;
  }
  staged_pending = 0;
}

/* Stages ``path`` (NULL: the start rules), replacing anything staged before. Under ``reloading``. */
static int stage_locked(const char* path, int world_size, char* reason, size_t reason_len) {
  live_table* table = NULL;
  if (path != NULL && read_live(path, world_size, &table, reason, reason_len) != 0) return -1;
  discard_locked();
  staged = table;
  staged_pending = 1;
  return 0;
}

/* Puts what is staged in force; 1, or 0 when nothing is staged. Cannot fail. Under ``reloading``. */
static int publish_locked(void) {
  if (!staged_pending) return 0;
  retire(atomic_exchange(&live_in_force, staged));
  staged = NULL;
  staged_pending = 0;
  return 1;
}

/* Stages the live table at ``path`` for this process (NULL: the start rules, which cannot be refused); 0 on
 * success. Any problem stages nothing (what was staged before is dropped too), leaves the table in force
 * and writes one line into ``reason``. */
EXPORT int lagom_tuner_live_stage(const char* path, int world_size, char* reason, size_t reason_len) {
  pthread_mutex_lock(&reloading);
  int status = stage_locked(path, world_size, reason, reason_len);
  if (status != 0) discard_locked();
  pthread_mutex_unlock(&reloading);
  return status;
}

/* Puts the staged table in force for every communicator of this process: one pointer swap of a table
 * already parsed. Returns 1, or 0 when nothing was staged (the table in force stays). */
EXPORT int lagom_tuner_live_publish(void) {
  pthread_mutex_lock(&reloading);
  int published = publish_locked();
  pthread_mutex_unlock(&reloading);
  return published;
}

/* Drops the staged table; the table in force stays. */
EXPORT void lagom_tuner_live_discard(void) {
  pthread_mutex_lock(&reloading);
  discard_locked();
  pthread_mutex_unlock(&reloading);
}

/* Stages and publishes at once, for a process alone (lagom calibrate's single-rank sweep and the tests); a
 * job of several ranks stages on every rank first. 0 on success; a refusal keeps the table in force. */
EXPORT int lagom_tuner_live_reload(const char* path, int world_size, char* reason, size_t reason_len) {
  if (path == NULL) return refuse(reason, reason_len, "no path");
  pthread_mutex_lock(&reloading);
  int status = stage_locked(path, world_size, reason, reason_len);
  if (status == 0) publish_locked();
  pthread_mutex_unlock(&reloading);
  return status;
}

/* How often NCCL called this plugin in this process: communicator inits, getCollInfo calls, and getCollInfo
 * calls a rule was applied to. Any pointer may be NULL. */
EXPORT void lagom_tuner_counters(uint64_t* inits, uint64_t* coll_infos, uint64_t* applied) {
  if (inits != NULL) *inits = atomic_load_explicit(&init_calls, memory_order_relaxed);
  if (coll_infos != NULL) *coll_infos = atomic_load_explicit(&coll_info_calls, memory_order_relaxed);
  if (applied != NULL) *applied = atomic_load_explicit(&applied_calls, memory_order_relaxed);
}

/* The live table's rule for a call, picked as getCollInfo picks it: 1 and its fields, or 0 (no live table in
 * force, or no rule: NCCL decides). */
EXPORT int lagom_tuner_lookup(int collective, uint64_t n_bytes, uint64_t n_ranks, uint64_t n_nodes, int* algorithm,
                              int* protocol, int* channels, uint64_t* chunk_bytes) {
  atomic_fetch_add(&readers, 1);
  const live_table* live = atomic_load(&live_in_force);
  const lagom_rule* rule =
      live == NULL ? NULL : lagom_rules_pick(live->set.rules, live->set.count, collective, n_bytes, n_ranks, n_nodes);
  if (rule != NULL) {
    *algorithm = rule->algorithm;
    *protocol = rule->protocol;
    *channels = rule->channels;
    *chunk_bytes = rule->chunk_bytes;
  }
  atomic_fetch_sub_explicit(&readers, 1, memory_order_release);
  return rule != NULL;
}

EXPORT lagom_nccl_tuner_v7 ncclTunerPlugin_v7 = {PLUGIN_NAME, init_with_comm_id, get_coll_info, finalize,
                                                 get_chunk_size};
EXPORT lagom_nccl_tuner_v6 ncclTunerPlugin_v6 = {PLUGIN_NAME, init_with_comm_id, get_coll_info, finalize,
                                                 get_chunk_size};
EXPORT lagom_nccl_tuner_v5 ncclTunerPlugin_v5 = {PLUGIN_NAME, init_with_comm_id, get_coll_info, finalize};
EXPORT lagom_nccl_tuner_v4 ncclTunerPlugin_v4 = {PLUGIN_NAME, init_v4, get_coll_info, finalize};
