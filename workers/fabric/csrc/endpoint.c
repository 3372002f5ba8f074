/* The fid objects of one endpoint: open, close, name, and its address vector. */

#include "slots.h"

/* Keeps the first failure in *first (a domain still holding a region answers -FI_EBUSY). */
static void pd_close_fid(struct fid *f, int *first)
{
    int rc = f ? fi_close(f) : 0;
    if (rc && !*first) *first = rc;
}

/* Returns 0, or the first fi_close failure (everything is closed and freed either way). */
int pd_engine_close(pd_engine *e)
{
    int first = 0;
    if (!e) return 0;
    /* Endpoint first: it stops traffic and flushes posted operations; then what it was bound
     * to. Registered regions are closed by the caller before this. */
    if (e->ep) pd_close_fid(&e->ep->fid, &first);
    if (e->av) pd_close_fid(&e->av->fid, &first);
    if (e->cq) pd_close_fid(&e->cq->fid, &first);
    if (e->domain) pd_close_fid(&e->domain->fid, &first);
    if (e->fabric) pd_close_fid(&e->fabric->fid, &first);
    if (e->info) fi_freeinfo(e->info);
    if (e->wake_fd >= 0) close(e->wake_fd);
    free(e->slots);
    free(e);
    return first;
}

#define PD_TRY(call, what)                                                                  \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_) {                                                                          \
            snprintf(err, errlen, "%s failed: %s (%d)", what, fi_strerror(-rc_), rc_);      \
            (void)pd_engine_close(e);                                                       \
            return NULL;                                                                    \
        }                                                                                   \
    } while (0)

pd_engine *pd_engine_open(struct fi_info *list, int index, uint32_t num_slots,
                          char *err, size_t errlen)
{
    struct fi_info *chosen = pd_info_nth(list, index);
    struct fi_cq_attr cq_attr;
    struct fi_av_attr av_attr;
    pd_engine *e;
    uint32_t s;
    if (!chosen) {
        snprintf(err, errlen, "no fi_info entry at index %d", index);
        return NULL;
    }
    e = calloc(1, sizeof(*e));
    if (!e) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    e->wake_fd = -1;
    e->cq_fd = -1;
    e->slots = calloc(num_slots, sizeof(pd_slot));
    e->info = fi_dupinfo(chosen);
    if (!e->slots || !e->info) {
        snprintf(err, errlen, "out of memory");
        pd_engine_close(e);
        return NULL;
    }
    e->num_slots = num_slots;
    for (s = 0; s < num_slots; s++) e->slots[s].next_free = s + 1;
    e->free_head = 0;
    e->free_count = num_slots;
    e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->wake_fd < 0) {
        snprintf(err, errlen, "eventfd failed: %s", strerror(errno));
        pd_engine_close(e);
        return NULL;
    }
    PD_TRY(fi_fabric(e->info->fabric_attr, &e->fabric, NULL), "fi_fabric");
    PD_TRY(fi_domain(e->fabric, e->info, &e->domain, NULL), "fi_domain");
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = e->info->tx_attr->size + e->info->rx_attr->size;
    /* A pollable fd lets the idle progress thread sleep until traffic arrives; providers that
     * cannot provide one fall back to timed sleeps (see pd_poll). */
    cq_attr.wait_obj = FI_WAIT_FD;
    if (fi_cq_open(e->domain, &cq_attr, &e->cq, NULL) == 0) {
        if (fi_control(&e->cq->fid, FI_GETWAIT, &e->cq_fd) != 0) e->cq_fd = -1;
    } else {
        e->cq = NULL;
        cq_attr.wait_obj = FI_WAIT_NONE;
        PD_TRY(fi_cq_open(e->domain, &cq_attr, &e->cq, NULL), "fi_cq_open");
    }
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    PD_TRY(fi_av_open(e->domain, &av_attr, &e->av, NULL), "fi_av_open");
    PD_TRY(fi_endpoint(e->domain, e->info, &e->ep, NULL), "fi_endpoint");
    PD_TRY(fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    PD_TRY(fi_ep_bind(e->ep, &e->av->fid, 0), "fi_ep_bind(av)");
    PD_TRY(fi_enable(e->ep), "fi_enable");
    return e;
}

int pd_engine_getname(pd_engine *e, void *buf, size_t *len)
{
    return fi_getname(&e->ep->fid, buf, len);
}

uint64_t pd_engine_mr_mode(pd_engine *e) { return (uint64_t)e->info->domain_attr->mr_mode; }
uint32_t pd_engine_free_slots(pd_engine *e) { return e->free_count; }
int pd_engine_wait_fd(pd_engine *e) { return e->cq_fd; }

/* Stop waiting on the CQ's fd: later waits are timed naps on the wake eventfd, as for a
 * provider without one. For an fd that stays readable with nothing to read (libfabric 1.17
 * tcp keeps a connection closed before its handshake in its poll set), which would turn every
 * wait into a spin. Progress thread only (pd_poll reads the field). */
void pd_engine_drop_wait_fd(pd_engine *e) { e->cq_fd = -1; }

int pd_av_insert(pd_engine *e, const void *addr, fi_addr_t *out)
{
    int n = fi_av_insert(e->av, addr, 1, out, 0, NULL);
    if (n == 1) return 0;
    return n < 0 ? n : -FI_EADDRNOTAVAIL;
}

/* fi_av(3): operations in progress that reference a removed address are undefined, so the
 * caller removes an address only once nothing posted to it is outstanding. */
int pd_av_remove(pd_engine *e, fi_addr_t addr)
{
    return fi_av_remove(e->av, &addr, 1, 0);
}

int pd_av_straddr(pd_engine *e, const void *addr, char *buf, size_t buflen)
{
    size_t len = buflen;
    const char *s = fi_av_straddr(e->av, addr, buf, &len);
    return s ? 0 : -FI_EINVAL;
}
