/* Reading the rules file (format in rules.h). A file is taken whole or not at all. */
#define _POSIX_C_SOURCE 200809L

#include "rules.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "lagom_nccl_tuner.h"

#define MAX_LINE 1024
#define MAX_TOKENS 10 /* one more than a rule has, to notice extra fields */
#define MAX_RULES 1000000
#define NVLS_CHUNK_ENV "NCCL_NVLS_CHUNKSIZE"
#define NVLS_CHUNK_DEFAULT (128 * 1024) /* NCCL's default NCCL_NVLS_CHUNKSIZE */

typedef struct {
  const char* name;
  int value;
} named_value;

static const named_value COLLECTIVES[] = {
    {"broadcast", LAGOM_NCCL_BROADCAST},          {"reduce", LAGOM_NCCL_REDUCE},
    {"allgather", LAGOM_NCCL_ALL_GATHER},         {"reducescatter", LAGOM_NCCL_REDUCE_SCATTER},
    {"allreduce", LAGOM_NCCL_ALL_REDUCE},         {NULL, 0}};

static const named_value ALGORITHMS[] = {
    {"tree", LAGOM_NCCL_ALGO_TREE}, {"ring", LAGOM_NCCL_ALGO_RING}, {"collnet_direct", LAGOM_NCCL_ALGO_COLLNET_DIRECT},
    {"collnet_chain", LAGOM_NCCL_ALGO_COLLNET_CHAIN}, {"nvls", LAGOM_NCCL_ALGO_NVLS},
    {"nvls_tree", LAGOM_NCCL_ALGO_NVLS_TREE}, {"pat", LAGOM_NCCL_ALGO_PAT}, {NULL, 0}};

static const named_value PROTOCOLS[] = {
    {"ll", LAGOM_NCCL_PROTO_LL}, {"ll128", LAGOM_NCCL_PROTO_LL128}, {"simple", LAGOM_NCCL_PROTO_SIMPLE}, {NULL, 0}};

/* Parsing state: where we are, for the one-line reason. */
typedef struct {
  const char* path;
  int line;
  char* reason;
  size_t reason_len;
} reader;

static int fail(reader* rd, const char* fmt, ...) {
  char what[256];
  va_list args;
  va_start(args, fmt);
  vsnprintf(what, sizeof what, fmt, args);
  va_end(args);
  if (rd->line > 0) {
    snprintf(rd->reason, rd->reason_len, "%s line %d: %s", rd->path, rd->line, what);
  } else {
    snprintf(rd->reason, rd->reason_len, "%s: %s", rd->path, what);
  }
  return -1;
}

static int lookup(const named_value* table, const char* name, int* value) {
  for (; table->name != NULL; table++) {
    if (strcasecmp(table->name, name) == 0) {
      *value = table->value;
      return 0;
    }
  }
  return -1;
}

/* A decimal count: digits only (strtoull alone would take "-1" and wrap it), no overflow. */
static int parse_count(const char* text, uint64_t* value) {
  if (text[0] < '0' || text[0] > '9') return -1;
  char* end = NULL;
  errno = 0;
  unsigned long long parsed = strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0') return -1;
  *value = (uint64_t)parsed;
  return 0;
}

/* Splits a line (comment already cut) on blanks; returns the token count, MAX_TOKENS meaning "too many". */
static int split(char* line, char** tokens) {
  int count = 0;
  char* save = NULL;
  for (char* tok = strtok_r(line, " \t\r\n", &save); tok != NULL; tok = strtok_r(NULL, " \t\r\n", &save)) {
    if (count == MAX_TOKENS) return MAX_TOKENS;
    tokens[count++] = tok;
  }
  return count;
}

uint64_t lagom_rules_nvls_chunk(void) {
  const char* text = getenv(NVLS_CHUNK_ENV);
  uint64_t chunk = 0;
  if (text == NULL || parse_count(text, &chunk) != 0 || chunk == 0) return NVLS_CHUNK_DEFAULT;
  return chunk;
}

static int parse_rule(reader* rd, char** tok, int ntok, lagom_rule* rule) {
  if (ntok != 9) {
    return fail(rd, "a rule has 9 fields (collective min_bytes max_bytes ranks nodes algorithm protocol channels "
                    "chunk_bytes), this line has %s%d",
                ntok == MAX_TOKENS ? "more than " : "", ntok == MAX_TOKENS ? MAX_TOKENS - 1 : ntok);
  }
  if (lookup(COLLECTIVES, tok[0], &rule->collective) != 0) return fail(rd, "unknown collective '%s'", tok[0]);
  if (parse_count(tok[1], &rule->min_bytes) != 0) return fail(rd, "min_bytes '%s' is not a count", tok[1]);
  if (parse_count(tok[2], &rule->max_bytes) != 0) return fail(rd, "max_bytes '%s' is not a count", tok[2]);
  if (rule->min_bytes > rule->max_bytes) return fail(rd, "min_bytes %s exceeds max_bytes %s", tok[1], tok[2]);
  if (parse_count(tok[3], &rule->ranks) != 0 || rule->ranks == 0) return fail(rd, "ranks '%s' is not positive", tok[3]);
  if (parse_count(tok[4], &rule->nodes) != 0 || rule->nodes == 0) return fail(rd, "nodes '%s' is not positive", tok[4]);
  if (rule->nodes > rule->ranks) return fail(rd, "%s nodes for %s ranks", tok[4], tok[3]);
  if (lookup(ALGORITHMS, tok[5], &rule->algorithm) != 0) return fail(rd, "unknown algorithm '%s'", tok[5]);
  if (lookup(PROTOCOLS, tok[6], &rule->protocol) != 0) return fail(rd, "unknown protocol '%s'", tok[6]);
  uint64_t channels = 0;
  if (parse_count(tok[7], &channels) != 0 || channels == 0 || channels > INT_MAX) {
    return fail(rd, "channels '%s' is not a positive int", tok[7]);
  }
  if (channels > LAGOM_MAX_CHANNELS) {
    return fail(rd, "channels %s exceeds NCCL's %d channels per communicator", tok[7], LAGOM_MAX_CHANNELS);
  }
  rule->channels = (int)channels;
  if (parse_count(tok[8], &rule->chunk_bytes) != 0 || rule->chunk_bytes == 0) {
    return fail(rd, "chunk_bytes '%s' is not positive", tok[8]);
  }
  /* NCCL rounds a chunk down to the protocol's grain and divides by it: below the grain it would divide by 0 */
  static const uint64_t GRAIN[LAGOM_NCCL_PROTOCOLS] = {16, 1920, 512}; /* LL, LL128, Simple */
  if (rule->chunk_bytes < GRAIN[rule->protocol]) {
    return fail(rd, "chunk_bytes %s is below %s's grain of %llu bytes", tok[8], tok[6],
                (unsigned long long)GRAIN[rule->protocol]);
  }
  /* NCCL takes an NVLS chunk up to NCCL_BUFFSIZE / 8 but sizes the NVLS buffer slots by NCCL_NVLS_CHUNKSIZE:
   * ask for no more than a slot until a GPU shows a larger chunk is safe */
  if (rule->algorithm == LAGOM_NCCL_ALGO_NVLS || rule->algorithm == LAGOM_NCCL_ALGO_NVLS_TREE) {
    uint64_t slot = lagom_rules_nvls_chunk();
    if (rule->chunk_bytes > slot) rule->chunk_bytes = slot;
  }
  return 0;
}

static int append(reader* rd, lagom_rule_set* set, size_t* capacity, const lagom_rule* rule) {
  if (set->count == *capacity) {
    if (*capacity >= MAX_RULES) return fail(rd, "more than %d rules", MAX_RULES);
    size_t grown = *capacity == 0 ? 16 : *capacity * 2;
    lagom_rule* rules = realloc(set->rules, grown * sizeof *rules);
    if (rules == NULL) return fail(rd, "out of memory");
    set->rules = rules;
    *capacity = grown;
  }
  set->rules[set->count++] = *rule;
  return 0;
}

/* Reads the lines of an open file into set; -1 (reason written) on the first bad one. */
static int read_lines(reader* rd, FILE* file, lagom_rule_set* set) {
  char line[MAX_LINE];
  char* tok[MAX_TOKENS];
  size_t capacity = 0;
  int seen_version = 0;
  while (fgets(line, sizeof line, file) != NULL) {
    rd->line++;
    size_t len = strlen(line);
    if (len == sizeof line - 1 && line[len - 1] != '\n') { /* full buffer: the line goes on, or the file ends here */
      int next = fgetc(file);
      if (next != EOF) return fail(rd, "longer than %d characters", MAX_LINE - 1);
    }
    char* comment = strchr(line, '#');
    if (comment != NULL) *comment = '\0';
    int ntok = split(line, tok);
    if (ntok == 0) continue;
    if (!seen_version) {
      uint64_t version = 0;
      if (ntok != 2 || strcmp(tok[0], "lagom-nccl-tuner") != 0 || parse_count(tok[1], &version) != 0) {
        return fail(rd, "the first line must be 'lagom-nccl-tuner %d' (is this a Lagom rules file?)",
                    LAGOM_RULES_VERSION);
      }
      if (version != LAGOM_RULES_VERSION) {
        return fail(rd, "format version %s; this plugin reads version %d (rebuild Lagom or re-emit the file)", tok[1],
                    LAGOM_RULES_VERSION);
      }
      seen_version = 1;
      continue;
    }
    if (strcmp(tok[0], "world") == 0) {
      if (set->world != 0) return fail(rd, "a second 'world' line");
      if (ntok != 2 || parse_count(tok[1], &set->world) != 0 || set->world == 0) {
        return fail(rd, "'world' takes one positive rank count");
      }
      continue;
    }
    if (set->world == 0) return fail(rd, "a rule before the 'world' line");
    lagom_rule rule;
    if (parse_rule(rd, tok, ntok, &rule) != 0) return -1;
    if (rule.ranks > set->world) return fail(rd, "a rule for %s ranks in a world of %llu", tok[3],
                                             (unsigned long long)set->world);
    if (append(rd, set, &capacity, &rule) != 0) return -1;
  }
  if (ferror(file)) return fail(rd, "read error");
  rd->line = 0;
  if (!seen_version) return fail(rd, "empty file");
  if (set->world == 0) return fail(rd, "no 'world' line");
  return 0;
}

int lagom_rules_read_file(FILE* file, const char* name, lagom_rule_set* out, char* reason, size_t reason_len) {
  reader rd = {name, 0, reason, reason_len};
  lagom_rule_set set = {0, NULL, 0};
  int status = read_lines(&rd, file, &set);
  if (status != 0) lagom_rules_free(&set);
  *out = set;
  return status;
}

int lagom_rules_read(const char* path, lagom_rule_set* out, char* reason, size_t reason_len) {
  FILE* file = fopen(path, "r");
  if (file == NULL) {
    reader rd = {path, 0, reason, reason_len};
    char why[128] = "unknown error";
    strerror_r(errno, why, sizeof why); /* XSI form: communicators may be created from several threads */
    out->world = 0;
    out->rules = NULL;
    out->count = 0;
    return fail(&rd, "cannot open (%s)", why);
  }
  int status = lagom_rules_read_file(file, path, out, reason, reason_len);
  fclose(file);
  return status;
}

const lagom_rule* lagom_rules_pick(const lagom_rule* rules, size_t count, int collective, uint64_t n_bytes,
                                   uint64_t n_ranks, uint64_t n_nodes) {
  for (size_t i = 0; i < count; i++) {
    const lagom_rule* rule = &rules[i];
    if (rule->collective == collective && rule->ranks == n_ranks && rule->nodes == n_nodes &&
        rule->min_bytes <= n_bytes && n_bytes <= rule->max_bytes) {
      return rule;
    }
  }
  return NULL;
}

void lagom_rules_free(lagom_rule_set* set) {
  free(set->rules);
  set->rules = NULL;
  set->count = 0;
  set->world = 0;
}
