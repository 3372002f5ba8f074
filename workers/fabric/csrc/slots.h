/* The engine's pool of operation contexts (a free list over `pd_engine.slots`), shared by the
 * posting (post.c) and completion (poll.c) paths. Inline: pd_poll frees one slot per
 * completion. */
#ifndef PD_SLOTS_H
#define PD_SLOTS_H

#include "pd_fabric.h"

/* Every posted operation owns one slot; the slot begins with the provider's scratch space
 * so the pointer doubles as op_context for FI_CONTEXT / FI_CONTEXT2 providers. */
enum { PD_SLOT_FREE = 0, PD_SLOT_OP = 1, PD_SLOT_RECV = 2 };
struct pd_slot {
    struct fi_context2 ctx;
    uint64_t job;
    uint32_t next_free;
    uint32_t state; /* PD_SLOT_*: a completion's context counts only while its slot is taken */
};

static inline pd_slot *pd_slot_take(pd_engine *e, uint64_t job, uint32_t state)
{
    pd_slot *s;
    if (e->free_count == 0) return NULL;
    s = &e->slots[e->free_head];
    e->free_head = s->next_free;
    e->free_count--;
    s->job = job;
    s->state = state;
    return s;
}

static inline void pd_slot_put(pd_engine *e, pd_slot *s)
{
    s->state = PD_SLOT_FREE;
    s->next_free = e->free_head;
    e->free_head = (uint32_t)(s - e->slots);
    e->free_count++;
}

/* The taken slot a completion's context names, or NULL: a context that is not exactly one of
 * our slots, or a slot not in use, must neither count as an operation nor be freed twice. */
static inline pd_slot *pd_slot_of(pd_engine *e, void *ctx)
{
    uintptr_t p = (uintptr_t)ctx, base = (uintptr_t)e->slots;
    pd_slot *s;
    if (!ctx || p < base || p >= base + (uintptr_t)e->num_slots * sizeof(pd_slot)) return NULL;
    if ((p - base) % sizeof(pd_slot)) return NULL;
    s = (pd_slot *)ctx;
    return s->state == PD_SLOT_FREE ? NULL : s;
}

#endif
