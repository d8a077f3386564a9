/* The ABI between lagom/model/compiled.py (ctypes) and the compiled event loop: one phase lowered to flat
 * arrays, a cost callback, and the results. Field order here is the order of compiled.py's Structures and its
 * TASK dtype. */
#ifndef LAGOM_EVENT_LOOP_H
#define LAGOM_EVENT_LOOP_H

#include <stdint.h>

#define LAGOM_EVENT_LOOP_ABI 4 /* bumped whenever a struct below changes */

enum { LAGOM_SIM_OK = 0, LAGOM_SIM_NOMEM = 1, LAGOM_SIM_CALLBACK = 2, LAGOM_SIM_DEADLOCK = 3, LAGOM_SIM_STALLED = 4,
       LAGOM_SIM_PAUSED = 5, LAGOM_SIM_CHECKPOINT = 6 };

/* What the callback is asked; the key holds (cost, util, share), (cost, duration) or (cost, then a
 * (comm cost, HBM rate) pair per collective running beside it). It returns NaN when Python failed. */
enum { LAGOM_COST_COMM = 0, LAGOM_COST_RATE = 1, LAGOM_COST_COMPUTE = 2 };
typedef double (*lagom_cost_fn)(int kind, int n, const double *key);

/* One task's fields together: the loop reads most of them at its start and at its end, and a task's fields in
 * one cache line cost one miss where a field per array cost one each (a phase's tasks run to millions, and a
 * step interleaves its queues). Its devices, dependencies and wakes are [off, off of the next task) in the lists. */
typedef struct {
    int32_t queue, device, cost, record; /* record: its slot in the results (comm tasks), else -1 */
    int32_t dev_off, dep_off, wake_off;
    uint8_t comm, first, last, unused;
} lagom_task_t;
_Static_assert(sizeof(lagom_task_t) == 32, "compiled.py's TASK dtype is 32 bytes");

typedef struct {
    int32_t n_tasks, n_queues, n_devices, n_blame;
    const int32_t *queue_first; /* n_queues + 1: a queue's tasks are [queue_first[q], queue_first[q + 1]) */
    const lagom_task_t *task;   /* n_tasks + 1: the last holds only the lists' lengths */
    const int32_t *dev_list;    /* the devices whose resources a task uses */
    const int32_t *dep_list;    /* the tasks it waits for, in lowering order */
    const int32_t *wake_list;   /* the queues whose heads may wait for it, besides its own */
    /* per cost: comm costs have a key, NIC use and launch wait; compute costs an HBM share */
    const int32_t *cost_key;
    const uint8_t *cost_cross, *cost_one_way;
    const double *cost_solo, *cost_launch, *cost_util;
    /* per device */
    const int32_t *compute_queue;          /* -1: a device without compute (a send's peer) */
    const int32_t *blame_device;           /* n_blame: devices whose idle compute is charged, in order */
    /* the pipeline's periodic band, for the period boundaries (lagom/model/lowering.py's Queue.shift, spans) */
    const int64_t *position;               /* per task: its position in the lowering */
    const int64_t *shift;                  /* per queue: positions per period (0: outside the band) */
    const int32_t *span_off;               /* n_queues + 1 offsets into span_lo/span_hi: a queue's spans */
    const int64_t *span_lo, *span_hi;      /* [lo, hi) positions mapped one period on */
} lagom_phase_t;

typedef struct {
    double now, exposed_total;
    int64_t tasks;    /* tasks started */
    double *totals;   /* per key: comm time, solo time, exposed time, count */
    int32_t *touched; /* per key: 1 + the order in which the run first touched it, or 0 */
    double *first_start; /* per key: when its first collective started (INFINITY: it has none) */
    double *start, *end, *solo, *exposed; /* per record */
    int32_t *heads;   /* per queue: the head when the run ended (where it stuck, on an error) */
} lagom_result_t;

int lagom_event_loop_abi(void); /* LAGOM_EVENT_LOOP_ABI as built: a library older than its Python side is not used */

/* One run of a phase, kept between calls (event_loop.c says what each call does). check: per task, 1 where
 * starting it is a period boundary of the band to pause at while watching (NULL: never pause); the run
 * pauses only where every band queue is inside one of its spans with a period left in it (a probe: at every
 * boundary). */
typedef struct lagom_sim lagom_sim_t;
lagom_sim_t *lagom_sim_open(const lagom_phase_t *phase, lagom_cost_fn cost, lagom_result_t *out, const uint8_t *check);
void lagom_sim_watch(lagom_sim_t *sim, int watching);
int lagom_sim_run(lagom_sim_t *sim); /* LAGOM_SIM_OK when the phase is done, LAGOM_SIM_PAUSED at a boundary */
void lagom_sim_state(const lagom_sim_t *sim, double *remaining, int64_t *seq);
int lagom_sim_jump(lagom_sim_t *sim, double later, double exposed, double delta, const int32_t *head,
                   const double *remaining);
lagom_sim_t *lagom_sim_probe(const lagom_sim_t *sim, lagom_result_t *out, const double *remaining);
void lagom_sim_close(lagom_sim_t *sim);

/* Checkpoints: a run told to keep them (every > 0) returns LAGOM_SIM_CHECKPOINT, once every `every` tasks
 * started while it watches no boundary, at the top of its loop; the caller saves the state there and calls run
 * again. A later run whose configs differ only in keys none of whose collectives had started by then resumes
 * from it: nothing before it can depend on those keys. The results' per-key sums are the caller's to keep
 * and hand back (they live in its arrays). */
typedef struct lagom_checkpoint lagom_checkpoint_t;
void lagom_sim_checkpoints(lagom_sim_t *sim, int64_t every);
lagom_checkpoint_t *lagom_sim_save(const lagom_sim_t *sim);
lagom_sim_t *lagom_sim_resume(const lagom_phase_t *phase, lagom_cost_fn cost, lagom_result_t *out, const uint8_t *check,
                              const lagom_checkpoint_t *from);
void lagom_checkpoint_free(lagom_checkpoint_t *checkpoint);

#endif
