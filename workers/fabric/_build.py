"""cffi API-mode build of the libfabric binding (`workers.fabric._fabric_cffi`).

The C side is deliberately small and flat: it owns the fid objects of one endpoint, a pool of
operation contexts, and three hot-path helpers (post a batch of writes, drain the completion
queue into arrays, wait for work) so that Python never loops per completion or per page.
Everything else (validation, descriptors, counters, callbacks) lives in Python.

Built by `pip install --no-build-isolation -e .` through `setup.py`'s `cffi_modules`, or in
place with `python workers/fabric/_build.py` (what `scripts/install.sh` runs as well, because an
editable install does not always leave the extension next to the sources).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cffi import FFI

MODULE_NAME = "workers.fabric._fabric_cffi"
ROOT = Path(__file__).resolve().parents[2]

# Plain C, valid in both the cdef and the compiled source.
SHARED_TYPES = r"""
typedef struct pd_engine pd_engine;

typedef struct {
    char prov_name[64];
    char fabric_name[128];
    char domain_name[128];
    uint64_t caps;
    uint64_t mode;
    uint64_t mr_mode;
    uint64_t cq_data_size;
    uint64_t max_msg_size;
    uint64_t inject_size;
    uint64_t mr_key_size;
    uint64_t tx_size;
    uint64_t rx_size;
    int ep_type;
    int data_progress;
    int threading;
    int has_nic;
    char nic_name[64];
    int bus_type;
    int pci_domain;
    int pci_bus;
    int pci_device;
    int pci_function;
    uint64_t link_speed;
    int link_state;
    char link_address[64];
} pd_info_t;

typedef struct {
    uint64_t id;
    uint64_t flags;
    uint64_t data;
    int err;
    int prov_errno;
    char msg[256];
} pd_error_t;

"""

CDEF = r"""
typedef uint64_t fi_addr_t;
struct fi_info;
struct fid_mr;
"""
CDEF += SHARED_TYPES
CDEF += r"""
#define PD_EV_LOCAL ...
#define PD_EV_RECV ...
#define PD_EV_IMM ...
#define PD_EV_IMM_RECV ...
#define PD_POLL_ERROR ...

#define FI_MR_LOCAL ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_MR_ENDPOINT ...
#define FI_MR_RAW ...
#define FI_MR_HMEM ...
#define FI_HMEM ...
#define FI_RMA_EVENT ...
#define FI_SOURCE ...
#define FI_RX_CQ_DATA ...
#define FI_CONTEXT ...
#define FI_CONTEXT2 ...
#define FI_EAGAIN ...
#define FI_ENODATA ...
#define FI_EAVAIL ...
#define FI_ECANCELED ...
#define FI_REMOTE_WRITE ...
#define FI_REMOTE_CQ_DATA ...
#define FI_WRITE ...
#define FI_READ ...
#define FI_SEND ...
#define FI_RECV ...
#define FI_BUS_PCI ...
#define FI_PROGRESS_AUTO ...
#define FI_PROGRESS_MANUAL ...
#define FI_THREAD_SAFE ...
#define FI_THREAD_DOMAIN ...

uint32_t fi_version(void);
const char *fi_strerror(int errnum);

int pd_getinfo(const char *prov, const char *node, const char *service, int want_hmem,
               struct fi_info **out);
int pd_info_count(struct fi_info *list);
int pd_info_describe(struct fi_info *list, int index, pd_info_t *out);
void pd_freeinfo(struct fi_info *list);

pd_engine *pd_engine_open(struct fi_info *list, int index, uint32_t num_slots,
                          char *err, size_t errlen);
int pd_engine_close(pd_engine *e);
int pd_engine_getname(pd_engine *e, void *buf, size_t *len);
uint64_t pd_engine_mr_mode(pd_engine *e);
uint32_t pd_engine_free_slots(pd_engine *e);
int pd_engine_wait_fd(pd_engine *e);

int pd_av_insert(pd_engine *e, const void *addr, fi_addr_t *out);
int pd_av_remove(pd_engine *e, fi_addr_t addr);
int pd_av_straddr(pd_engine *e, const void *addr, char *buf, size_t buflen);

int pd_mr_reg(pd_engine *e, void *buf, size_t len, uint64_t requested_key, int cuda_device,
              struct fid_mr **mr_out, uint64_t *key_out, void **desc_out);
int pd_mr_close(struct fid_mr *mr);

int pd_post_writes(pd_engine *e, int n, const uint64_t *laddr, const uint64_t *lens,
                   void *desc, fi_addr_t dest, const uint64_t *raddr, uint64_t key,
                   int has_imm, uint64_t imm, uint64_t job, int *rc_out);
int pd_post_send(pd_engine *e, const void *buf, size_t len, void *desc, fi_addr_t dest,
                 uint64_t job);
int pd_post_recv(pd_engine *e, void *buf, size_t len, void *desc, uint64_t job);

int pd_poll(pd_engine *e, int max, uint64_t *kinds, uint64_t *ids, uint64_t *data,
            uint64_t *lens, int spin_us, int wait_us, pd_error_t *err);
int pd_wake(pd_engine *e);
"""

C_SOURCE = r"""
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
"""
C_SOURCE += SHARED_TYPES
C_SOURCE += r"""

#define PD_FI_VERSION FI_VERSION(1, 17)
#define PD_EV_LOCAL 1    /* our write/send finished: ids = job id */
#define PD_EV_RECV 2     /* a posted receive got a message: ids = job id, lens = bytes */
#define PD_EV_IMM 3      /* remote write with immediate data landed here: data = imm */
#define PD_EV_IMM_RECV 4 /* same, but it consumed a posted receive (FI_RX_CQ_DATA mode) */
#define PD_POLL_ERROR (-1000000)

/* Every posted operation owns one slot; the slot begins with the provider's scratch space
 * so the pointer doubles as op_context for FI_CONTEXT / FI_CONTEXT2 providers. */
enum { PD_SLOT_FREE = 0, PD_SLOT_OP = 1, PD_SLOT_RECV = 2 };
typedef struct pd_slot {
    struct fi_context2 ctx;
    uint64_t job;
    uint32_t next_free;
    uint32_t state; /* PD_SLOT_*: a completion's context counts only while its slot is taken */
} pd_slot;

struct pd_engine {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    int wake_fd;
    int cq_fd;
    pd_slot *slots;
    uint32_t num_slots;
    uint32_t free_head;
    uint32_t free_count;
};

static const uint64_t PD_MR_MODES = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                    FI_MR_PROV_KEY | FI_MR_ENDPOINT;

int pd_getinfo(const char *prov, const char *node, const char *service, int want_hmem,
               struct fi_info **out)
{
    struct fi_info *hints = fi_dupinfo(NULL); /* fi_allocinfo is a macro over this */
    int rc;
    if (!hints) return -FI_ENOMEM;
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    if (want_hmem) hints->caps |= FI_HMEM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = PD_MR_MODES | (want_hmem ? FI_MR_HMEM : 0);
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
    /* fi_freeinfo frees prov_name, so it must be heap memory. */
    if (prov && *prov) hints->fabric_attr->prov_name = strdup(prov);
    rc = fi_getinfo(PD_FI_VERSION, node, service, node ? FI_SOURCE : 0, hints, out);
    fi_freeinfo(hints);
    return rc;
}

static struct fi_info *pd_info_nth(struct fi_info *list, int index)
{
    while (list && index-- > 0) list = list->next;
    return list;
}

int pd_info_count(struct fi_info *list)
{
    int n = 0;
    for (; list; list = list->next) n++;
    return n;
}

static void pd_copy(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

int pd_info_describe(struct fi_info *list, int index, pd_info_t *o)
{
    struct fi_info *i = pd_info_nth(list, index);
    if (!i) return -FI_EINVAL;
    memset(o, 0, sizeof(*o));
    pd_copy(o->prov_name, sizeof(o->prov_name), i->fabric_attr->prov_name);
    pd_copy(o->fabric_name, sizeof(o->fabric_name), i->fabric_attr->name);
    pd_copy(o->domain_name, sizeof(o->domain_name), i->domain_attr->name);
    o->caps = i->caps;
    o->mode = i->mode;
    o->mr_mode = (uint64_t)i->domain_attr->mr_mode;
    o->cq_data_size = i->domain_attr->cq_data_size;
    o->max_msg_size = i->ep_attr->max_msg_size;
    o->inject_size = i->tx_attr->inject_size;
    o->mr_key_size = i->domain_attr->mr_key_size;
    o->tx_size = i->tx_attr->size;
    o->rx_size = i->rx_attr->size;
    o->ep_type = i->ep_attr->type;
    o->data_progress = i->domain_attr->data_progress;
    o->threading = i->domain_attr->threading;
    if (i->nic) {
        o->has_nic = 1;
        if (i->nic->device_attr) pd_copy(o->nic_name, sizeof(o->nic_name), i->nic->device_attr->name);
        if (i->nic->bus_attr) {
            o->bus_type = i->nic->bus_attr->bus_type;
            if (i->nic->bus_attr->bus_type == FI_BUS_PCI) {
                o->pci_domain = i->nic->bus_attr->attr.pci.domain_id;
                o->pci_bus = i->nic->bus_attr->attr.pci.bus_id;
                o->pci_device = i->nic->bus_attr->attr.pci.device_id;
                o->pci_function = i->nic->bus_attr->attr.pci.function_id;
            }
        }
        if (i->nic->link_attr) {
            o->link_speed = i->nic->link_attr->speed;
            o->link_state = i->nic->link_attr->state;
            pd_copy(o->link_address, sizeof(o->link_address), i->nic->link_attr->address);
        }
    }
    return 0;
}

void pd_freeinfo(struct fi_info *list)
{
    if (list) fi_freeinfo(list);
}

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

/* cuda_device < 0: host memory; else memory of that CUDA device (the engine must have been
   opened with FI_HMEM; the provider then moves it with GPUDirect RDMA or CUDA IPC). */
int pd_mr_reg(pd_engine *e, void *buf, size_t len, uint64_t requested_key, int cuda_device,
              struct fid_mr **mr_out, uint64_t *key_out, void **desc_out)
{
    struct fid_mr *mr = NULL;
    struct iovec iov;
    struct fi_mr_attr attr;
    int rc;
    iov.iov_base = buf;
    iov.iov_len = len;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ;
    attr.requested_key = requested_key;
    attr.iface = FI_HMEM_SYSTEM;
    if (cuda_device >= 0) {
        if (!(e->info->caps & FI_HMEM)) return -FI_EOPNOTSUPP;
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = cuda_device;
    }
    rc = fi_mr_regattr(e->domain, &attr, 0, &mr);
    if (rc) return rc;
    if (e->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        rc = fi_mr_bind(mr, &e->ep->fid, 0);
        if (!rc) rc = fi_mr_enable(mr);
        if (rc) {
            fi_close(&mr->fid);
            return rc;
        }
    }
    *mr_out = mr;
    *key_out = fi_mr_key(mr);
    *desc_out = fi_mr_desc(mr);
    return 0;
}

int pd_mr_close(struct fid_mr *mr) { return fi_close(&mr->fid); }

static pd_slot *pd_slot_take(pd_engine *e, uint64_t job, uint32_t state)
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

static void pd_slot_put(pd_engine *e, pd_slot *s)
{
    s->state = PD_SLOT_FREE;
    s->next_free = e->free_head;
    e->free_head = (uint32_t)(s - e->slots);
    e->free_count++;
}

/* The taken slot a completion's context names, or NULL: a context that is not exactly one of
 * our slots, or a slot not in use, must neither count as an operation nor be freed twice. */
static pd_slot *pd_slot_of(pd_engine *e, void *ctx)
{
    uintptr_t p = (uintptr_t)ctx, base = (uintptr_t)e->slots;
    pd_slot *s;
    if (!ctx || p < base || p >= base + (uintptr_t)e->num_slots * sizeof(pd_slot)) return NULL;
    if ((p - base) % sizeof(pd_slot)) return NULL;
    s = (pd_slot *)ctx;
    return s->state == PD_SLOT_FREE ? NULL : s;
}

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

static int64_t pd_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* 1: an error entry was copied to *out; else fi_cq_readerr's failure (negative). */
static int pd_read_error(pd_engine *e, pd_error_t *out)
{
    struct fi_cq_err_entry ee;
    pd_slot *s;
    ssize_t rc;
    memset(&ee, 0, sizeof(ee));
    memset(out, 0, sizeof(*out));
    rc = fi_cq_readerr(e->cq, &ee, 0);
    if (rc != 1) return rc < 0 ? (int)rc : -FI_EOTHER;
    s = pd_slot_of(e, ee.op_context);
    if (s) {
        out->id = s->job;
        pd_slot_put(e, s);
    }
    out->flags = ee.flags;
    out->data = ee.data;
    out->err = ee.err;
    out->prov_errno = ee.prov_errno;
    snprintf(out->msg, sizeof(out->msg), "%s",
             fi_cq_strerror(e->cq, ee.prov_errno, ee.err_data, NULL, 0));
    return 1;
}

/* Drains up to `max` completions into the output arrays and returns the number of rows; a row
 * is a run of identical LOCAL (same job) or IMM (same data) events with its length in lens[],
 * or one RECV event with the received byte count in lens[].
 * Spins on the CQ (which also drives manual progress) for up to spin_us when empty; then, when
 * wait_us > 0, sleeps on the wake eventfd and the CQ fd (if any) for at most wait_us.
 * Returns PD_POLL_ERROR - rows when the drain stopped at an error entry (copied to *err). */
int pd_poll(pd_engine *e, int max, uint64_t *kinds, uint64_t *ids, uint64_t *data,
            uint64_t *lens, int spin_us, int wait_us, pd_error_t *err)
{
    struct fi_cq_data_entry buf[64];
    int rows = 0, waited = 0, total = 0;
    int64_t deadline = spin_us > 0 ? pd_now_us() + spin_us : 0;
    for (;;) {
        int want = max - rows < 64 ? max - rows : 64;
        ssize_t n = want > 0 ? fi_cq_read(e->cq, buf, (size_t)want) : 0;
        ssize_t k;
        if (n == -FI_EAVAIL) {
            int rc = pd_read_error(e, err);
            if (rc == 1) return PD_POLL_ERROR - rows;
            /* Retrying would spin here forever on -FI_EAVAIL: hand back the rows read so far,
             * and the failure itself when there are none (the next call gets there). An entry
             * not there yet (-FI_EAGAIN) is no failure: the caller polls again. */
            return rows > 0 || rc == -FI_EAGAIN ? rows : rc;
        }
        for (k = 0; k < n; k++) {
            pd_slot *s = pd_slot_of(e, buf[k].op_context);
            uint64_t f = buf[k].flags;
            int is_recv = s && s->state == PD_SLOT_RECV;
            /* Our sends never carry CQ data, so FI_REMOTE_CQ_DATA marks a landed write (remote
             * completion flags otherwise differ by provider) - unless the context is one of
             * our own writes or sends: reposting that slot as a receive would post at a wild
             * address, so such a completion stays local whatever its flags say. */
            if ((f & FI_REMOTE_CQ_DATA) && (!s || is_recv)) {
                kinds[rows] = is_recv ? PD_EV_IMM_RECV : PD_EV_IMM;
                data[rows] = buf[k].data;
            } else if (is_recv) {
                kinds[rows] = PD_EV_RECV;
                data[rows] = 0;
            } else {
                kinds[rows] = PD_EV_LOCAL;
                data[rows] = 0;
            }
            ids[rows] = s ? s->job : 0;
            lens[rows] = kinds[rows] == PD_EV_RECV ? buf[k].len : 1;
            if (s) pd_slot_put(e, s);
            /* Run-length merge: completions of one job (or one imm value) tend to be adjacent,
             * so Python handles one row per run, not one per completion. */
            if (rows > 0 && (kinds[rows] == PD_EV_LOCAL || kinds[rows] == PD_EV_IMM) &&
                kinds[rows - 1] == kinds[rows] && ids[rows - 1] == ids[rows] &&
                data[rows - 1] == data[rows]) {
                lens[rows - 1]++;
                continue;
            }
            rows++;
        }
        if (n > 0) total += (int)n;
        /* Bounded per call so the caller gets to post new work under a continuous stream. */
        if (rows >= max || total >= 4 * max || (n <= 0 && rows > 0)) return rows;
        if (n > 0) continue;
        if (n != -FI_EAGAIN) return (int)n;
        if (spin_us > 0 && pd_now_us() < deadline) {
            /* Two cores are shared by both pollers and the kernel's TCP work. */
            sched_yield();
            continue;
        }
        if (wait_us <= 0 || waited) return rows;
        {
            struct pollfd fds[2];
            struct fid *fids[1];
            int nfds = 1;
            uint64_t drained;
            fds[0].fd = e->wake_fd;
            fds[0].events = POLLIN;
            if (e->cq_fd >= 0) {
                fids[0] = &e->cq->fid;
                /* fi_trywait also drives progress; only block on the fd when it says so. */
                if (fi_trywait(e->fabric, fids, 1) != FI_SUCCESS) {
                    waited = 1;
                    continue;
                }
                fds[1].fd = e->cq_fd;
                fds[1].events = POLLIN;
                nfds = 2;
            }
            {
                struct timespec ts = {wait_us / 1000000, (long)(wait_us % 1000000) * 1000};
                (void)ppoll(fds, (nfds_t)nfds, &ts, NULL);
            }
            if (read(e->wake_fd, &drained, sizeof(drained)) < 0) { /* nothing to drain */ }
            waited = 1;
        }
    }
}

int pd_wake(pd_engine *e)
{
    uint64_t one = 1;
    return write(e->wake_fd, &one, sizeof(one)) == sizeof(one) ? 0 : -errno;
}
"""


def _include_dirs() -> list[str]:
    prefix = os.environ.get("LIBFABRIC_PREFIX")
    return [str(Path(prefix) / "include")] if prefix else []


def _library_dirs() -> list[str]:
    prefix = os.environ.get("LIBFABRIC_PREFIX")
    return [str(Path(prefix) / "lib")] if prefix else []


def _check_headers() -> None:
    candidates = [*_include_dirs(), "/usr/include", "/usr/local/include"]
    if not any((Path(d) / "rdma" / "fabric.h").is_file() for d in candidates):
        raise SystemExit(
            "error: libfabric headers (rdma/fabric.h) not found; install the apt package "
            "libfabric-dev (apt-get install libfabric-dev libfabric1), or set LIBFABRIC_PREFIX "
            "to a libfabric >= 1.17 install prefix"
        )


_check_headers()
ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    MODULE_NAME,
    C_SOURCE,
    libraries=["fabric"],
    include_dirs=_include_dirs(),
    library_dirs=_library_dirs(),
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)


def build_in_place() -> Path:
    """Compile the extension next to the sources (what an editable install imports).

    setuptools' editable install already builds it in place; this is the fallback that
    `scripts/install.sh` runs when the import still fails (other setuptools versions/modes).
    Stale copies with other ABI tags are removed first: the interpreter would prefer a
    `.cpython-*` one over a fresh `.abi3` one.
    """
    built = Path(ffibuilder.compile(tmpdir=str(ROOT / "build" / "cffi"), verbose=False))
    package_dir = ROOT / "workers" / "fabric"
    for stale in package_dir.glob("_fabric_cffi*.so"):
        stale.unlink()
    target = package_dir / built.name
    target.write_bytes(built.read_bytes())
    return target


if __name__ == "__main__":
    sys.stdout.write(f"built {build_in_place().relative_to(ROOT)}\n")
