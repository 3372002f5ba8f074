/* Posting: a batch of writes, a send, a receive; each takes one operation slot. */

#include "slots.h"

int pd_post_writes(pd_engine *e, int n, const uint64_t *laddr, const uint64_t *lens,
                   void *desc, fi_addr_t dest, const uint64_t *raddr, uint64_t key,
                   int has_imm, uint64_t imm, uint64_t job, int *rc_out)
{
    int i;
    *rc_out = 0;
    for (i = 0; i < n; i++) {
        ssize_t rc;
        pd_slot *s = pd_slot_take(e, job, PD_SLOT_OP);
        if (!s) {
            *rc_out = -FI_EAGAIN;
            return i;
        }
        if (has_imm)
            rc = fi_writedata(e->ep, (void *)(uintptr_t)laddr[i], lens[i], desc, imm, dest,
                              raddr[i], key, s);
        else
            rc = fi_write(e->ep, (void *)(uintptr_t)laddr[i], lens[i], desc, dest, raddr[i],
                          key, s);
        if (rc) {
            pd_slot_put(e, s);
            *rc_out = (int)rc;
            return i;
        }
    }
    return n;
}

int pd_post_send(pd_engine *e, const void *buf, size_t len, void *desc, fi_addr_t dest,
                 uint64_t job)
{
    ssize_t rc;
    pd_slot *s = pd_slot_take(e, job, PD_SLOT_OP);
    if (!s) return -FI_EAGAIN;
    rc = fi_send(e->ep, buf, len, desc, dest, s);
    if (rc) pd_slot_put(e, s);
    return (int)rc;
}

int pd_post_recv(pd_engine *e, void *buf, size_t len, void *desc, uint64_t job)
{
    ssize_t rc;
    pd_slot *s = pd_slot_take(e, job, PD_SLOT_RECV);
    if (!s) return -FI_EAGAIN;
    rc = fi_recv(e->ep, buf, len, desc, FI_ADDR_UNSPEC, s);
    if (rc) pd_slot_put(e, s);
    return (int)rc;
}
