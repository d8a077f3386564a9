/* The simulator's event loop in C: one phase of a step, every task simulated, no steady-state jumps.
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
    int64_t rated;
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

static void idset_clear(idset_t *s) {
    for (int32_t i = 0; i < s->len; i++)
        s->in[s->ids[i]] = 0;
    s->len = 0;
}

typedef struct {
    const lagom_phase_t *ph;
    int32_t *task_queue;
    int32_t *head;
    head_t *state;
    int32_t *compute_on;   /* per device: the queue of the compute task running there, or -1 */
    int32_t *comms_on;     /* per device: n_queues slots, the queues of the comm tasks running there */
    int32_t *comms_len;
} run_t;

static int done(const run_t *r, int32_t task) { return task < r->head[r->task_queue[task]]; }

static int deps_done(const run_t *r, int32_t task) {
    const lagom_phase_t *ph = r->ph;
    for (int32_t k = ph->dep_off[task]; k < ph->dep_off[task + 1]; k++)
        if (!done(r, ph->dep_list[k]))
            return 0;
    return 1;
}

static int started(const run_t *r, int32_t task) {
    int32_t q = r->task_queue[task];
    return r->head[q] == task && r->state[q].start >= 0;
}

static void touch(lagom_result_t *out, int32_t key, int32_t *touches) {
    if (!out->touched[key])
        out->touched[key] = ++*touches;
}

EXPORT int lagom_event_loop_abi(void) { return LAGOM_EVENT_LOOP_ABI; }

EXPORT int lagom_simulate_phase(const lagom_phase_t *ph, lagom_cost_fn cost, lagom_result_t *out) {
    const int32_t nq = ph->n_queues, nd = ph->n_devices;
    int rc = LAGOM_SIM_NOMEM;
    run_t r = {ph, NULL, NULL, NULL, NULL, NULL, NULL};
    memo_t memo;
    heap_t heap = {NULL, 0, 0};
    idset_t woken = {0}, dirty = {0}, rate_dirty = {0};
    int32_t *finished = NULL, *blockers = NULL;
    entry_t *later = NULL;
    double *key = NULL;
    int64_t later_cap = 0;
    double now = 0.0, exposed_total = 0.0, longest = 0.0;
    if (memo_init(&memo))
        goto out;
    r.task_queue = malloc((size_t)ph->n_tasks * sizeof *r.task_queue + 1);
    r.head = malloc((size_t)nq * sizeof *r.head);
    r.state = calloc((size_t)nq, sizeof *r.state);
    r.compute_on = malloc((size_t)nd * sizeof *r.compute_on);
    r.comms_on = malloc((size_t)nd * (size_t)nq * sizeof *r.comms_on + 1);
    r.comms_len = calloc((size_t)nd, sizeof *r.comms_len);
    woken.ids = malloc((size_t)nq * sizeof(int32_t));
    woken.in = calloc((size_t)nq, 1);
    dirty.ids = malloc((size_t)nd * sizeof(int32_t));
    dirty.in = calloc((size_t)nd, 1);
    rate_dirty.ids = malloc((size_t)nd * sizeof(int32_t));
    rate_dirty.in = calloc((size_t)nd, 1);
    finished = malloc((size_t)nq * sizeof *finished);
    blockers = malloc((size_t)nd * sizeof *blockers);
    key = malloc((size_t)(2 + 2 * nq) * sizeof *key);
    if (!r.task_queue || !r.head || !r.state || !r.compute_on || !r.comms_on || !r.comms_len || !woken.ids ||
        !woken.in || !dirty.ids || !dirty.in || !rate_dirty.ids || !rate_dirty.in || !finished || !blockers || !key)
        goto out;
    int32_t live = 0;
    for (int32_t q = 0; q < nq; q++) {
        for (int32_t t = ph->queue_first[q]; t < ph->queue_first[q + 1]; t++)
            r.task_queue[t] = q;
        r.head[q] = ph->queue_first[q];
        r.state[q].version = -1;
        fresh(&r.state[q]);
        live += r.head[q] < ph->queue_first[q + 1];
        idset_add(&woken, q);
    }
    for (int32_t d = 0; d < nd; d++)
        r.compute_on[d] = -1;
    int64_t counter = 0, event = 0;
    int32_t touches = 0;
    out->tasks = 0;
    while (live) {
        /* Start every stream head whose dependencies are done, in queue order. */
        idset_sort(&woken);
        for (int32_t w = 0; w < woken.len; w++) {
            int32_t q = woken.ids[w], t = r.head[q];
            head_t *s = &r.state[q];
            if (t >= ph->queue_first[q + 1] || s->start >= 0 || !deps_done(&r, t))
                continue;
            s->start = s->since = now;
            int32_t c = ph->cost[t];
            if (ph->comm[t]) {
                int busy = 0;
                for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++)
                    busy |= r.compute_on[ph->dev_list[k]] >= 0;
                s->solo = ph->cost_solo[c];
                s->rem = 1.0 + (busy ? ph->cost_launch[c] / (s->solo > EPS ? s->solo : EPS) : 0.0);
                for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++) {
                    int32_t d = ph->dev_list[k];
                    r.comms_on[(int64_t)d * nq + r.comms_len[d]++] = q;
                }
                int32_t kk = ph->cost_key[c];
                double *row = out->totals + 4 * (int64_t)kk;
                touch(out, kk, &touches);
                row[1] += s->solo;
                if (ph->first[t]) {
                    row[0] -= now;
                    row[3] += 1;
                    if (isinf(out->first_start[kk]))
                        out->first_start[kk] = now;
                }
            } else {
                r.compute_on[ph->device[t]] = q;
            }
            for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++)
                idset_add(&dirty, ph->dev_list[k]);
            s->dur = 0.0;
            out->tasks++;
        }
        idset_clear(&woken);
        /* Re-rate the tasks whose neighbours changed: comms first (their HBM rates feed compute). */
        event++;
        idset_sort(&dirty);
        for (int32_t i = 0; i < dirty.len; i++) {
            int32_t d = dirty.ids[i];
            for (int32_t j = 0; j < r.comms_len[d]; j++) {
                int32_t q = r.comms_on[(int64_t)d * nq + j], t = r.head[q], c = ph->cost[t];
                head_t *s = &r.state[q];
                if (s->rated == event)
                    continue;
                s->rated = event;
                double util = 0.0;
                int32_t sharing = 1;
                for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++) {
                    int32_t dd = ph->dev_list[k], ct = r.compute_on[dd];
                    if (ct >= 0 && ph->cost_util[ph->cost[r.head[ct]]] > util)
                        util = ph->cost_util[ph->cost[r.head[ct]]];
                    if (ph->cost_cross[c]) { /* collectives of other communicators crossing nodes share the NIC */
                        int32_t on_nic = 0;
                        for (int32_t o = 0; o < r.comms_len[dd]; o++) {
                            int32_t oq = r.comms_on[(int64_t)dd * nq + o], ot = r.head[oq], oc = ph->cost[ot];
                            if (ph->cost_cross[oc] && (!(ph->cost_one_way[c] && ph->cost_one_way[oc]) ||
                                                       (ph->device[t] == dd) == (ph->device[ot] == dd)))
                                on_nic++;
                        }
                        if (on_nic > sharing)
                            sharing = on_nic;
                    }
                }
                key[0] = c;
                key[1] = util;
                key[2] = 1.0 / sharing;
                double dur = memo_get(&memo, key, 3, cost, LAGOM_COST_COMM);
                if (isnan(dur)) {
                    rc = LAGOM_SIM_CALLBACK;
                    goto out;
                }
                int changed = rerate(s, q, dur, now, &heap, &counter, &longest);
                if (changed < 0)
                    goto out;
                if (changed) {
                    key[0] = c;
                    key[1] = dur;
                    double rate = memo_get(&memo, key, 2, cost, LAGOM_COST_RATE);
                    if (isnan(rate)) {
                        rc = LAGOM_SIM_CALLBACK;
                        goto out;
                    }
                    if (rate != s->rate) {
                        s->rate = rate;
                        for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++)
                            idset_add(&rate_dirty, ph->dev_list[k]);
                    }
                }
            }
        }
        for (int32_t i = 0; i < rate_dirty.len; i++)
            idset_add(&dirty, rate_dirty.ids[i]);
        idset_clear(&rate_dirty);
        idset_sort(&dirty);
        for (int32_t i = 0; i < dirty.len; i++) {
            int32_t d = dirty.ids[i], q = r.compute_on[d];
            if (q < 0)
                continue;
            head_t *s = &r.state[q];
            int n = 1;
            key[0] = ph->cost[r.head[q]];
            for (int32_t j = 0; j < r.comms_len[d]; j++) {
                int32_t cq = r.comms_on[(int64_t)d * nq + j];
                key[n++] = ph->cost[r.head[cq]];
                key[n++] = r.state[cq].rate;
            }
            double dur = memo_get(&memo, key, n, cost, LAGOM_COST_COMPUTE);
            if (isnan(dur)) {
                rc = LAGOM_SIM_CALLBACK;
                goto out;
            }
            if (rerate(s, q, dur, now, &heap, &counter, &longest) < 0)
                goto out;
        }
        idset_clear(&dirty);
        while (heap.len && heap.items[0].version != r.state[heap.items[0].queue].version)
            heap_pop(&heap);
        if (!heap.len) {
            rc = LAGOM_SIM_DEADLOCK;
            goto out;
        }
        /* Exposed communication: a compute stream idle while it waits on a released collective (one still
           waiting for another stage's compute is a pipeline bubble, not exposed comm). */
        int32_t nb = 0;
        for (int32_t i = 0; i < ph->n_blame; i++) {
            int32_t d = ph->blame_device[i], cq = ph->compute_queue[d];
            if (r.compute_on[d] >= 0)
                continue;
            int32_t blocker = -1, t = r.head[cq];
            if (t < ph->queue_first[cq + 1]) {
                for (int32_t k = ph->dep_off[t]; k < ph->dep_off[t + 1]; k++) {
                    int32_t waited = ph->dep_list[k];
                    if (done(&r, waited))
                        continue;
                    if (ph->comm[waited] && deps_done(&r, waited)) {
                        blocker = waited;
                        break;
                    }
                }
            } else if (r.comms_len[d]) { /* compute finished: trailing collectives of this device */
                blocker = r.head[r.comms_on[(int64_t)d * nq]];
            }
            if (blocker >= 0 && !started(&r, blocker)) /* queued: blame what holds its communicator */
                blocker = r.head[r.task_queue[blocker]];
            if (blocker >= 0)
                blockers[nb++] = blocker;
        }
        double end = heap.items[0].time;
        if (nb) {
            double dt = end - now;
            for (int32_t i = 0; i < nb; i++) {
                int32_t q = r.task_queue[blockers[i]], kk = ph->cost_key[ph->cost[blockers[i]]];
                r.state[q].exposed += dt;
                touch(out, kk, &touches);
                out->totals[4 * (int64_t)kk + 2] += dt;
                exposed_total += dt;
            }
        }
        now = end;
        /* Finish every task within DONE of its end. */
        double limit = end + DONE * longest;
        int32_t nf = 0;
        int64_t nl = 0;
        while (heap.len && heap.items[0].time <= limit) {
            entry_t e = heap_pop(&heap);
            head_t *s = &r.state[e.queue];
            if (e.version != s->version)
                continue;
            /* an entry at or before now has ended by its own clock: the fraction alone would lose it where
               the task is shorter than DONE of a float step of now (now - since cancels) */
            if (e.time <= now || s->rem - (now - s->since) / s->dur <= DONE) {
                finished[nf++] = e.queue;
            } else {
                if (nl == later_cap) {
                    later_cap = later_cap ? later_cap * 2 : 64;
                    entry_t *grown = realloc(later, (size_t)later_cap * sizeof *later);
                    if (!grown)
                        goto out;
                    later = grown;
                }
                later[nl++] = e;
            }
        }
        if (!nf) { /* the clock reached the earliest end and nothing ended: it would never move again */
            rc = LAGOM_SIM_STALLED;
            goto out;
        }
        for (int64_t i = 0; i < nl; i++)
            if (heap_push(&heap, later[i]))
                goto out;
        for (int32_t i = 0; i < nf; i++) {
            int32_t q = finished[i], t = r.head[q];
            head_t *s = &r.state[q];
            if (ph->comm[t]) {
                for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++) {
                    int32_t d = ph->dev_list[k];
                    int32_t *on = r.comms_on + (int64_t)d * nq;
                    for (int32_t j = 0; j < r.comms_len[d]; j++) {
                        if (on[j] == q) {
                            memmove(on + j, on + j + 1, (size_t)(r.comms_len[d] - j - 1) * sizeof *on);
                            r.comms_len[d]--;
                            break;
                        }
                    }
                }
                if (ph->last[t])
                    out->totals[4 * (int64_t)ph->cost_key[ph->cost[t]]] += now;
                int32_t rec = ph->record[t];
                out->start[rec] = s->start;
                out->end[rec] = now;
                out->solo[rec] = s->solo;
                out->exposed[rec] = s->exposed;
            } else {
                r.compute_on[ph->device[t]] = -1;
            }
            for (int32_t k = ph->dev_off[t]; k < ph->dev_off[t + 1]; k++)
                idset_add(&dirty, ph->dev_list[k]);
            r.head[q] = t + 1;
            idset_add(&woken, q);
            for (int32_t k = ph->wake_off[t]; k < ph->wake_off[t + 1]; k++)
                idset_add(&woken, ph->wake_list[k]);
            fresh(s);
            if (r.head[q] >= ph->queue_first[q + 1])
                live--;
        }
    }
    rc = LAGOM_SIM_OK;
out:
    out->now = now;
    out->exposed_total = exposed_total;
    if (r.head)
        memcpy(out->heads, r.head, (size_t)nq * sizeof *r.head);
    memo_free(&memo);
    free(heap.items);
    free(r.task_queue);
    free(r.head);
    free(r.state);
    free(r.compute_on);
    free(r.comms_on);
    free(r.comms_len);
    free(woken.ids);
    free(woken.in);
    free(dirty.ids);
    free(dirty.in);
    free(rate_dirty.ids);
    free(rate_dirty.in);
    free(finished);
    free(blockers);
    free(later);
    free(key);
    return rc;
}
