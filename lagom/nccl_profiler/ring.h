/*
 * The per-process ring of collective records: many writers (NCCL's launching threads and its proxy
 * thread), one reader (Python's drain, once per step). Lock-free and allocation-free; a full ring
 * overwrites the oldest records, and the reader counts what it missed.
 */
#ifndef LAGOM_PROFILER_RING_H
#define LAGOM_PROFILER_RING_H

#include <stddef.h>
#include <stdint.h>

#include "lagom_nccl_profiler.h"

/* Records the ring holds; a power of two. */
#define LAGOM_RING_CAPACITY 8192u

/* Writes one record; never blocks. Returns 0, or -1 when the record was lost (an older write to the same
 * cell, N records back, was still under way: the caller counts it). */
int lagom_ring_push(const lagom_prof_record* record);

/* Copies up to ``max`` records, oldest first, into ``out`` and returns how many; *overwritten gets the
 * records the ring dropped since the last drain. A drain stops at a record still being written and takes
 * it next time (a lost record holds later ones back until its cell is written again, N records on: they
 * are then read, or counted as overwritten). One reader at a time (a second concurrent call returns 0). */
size_t lagom_ring_drain(lagom_prof_record* out, size_t max, uint64_t* overwritten);

/* Records written so far (tickets handed out). */
uint64_t lagom_ring_written(void);

#endif
