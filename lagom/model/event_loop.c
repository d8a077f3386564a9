/* The simulator's event loop in C: one phase of a step. It pauses at the period boundaries of the pipeline's
 * steady band when asked, so that the reference's steady-state logic (Python) can compare states and jump
 * whole periods on; the jump and the probes it needs run here.
 *
 * lagom/model/simulator.py is the reference: this file runs the same loop over the same tasks in the same
 * order with the same floating-point operations, so the two agree to rounding (tests check 1e-9). Python
 * lowers the phase once per choice of decompositions into flat arrays (lagom/model/compiled.py); this
 * loop only reads them. Durations come from the cost model through one callback, memoised here: a step
 * repeats a few situations (a GEMM beside the same collectives) thousands of times, so the callback is
 * rare and the loop runs at C speed.
 *
 * Tasks are numbered queue by queue, in queue order, so a queue's head is a task number and "task x is
 * done" is "x lies before the head of its queue". A queue runs only its head, so the running state is
 * kept per queue.
 */
#include <math.h> /* isnan, NAN: macros, no libm */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "event_loop.h"

#define EXPORT __attribute__((visibility("default")))
#define EPS 1e-12
#define DONE 1e-9

/* -- a memo of durations keyed by a few doubles (open addressing; keys live in one growing arena) */

typedef struct {
    uint64_t *hashes;   /* 0: empty */
    int64_t *offsets;   /* into arena: key length, then the key */
    double *values;
    int64_t slots, used;
    double *arena;
    int64_t arena_len, arena_cap;
} memo_t;

static uint64_t hash_key(const double *key, int n) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < n; i++) {
        double x = key[i] == 0.0 ? 0.0 : key[i]; /* -0.0 and 0.0 are one key, as in a Python dict */
        uint64_t bits;
        memcpy(&bits, &x, sizeof bits);
        h ^= bits;
        h *= 1099511628211ULL;
        h ^= h >> 29;
    }
    return h ? h : 1;
}

static int memo_init(memo_t *m) {
    memset(m, 0, sizeof *m);
    m->slots = 1024;
    m->hashes = calloc((size_t)m->slots, sizeof *m->hashes);
    m->offsets = malloc((size_t)m->slots * sizeof *m->offsets);
    m->values = malloc((size_t)m->slots * sizeof *m->values);
    m->arena_cap = 4096;
    m->arena = malloc((size_t)m->arena_cap * sizeof *m->arena);
    return m->hashes && m->offsets && m->values && m->arena ? 0 : -1;
}

static void memo_free(memo_t *m) {
    free(m->hashes);
    free(m->offsets);
    free(m->values);
    free(m->arena);
}

static int64_t memo_slot(const memo_t *m, const double *key, int n, uint64_t h) {
    int64_t mask = m->slots - 1, i = (int64_t)(h & (uint64_t)mask);
    for (;;) {
        if (!m->hashes[i])
            return i;
        if (m->hashes[i] == h) {
            const double *k = m->arena + m->offsets[i];
            if ((int)k[0] == n) {
                int same = 1;
                for (int j = 0; j < n && same; j++)
                    same = k[1 + j] == key[j];
                if (same)
                    return i;
            }
        }
        i = (i + 1) & mask;
    }
}

static int memo_grow(memo_t *m) {
    memo_t bigger = *m;
    bigger.slots = m->slots * 2;
    bigger.hashes = calloc((size_t)bigger.slots, sizeof *bigger.hashes);
    bigger.offsets = malloc((size_t)bigger.slots * sizeof *bigger.offsets);
    bigger.values = malloc((size_t)bigger.slots * sizeof *bigger.values);
    if (!bigger.hashes || !bigger.offsets || !bigger.values) {
        free(bigger.hashes);
        free(bigger.offsets);
        free(bigger.values);
        return -1;
    }
    for (int64_t i = 0; i < m->slots; i++) {
        if (!m->hashes[i])
            continue;
        const double *k = m->arena + m->offsets[i];
        int64_t j = memo_slot(&bigger, k + 1, (int)k[0], m->hashes[i]);
        bigger.hashes[j] = m->hashes[i];
        bigger.offsets[j] = m->offsets[i];
        bigger.values[j] = m->values[i];
    }
    free(m->hashes);
    free(m->offsets);
    free(m->values);
    *m = bigger;
    return 0;
}

/* The memoised value of key, or the callback's; NaN where the callback failed (Python holds the error). */
static double memo_get(memo_t *m, const double *key, int n, lagom_cost_fn cost, int kind) {
    uint64_t h = hash_key(key, n);
    int64_t i = memo_slot(m, key, n, h);
    if (m->hashes[i])
        return m->values[i];
    double value = cost(kind, n, key);
    if (isnan(value))
        return value;
    if (m->arena_len + n + 1 > m->arena_cap) {
        int64_t cap = m->arena_cap * 2 + n + 1;
        double *arena = realloc(m->arena, (size_t)cap * sizeof *arena);
        if (!arena)
            return NAN;
        m->arena = arena;
        m->arena_cap = cap;
    }
    m->offsets[i] = m->arena_len;
    m->arena[m->arena_len] = n;
    memcpy(m->arena + m->arena_len + 1, key, (size_t)n * sizeof *key);
    m->arena_len += n + 1;
    m->hashes[i] = h;
    m->values[i] = value;
    if (++m->used * 2 > m->slots && memo_grow(m))
        return NAN;
    return value;
}

/* -- the event heap: (time, counter) ordered, entries of a queue's head at a version */

typedef struct {
    double time;
    int64_t counter;
    int32_t version;
    int32_t queue;
} entry_t;

typedef struct {
    entry_t *items;
    int64_t len, cap;
} heap_t;

static int before(const entry_t *a, const entry_t *b) {
    return a->time < b->time || (a->time == b->time && a->counter < b->counter);
}

static int heap_push(heap_t *h, entry_t e) {
    if (h->len == h->cap) {
        int64_t cap = h->cap ? h->cap * 2 : 256;
        entry_t *items = realloc(h->items, (size_t)cap * sizeof *items);
        if (!items)
            return -1;
        h->items = items;
        h->cap = cap;
    }
    int64_t i = h->len++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!before(&e, &h->items[parent]))
            break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = e;
    return 0;
}

static entry_t heap_pop(heap_t *h) {
    entry_t top = h->items[0], last = h->items[--h->len];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= h->len)
            break;
        if (child + 1 < h->len && before(&h->items[child + 1], &h->items[child]))
            child++;
        if (!before(&h->items[child], &last))
            break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->len)
        h->items[i] = last;
    return top;
}

/* -- the running state of a queue's head */

typedef struct {
    double start, rem, since, dur, rate, exposed, solo;
    int64_t rated, seq; /* seq: its start's number in the run (a probe restarts running heads in this order) */
    int32_t version;
} head_t;

static void fresh(head_t *s) {
    int32_t version = s->version + 1; /* no heap entry of the finished head is live any more */
    memset(s, 0, sizeof *s);
    s->start = -1.0;
    s->rem = 1.0;
    s->version = version;
}

/* A running head at a new duration: the work it did at the old one is taken off, and its end is pushed anew.
   1: re-rated; 0: the duration is the same; -1: out of memory. */
static int rerate(head_t *s, int32_t q, double dur, double now, heap_t *heap, int64_t *counter, double *longest) {
    if (dur == s->dur)
        return 0;
    if (s->dur)
        s->rem -= (now - s->since) / s->dur;
    s->since = now;
    s->dur = dur;
    s->version++;
    if (heap_push(heap, (entry_t){now + s->rem * dur, ++*counter, s->version, q}))
        return -1;
    if (dur > *longest)
        *longest = dur;
    return 1;
}

/* A small set of ids (devices or queues) walked in ascending order, as the reference walks sorted(woken). */
typedef struct {
    int32_t *ids;
    uint8_t *in;
    int32_t len;
} idset_t;

static void idset_add(idset_t *s, int32_t id) {
    if (!s->in[id]) {
        s->in[id] = 1;
        s->ids[s->len++] = id;
    }
}

static void idset_sort(idset_t *s) {
    for (int32_t i = 1; i < s->len; i++) {
        int32_t x = s->ids[i], j = i - 1;
        while (j >= 0 && s->ids[j] > x) {
            s->ids[j + 1] = s->ids[j];
            j--;
        }
        s->ids[j + 1] = x;
    }
}

static void idset_copy(idset_t *dst, const idset_t *src) {
    for (int32_t i = 0; i < src->len; i++)
        idset_add(dst, src->ids[i]);
}

static void idset_clear(idset_t *s) {
    for (int32_t i = 0; i < s->len; i++)
        s->in[s->ids[i]] = 0;
    s->len = 0;
}

/* -- one run of a phase, kept between calls: it pauses at the band's period boundaries the caller watches */

struct lagom_sim {
    const lagom_phase_t *ph;
    lagom_cost_fn cost;
    lagom_result_t *out;
    const uint8_t *check; /* per task: starting it is a period boundary to pause at while watching */
    int watching, at_boundary; /* at_boundary: paused there; the run goes on from its exposed-time step */
    int every_boundary;        /* a probe pauses at every boundary; a run only at those inside the band */
    int64_t checkpoint_every, since_checkpoint; /* tasks started between checkpoints (0: none kept) */
    memo_t *memo;         /* a clone shares its parent's */
    memo_t own_memo;
    int owns_memo;
    int32_t *head;
    head_t *state;
    int32_t *compute_on; /* per device: the queue of the compute task running there, or -1 */
    int32_t *comms_on;   /* per device: n_queues slots, the queues of the comm tasks running there */
    int32_t *comms_len;
    heap_t heap;
    idset_t woken, dirty, rate_dirty;
    int32_t *finished, *blockers;
    entry_t *later;
    int64_t later_cap;
    double *key;
    double now, exposed_total, longest;
    int64_t counter, event, seq;
    int32_t touches, live;
};

typedef struct lagom_sim sim_t;

static int done(const sim_t *r, int32_t task) { return task < r->head[r->ph->task[task].queue]; }

static int deps_done(const sim_t *r, int32_t task) {
    const lagom_phase_t *ph = r->ph;
    for (int32_t k = ph->task[task].dep_off; k < ph->task[task + 1].dep_off; k++)
        if (!done(r, ph->dep_list[k]))
            return 0;
    return 1;
}

static int started(const sim_t *r, int32_t task) {
    int32_t q = r->ph->task[task].queue;
    return r->head[q] == task && r->state[q].start >= 0;
}

#define END_POSITION ((int64_t)1 << 62) /* lowering.END: past a queue's last task */

static int64_t head_position(const sim_t *s, int32_t q) {
    int32_t t = s->head[q];
    return t < s->ph->queue_first[q + 1] ? s->ph->position[t] : END_POSITION;
}

/* Whether every band queue's head lies in one of its spans (the first that holds it) with a whole period
   left in it: the only states the caller compares (simulator._seen gives None for the others). */
static int in_band(const sim_t *s) {
    const lagom_phase_t *ph = s->ph;
    for (int32_t q = 0; q < ph->n_queues; q++) {
        if (!ph->shift[q])
            continue;
        int64_t p = head_position(s, q);
        int inside = 0;
        for (int32_t k = ph->span_off[q]; k < ph->span_off[q + 1]; k++) {
            if (ph->span_lo[k] <= p && p < ph->span_hi[k]) {
                inside = p + ph->shift[q] <= ph->span_hi[k];
                break;
            }
        }
        if (!inside)
            return 0;
    }
    return 1;
}

/* Whether every band queue with spans is past its last one: no boundary can be in the band any more. */
static int band_over(const sim_t *s) {
    const lagom_phase_t *ph = s->ph;
    for (int32_t q = 0; q < ph->n_queues; q++)
        if (ph->shift[q] && ph->span_off[q + 1] > ph->span_off[q] &&
            head_position(s, q) + ph->shift[q] <= ph->span_hi[ph->span_off[q + 1] - 1])
            return 0;
    return 1;
}

static void touch(sim_t *s, int32_t key) {
    if (!s->out->touched[key])
        s->out->touched[key] = ++s->touches;
}

EXPORT int lagom_event_loop_abi(void) { return LAGOM_EVENT_LOOP_ABI; }

EXPORT void lagom_sim_close(sim_t *s) {
    if (!s)
        return;
    if (s->owns_memo)
        memo_free(&s->own_memo);
    free(s->heap.items);
    free(s->head);
    free(s->state);
    free(s->compute_on);
    free(s->comms_on);
    free(s->comms_len);
    free(s->woken.ids);
    free(s->woken.in);
    free(s->dirty.ids);
    free(s->dirty.in);
    free(s->rate_dirty.ids);
    free(s->rate_dirty.in);
    free(s->finished);
    free(s->blockers);
    free(s->later);
    free(s->key);
    free(s);
}

/* Every buffer of a run of ph, uninitialised; NULL when out of memory. */
static sim_t *sim_alloc(const lagom_phase_t *ph) {
    const int32_t nq = ph->n_queues, nd = ph->n_devices;
    sim_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->ph = ph;
    s->head = malloc((size_t)nq * sizeof *s->head + 1);
    s->state = calloc((size_t)nq + 1, sizeof *s->state);
    s->compute_on = malloc((size_t)nd * sizeof *s->compute_on + 1);
    s->comms_on = malloc((size_t)nd * (size_t)nq * sizeof *s->comms_on + 1);
    s->comms_len = calloc((size_t)nd + 1, sizeof *s->comms_len);
    s->woken.ids = malloc((size_t)nq * sizeof(int32_t) + 1);
    s->woken.in = calloc((size_t)nq + 1, 1);
    s->dirty.ids = malloc((size_t)nd * sizeof(int32_t) + 1);
    s->dirty.in = calloc((size_t)nd + 1, 1);
    s->rate_dirty.ids = malloc((size_t)nd * sizeof(int32_t) + 1);
    s->rate_dirty.in = calloc((size_t)nd + 1, 1);
    s->finished = malloc((size_t)nq * sizeof *s->finished + 1);
    s->blockers = malloc((size_t)nd * sizeof *s->blockers + 1);
    s->key = malloc((size_t)(2 + 2 * nq) * sizeof *s->key);
    if (!s->head || !s->state || !s->compute_on || !s->comms_on || !s->comms_len || !s->woken.ids ||
        !s->woken.in || !s->dirty.ids || !s->dirty.in || !s->rate_dirty.ids || !s->rate_dirty.in || !s->finished ||
        !s->blockers || !s->key) {
        lagom_sim_close(s);
        return NULL;
    }
    return s;
}

/* A run of ph with its own memo, nothing started yet. */
static sim_t *sim_new(const lagom_phase_t *ph, lagom_cost_fn cost, lagom_result_t *out, const uint8_t *check) {
    sim_t *s = sim_alloc(ph);
    if (!s)
        return NULL;
    if (memo_init(&s->own_memo)) {
        memo_free(&s->own_memo);
        lagom_sim_close(s);
        return NULL;
    }
    s->owns_memo = 1;
    s->memo = &s->own_memo;
    s->cost = cost;
    s->out = out;
    s->check = check;
    return s;
}

EXPORT sim_t *lagom_sim_open(const lagom_phase_t *ph, lagom_cost_fn cost, lagom_result_t *out, const uint8_t *check) {
    sim_t *s = sim_new(ph, cost, out, check);
    if (!s)
        return NULL;
    for (int32_t q = 0; q < ph->n_queues; q++) {
        s->head[q] = ph->queue_first[q];
        s->state[q].version = -1;
        fresh(&s->state[q]);
        s->live += s->head[q] < ph->queue_first[q + 1];
        idset_add(&s->woken, q);
    }
    for (int32_t d = 0; d < ph->n_devices; d++)
        s->compute_on[d] = -1;
    out->tasks = 0;
    return s;
}

EXPORT void lagom_sim_watch(sim_t *s, int watching) { s->watching = watching; }

EXPORT void lagom_sim_checkpoints(sim_t *s, int64_t every) { s->checkpoint_every = every; }

/* The run goes on from where it paused (or starts); LAGOM_SIM_PAUSED at a watched period boundary. */
EXPORT int lagom_sim_run(sim_t *s) {
    const lagom_phase_t *ph = s->ph;
    const int32_t nq = ph->n_queues;
    lagom_result_t *out = s->out;
    double *key = s->key;
    while (s->live) {
        if (s->at_boundary) {
            s->at_boundary = 0;
            goto exposed;
        }
        if (!s->watching && s->checkpoint_every && s->since_checkpoint >= s->checkpoint_every) {
            s->since_checkpoint = 0; /* the caller saves this state and calls again: the loop goes on from here */
            return LAGOM_SIM_CHECKPOINT;
        }
        /* Start every stream head whose dependencies are done, in queue order. */
        int check = 0;
        idset_sort(&s->woken);
        for (int32_t w = 0; w < s->woken.len; w++) {
            int32_t q = s->woken.ids[w], t = s->head[q];
            head_t *st = &s->state[q];
            if (t >= ph->queue_first[q + 1] || st->start >= 0 || !deps_done(s, t))
                continue;
            st->start = st->since = s->now;
            st->seq = ++s->seq;
            s->since_checkpoint++;
            int32_t c = ph->task[t].cost;
            if (ph->task[t].comm) {
                int busy = 0;
                for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++)
                    busy |= s->compute_on[ph->dev_list[k]] >= 0;
                st->solo = ph->cost_solo[c];
                st->rem = 1.0 + (busy ? ph->cost_launch[c] / (st->solo > EPS ? st->solo : EPS) : 0.0);
                for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++) {
                    int32_t d = ph->dev_list[k];
                    s->comms_on[(int64_t)d * nq + s->comms_len[d]++] = q;
                }
                int32_t kk = ph->cost_key[c];
                double *row = out->totals + 4 * (int64_t)kk;
                touch(s, kk);
                row[1] += st->solo;
                if (ph->task[t].first) {
                    row[0] -= s->now;
                    row[3] += 1;
                    if (isinf(out->first_start[kk]))
                        out->first_start[kk] = s->now;
                }
            } else {
                s->compute_on[ph->task[t].device] = q;
                check |= s->check && s->check[t] && s->watching;
            }
            for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++)
                idset_add(&s->dirty, ph->dev_list[k]);
            st->dur = 0.0;
            out->tasks++;
        }
        idset_clear(&s->woken);
        /* Re-rate the tasks whose neighbours changed: comms first (their HBM rates feed compute). */
        s->event++;
        idset_sort(&s->dirty);
        for (int32_t i = 0; i < s->dirty.len; i++) {
            int32_t d = s->dirty.ids[i];
            for (int32_t j = 0; j < s->comms_len[d]; j++) {
                int32_t q = s->comms_on[(int64_t)d * nq + j], t = s->head[q], c = ph->task[t].cost;
                head_t *st = &s->state[q];
                if (st->rated == s->event)
                    continue;
                st->rated = s->event;
                double util = 0.0;
                int32_t sharing = 1;
                for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++) {
                    int32_t dd = ph->dev_list[k], ct = s->compute_on[dd];
                    if (ct >= 0 && ph->cost_util[ph->task[s->head[ct]].cost] > util)
                        util = ph->cost_util[ph->task[s->head[ct]].cost];
                    if (ph->cost_cross[c]) { /* collectives of other communicators crossing nodes share the NIC */
                        int32_t on_nic = 0;
                        for (int32_t o = 0; o < s->comms_len[dd]; o++) {
                            int32_t oq = s->comms_on[(int64_t)dd * nq + o], ot = s->head[oq], oc = ph->task[ot].cost;
                            if (ph->cost_cross[oc] && (!(ph->cost_one_way[c] && ph->cost_one_way[oc]) ||
                                                       (ph->task[t].device == dd) == (ph->task[ot].device == dd)))
                                on_nic++;
                        }
                        if (on_nic > sharing)
                            sharing = on_nic;
                    }
                }
                key[0] = c;
                key[1] = util;
                key[2] = 1.0 / sharing;
                double dur = memo_get(s->memo, key, 3, s->cost, LAGOM_COST_COMM);
                if (isnan(dur))
                    return LAGOM_SIM_CALLBACK;
                int changed = rerate(st, q, dur, s->now, &s->heap, &s->counter, &s->longest);
                if (changed < 0)
                    return LAGOM_SIM_NOMEM;
                if (changed) {
                    key[0] = c;
                    key[1] = dur;
                    double rate = memo_get(s->memo, key, 2, s->cost, LAGOM_COST_RATE);
                    if (isnan(rate))
                        return LAGOM_SIM_CALLBACK;
                    if (rate != st->rate) {
                        st->rate = rate;
                        for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++)
                            idset_add(&s->rate_dirty, ph->dev_list[k]);
                    }
                }
            }
        }
        for (int32_t i = 0; i < s->rate_dirty.len; i++)
            idset_add(&s->dirty, s->rate_dirty.ids[i]);
        idset_clear(&s->rate_dirty);
        idset_sort(&s->dirty);
        for (int32_t i = 0; i < s->dirty.len; i++) {
            int32_t d = s->dirty.ids[i], q = s->compute_on[d];
            if (q < 0)
                continue;
            int n = 1;
            key[0] = ph->task[s->head[q]].cost;
            for (int32_t j = 0; j < s->comms_len[d]; j++) {
                int32_t cq = s->comms_on[(int64_t)d * nq + j];
                key[n++] = ph->task[s->head[cq]].cost;
                key[n++] = s->state[cq].rate;
            }
            double dur = memo_get(s->memo, key, n, s->cost, LAGOM_COST_COMPUTE);
            if (isnan(dur))
                return LAGOM_SIM_CALLBACK;
            if (rerate(&s->state[q], q, dur, s->now, &s->heap, &s->counter, &s->longest) < 0)
                return LAGOM_SIM_NOMEM;
        }
        idset_clear(&s->dirty);
        while (s->heap.len && s->heap.items[0].version != s->state[s->heap.items[0].queue].version)
            heap_pop(&s->heap);
        if (!s->heap.len)
            return LAGOM_SIM_DEADLOCK;
        if (check) { /* the caller compares the state with earlier boundaries, and may jump periods on */
            if (s->every_boundary || in_band(s)) {
                s->at_boundary = 1;
                return LAGOM_SIM_PAUSED;
            }
            s->watching = !band_over(s); /* outside the band: wait for it, unless it is over */
        }
    exposed:;
        /* Exposed communication: a compute stream idle while it waits on a released collective (one still
           waiting for another stage's compute is a pipeline bubble, not exposed comm). */
        int32_t nb = 0;
        for (int32_t i = 0; i < ph->n_blame; i++) {
            int32_t d = ph->blame_device[i], cq = ph->compute_queue[d];
            if (s->compute_on[d] >= 0)
                continue;
            int32_t blocker = -1, t = s->head[cq];
            if (t < ph->queue_first[cq + 1]) {
                for (int32_t k = ph->task[t].dep_off; k < ph->task[t + 1].dep_off; k++) {
                    int32_t waited = ph->dep_list[k];
                    if (done(s, waited))
                        continue;
                    if (ph->task[waited].comm && deps_done(s, waited)) {
                        blocker = waited;
                        break;
                    }
                }
            } else if (s->comms_len[d]) { /* compute finished: trailing collectives of this device */
                blocker = s->head[s->comms_on[(int64_t)d * nq]];
            }
            if (blocker >= 0 && !started(s, blocker)) /* queued: blame what holds its communicator */
                blocker = s->head[ph->task[blocker].queue];
            if (blocker >= 0)
                s->blockers[nb++] = blocker;
        }
        double end = s->heap.items[0].time;
        if (nb) {
            double dt = end - s->now;
            for (int32_t i = 0; i < nb; i++) {
                int32_t q = ph->task[s->blockers[i]].queue, kk = ph->cost_key[ph->task[s->blockers[i]].cost];
                s->state[q].exposed += dt;
                touch(s, kk);
                out->totals[4 * (int64_t)kk + 2] += dt;
                s->exposed_total += dt;
            }
        }
        s->now = end;
        /* Finish every task within DONE of its end. */
        double limit = end + DONE * s->longest;
        int32_t nf = 0;
        int64_t nl = 0;
        while (s->heap.len && s->heap.items[0].time <= limit) {
            entry_t e = heap_pop(&s->heap);
            head_t *st = &s->state[e.queue];
            if (e.version != st->version)
                continue;
            /* an entry at or before now has ended by its own clock: the fraction alone would lose it where
               the task is shorter than DONE of a float step of now (now - since cancels) */
            if (e.time <= s->now || st->rem - (s->now - st->since) / st->dur <= DONE) {
                s->finished[nf++] = e.queue;
            } else {
                if (nl == s->later_cap) {
                    int64_t cap = s->later_cap ? s->later_cap * 2 : 64;
                    entry_t *grown = realloc(s->later, (size_t)cap * sizeof *s->later);
                    if (!grown)
                        return LAGOM_SIM_NOMEM;
                    s->later = grown;
                    s->later_cap = cap;
                }
                s->later[nl++] = e;
            }
        }
        if (!nf) /* the clock reached the earliest end and nothing ended: it would never move again */
            return LAGOM_SIM_STALLED;
        for (int64_t i = 0; i < nl; i++)
            if (heap_push(&s->heap, s->later[i]))
                return LAGOM_SIM_NOMEM;
        for (int32_t i = 0; i < nf; i++) {
            int32_t q = s->finished[i], t = s->head[q];
            head_t *st = &s->state[q];
            if (ph->task[t].comm) {
                for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++) {
                    int32_t d = ph->dev_list[k];
                    int32_t *on = s->comms_on + (int64_t)d * nq;
                    for (int32_t j = 0; j < s->comms_len[d]; j++) {
                        if (on[j] == q) {
                            memmove(on + j, on + j + 1, (size_t)(s->comms_len[d] - j - 1) * sizeof *on);
                            s->comms_len[d]--;
                            break;
                        }
                    }
                }
                if (ph->task[t].last)
                    out->totals[4 * (int64_t)ph->cost_key[ph->task[t].cost]] += s->now;
                int32_t rec = ph->task[t].record;
                if (out->start) { /* a probe keeps no records */
                    out->start[rec] = st->start;
                    out->end[rec] = s->now;
                    out->solo[rec] = st->solo;
                    out->exposed[rec] = st->exposed;
                }
            } else {
                s->compute_on[ph->task[t].device] = -1;
            }
            for (int32_t k = ph->task[t].dev_off; k < ph->task[t + 1].dev_off; k++)
                idset_add(&s->dirty, ph->dev_list[k]);
            s->head[q] = t + 1;
            idset_add(&s->woken, q);
            for (int32_t k = ph->task[t].wake_off; k < ph->task[t + 1].wake_off; k++)
                idset_add(&s->woken, ph->wake_list[k]);
            fresh(st);
            if (s->head[q] >= ph->queue_first[q + 1])
                s->live--;
        }
    }
    return LAGOM_SIM_OK;
}

/* What the caller reads between calls: the clock, the exposed sum, the heads, and each head's remaining
   fraction (NaN: not started) with the number of its start. */
EXPORT void lagom_sim_state(const sim_t *s, double *remaining, int64_t *seq) {
    lagom_result_t *out = s->out;
    out->now = s->now;
    out->exposed_total = s->exposed_total;
    memcpy(out->heads, s->head, (size_t)s->ph->n_queues * sizeof *s->head);
    for (int32_t q = 0; q < s->ph->n_queues; q++) {
        const head_t *st = &s->state[q];
        int running = s->head[q] < s->ph->queue_first[q + 1] && st->start >= 0;
        remaining[q] = running ? st->rem - (s->now - st->since) / st->dur : NAN;
        seq[q] = running ? st->seq : 0;
    }
}

static int push_end(sim_t *s, int32_t q) {
    head_t *st = &s->state[q];
    return heap_push(&s->heap, (entry_t){st->since + st->rem * st->dur, ++s->counter, st->version, q});
}

/* Periods skipped (the caller worked out where to): the clock and exposed sum move to later and exposed;
   each queue's head moves to head[q], a running one's start by delta; a head given a remaining fraction
   (not NaN) takes it from later on. The heap is rebuilt device by device (compute, then comms in order), as
   the reference rebuilds it: its devices are blame_device's, in that order. Every queue is woken. The run goes on from its exposed-time step. */
EXPORT int lagom_sim_jump(sim_t *s, double later, double exposed, double delta, const int32_t *head,
                          const double *remaining) {
    const lagom_phase_t *ph = s->ph;
    for (int32_t q = 0; q < ph->n_queues; q++) {
        head_t *st = &s->state[q];
        int running = s->head[q] < ph->queue_first[q + 1] && st->start >= 0;
        if (head[q] != s->head[q]) {
            s->head[q] = head[q];
            if (running)
                st->start += delta;
            else /* its image has waited for nothing yet (what this head was blamed for stays behind) */
                fresh(st);
        }
        if (running && !isnan(remaining[q])) {
            st->rem = remaining[q];
            st->since = later;
        }
        idset_add(&s->woken, q);
    }
    s->now = later;
    s->exposed_total = exposed;
    s->heap.len = 0;
    for (int32_t i = 0; i < ph->n_blame; i++) { /* the reference's device order */
        int32_t d = ph->blame_device[i], cq = s->compute_on[d];
        if (cq >= 0 && push_end(s, cq))
            return LAGOM_SIM_NOMEM;
        for (int32_t j = 0; j < s->comms_len[d]; j++) {
            int32_t q = s->comms_on[(int64_t)d * ph->n_queues + j];
            if (ph->task[s->head[q]].device == d && push_end(s, q))
                return LAGOM_SIM_NOMEM;
        }
    }
    s->at_boundary = 1;
    return LAGOM_SIM_OK;
}

/* The state of a run at the top of its loop, from src into dst (a run or a checkpoint of ph's sizes). */
static void copy_state(sim_t *dst, const sim_t *src, int32_t nq, int32_t nd) {
    memcpy(dst->head, src->head, (size_t)nq * sizeof *dst->head);
    memcpy(dst->state, src->state, (size_t)nq * sizeof *dst->state);
    memcpy(dst->compute_on, src->compute_on, (size_t)nd * sizeof *dst->compute_on);
    memcpy(dst->comms_on, src->comms_on, (size_t)nd * (size_t)nq * sizeof *dst->comms_on);
    memcpy(dst->comms_len, src->comms_len, (size_t)nd * sizeof *dst->comms_len);
    dst->now = src->now;
    dst->exposed_total = src->exposed_total;
    dst->longest = src->longest;
    dst->event = src->event;
    dst->seq = src->seq;
    dst->touches = src->touches;
    dst->live = src->live;
}

/* Running heads restart from the clock with their remaining fractions (NULL: what is left of each at the
   clock), pushed in the order they started: the reference resumes a checkpoint so. 0, or -1 out of memory. */
static int restart(sim_t *s, const double *remaining) {
    const lagom_phase_t *ph = s->ph;
    int32_t *order = s->finished, n = 0; /* running heads by their start's number: an insertion sort of a few dozen */
    for (int32_t q = 0; q < ph->n_queues; q++) {
        head_t *st = &s->state[q];
        if (s->head[q] >= ph->queue_first[q + 1] || st->start < 0)
            continue;
        st->rem = remaining ? remaining[q] : st->rem - (s->now - st->since) / st->dur;
        st->since = s->now;
        int32_t j = n++;
        while (j > 0 && s->state[order[j - 1]].seq > st->seq) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = q;
    }
    for (int32_t i = 0; i < n; i++)
        if (push_end(s, order[i]))
            return -1;
    return 0;
}

/* A copy of the run that records into out (records may be NULL: none kept) and shares the memo. Its running
   heads restart from its clock with the given remaining fractions, with nothing woken or dirty: the
   reference's probe resumes a checkpoint so. */
EXPORT sim_t *lagom_sim_probe(const sim_t *src, lagom_result_t *out, const double *remaining) {
    sim_t *s = sim_alloc(src->ph);
    if (!s)
        return NULL;
    s->cost = src->cost;
    s->memo = src->memo;
    s->out = out;
    s->check = src->check;
    s->watching = 1;
    s->every_boundary = 1;
    copy_state(s, src, src->ph->n_queues, src->ph->n_devices);
    out->tasks = src->out->tasks;
    if (restart(s, remaining)) {
        lagom_sim_close(s);
        return NULL;
    }
    return s;
}

/* A checkpoint holds a run's state in a run of its own that never runs (no heap, no memo), so one copy
   serves probes, saves and resumes; with the tasks started by then (the results' count). */
struct lagom_checkpoint {
    sim_t *state;
    int64_t tasks;
};

EXPORT lagom_checkpoint_t *lagom_sim_save(const sim_t *s) {
    lagom_checkpoint_t *cp = malloc(sizeof *cp);
    if (!cp)
        return NULL;
    cp->state = sim_alloc(s->ph);
    if (!cp->state) {
        free(cp);
        return NULL;
    }
    copy_state(cp->state, s, s->ph->n_queues, s->ph->n_devices);
    idset_copy(&cp->state->woken, &s->woken);
    idset_copy(&cp->state->dirty, &s->dirty);
    cp->state->ph = NULL; /* a checkpoint outlives the arrays it was saved from: it keeps only the state */
    cp->tasks = s->out->tasks;
    return cp;
}

/* A new run of ph (the phase the checkpoint was saved from, lowered alike) from the checkpoint, watching no
   boundary, with its own memo: the reference's resume (running heads pushed anew, woken and dirty as saved). */
EXPORT sim_t *lagom_sim_resume(const lagom_phase_t *ph, lagom_cost_fn cost, lagom_result_t *out, const uint8_t *check,
                               const lagom_checkpoint_t *from) {
    sim_t *s = sim_new(ph, cost, out, check);
    if (!s)
        return NULL;
    copy_state(s, from->state, ph->n_queues, ph->n_devices);
    idset_copy(&s->woken, &from->state->woken);
    idset_copy(&s->dirty, &from->state->dirty);
    out->tasks = from->tasks;
    if (restart(s, NULL)) {
        lagom_sim_close(s);
        return NULL;
    }
    return s;
}

EXPORT void lagom_checkpoint_free(lagom_checkpoint_t *cp) {
    if (!cp)
        return;
    lagom_sim_close(cp->state);
    free(cp);
}
