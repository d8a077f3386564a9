/*
 * The ring (see ring.h). Each cell has a sequence word: 2t+1 while ticket t's record is being written, 2t+2
 * once it is complete. A writer takes the next ticket with one fetch_add and claims its cell with one CAS,
 * from a complete state only: a cell still being written (odd) by a writer N tickets back is left to it, and
 * the new record is lost instead, so two writers never share a cell. The payload is copied word by word with
 * relaxed atomics; the reader checks the sequence word before and after its copy (a seqlock), so a record
 * overwritten while it was read is counted as dropped, never returned torn.
 */
#include "ring.h"

#include <stdatomic.h>
#include <string.h>

typedef struct {
  _Atomic uint64_t sequence;
  _Atomic uint64_t words[LAGOM_PROF_RECORD_WORDS];
} cell;

static cell cells[LAGOM_RING_CAPACITY];
static _Atomic uint64_t head = 0; /* the next ticket */
static uint64_t tail = 0;         /* the next ticket to read; the reader's alone */
static atomic_flag reading = ATOMIC_FLAG_INIT;

_Static_assert(sizeof(lagom_prof_record) % sizeof(uint64_t) == 0, "the record is copied in whole words");
_Static_assert((LAGOM_RING_CAPACITY & (LAGOM_RING_CAPACITY - 1)) == 0, "the capacity is a power of two");

int lagom_ring_push(const lagom_prof_record* record) {
  uint64_t ticket = atomic_fetch_add_explicit(&head, 1, memory_order_relaxed);
  cell* c = &cells[ticket & (LAGOM_RING_CAPACITY - 1)];
  uint64_t writing = 2 * ticket + 1;
  uint64_t seen = atomic_load_explicit(&c->sequence, memory_order_relaxed);
  do {
    if ((seen & 1) != 0 || seen >= writing) return -1; /* an older writer is still here, or a newer one took it */
  } while (!atomic_compare_exchange_weak_explicit(&c->sequence, &seen, writing, memory_order_acquire,
                                                  memory_order_relaxed));
  uint64_t words[LAGOM_PROF_RECORD_WORDS];
  memcpy(words, record, sizeof words);
  for (size_t i = 0; i < LAGOM_PROF_RECORD_WORDS; i++) {
    atomic_store_explicit(&c->words[i], words[i], memory_order_relaxed);
  }
  atomic_store_explicit(&c->sequence, writing + 1, memory_order_release);
  return 0;
}

size_t lagom_ring_drain(lagom_prof_record* out, size_t max, uint64_t* overwritten) {
  uint64_t missed = 0;
  size_t n = 0;
  if (atomic_flag_test_and_set_explicit(&reading, memory_order_acquire)) {
    if (overwritten != NULL) *overwritten = 0;
    return 0;
  }
  uint64_t end = atomic_load_explicit(&head, memory_order_acquire);
  if (end - tail > LAGOM_RING_CAPACITY) { /* the oldest were overwritten before this drain */
    missed += end - LAGOM_RING_CAPACITY - tail;
    tail = end - LAGOM_RING_CAPACITY;
  }
  while (tail < end && n < max) {
    cell* c = &cells[tail & (LAGOM_RING_CAPACITY - 1)];
    uint64_t complete = 2 * tail + 2;
    uint64_t before = atomic_load_explicit(&c->sequence, memory_order_acquire);
    if (before < complete) break; /* still being written (or lost, until a newer ticket claims the cell) */
    if (before > complete) {      /* overwritten by a newer record */
      missed++;
      tail++;
      continue;
    }
    uint64_t words[LAGOM_PROF_RECORD_WORDS];
    for (size_t i = 0; i < LAGOM_PROF_RECORD_WORDS; i++) {
      words[i] = atomic_load_explicit(&c->words[i], memory_order_relaxed);
    }
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&c->sequence, memory_order_relaxed) == before) {
      memcpy(&out[n++], words, sizeof words);
    } else {
      missed++;
    }
    tail++;
  }
  atomic_flag_clear_explicit(&reading, memory_order_release);
  if (overwritten != NULL) *overwritten = missed;
  return n;
}

uint64_t lagom_ring_written(void) { return atomic_load_explicit(&head, memory_order_relaxed); }
