/* Internal header of the binding's C files: libfabric, the engine struct, and the constants
 * whose values Python reads through the cdef (pd_api.cdef). */
#ifndef PD_FABRIC_H
#define PD_FABRIC_H

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

#include "pd_types.h"

#define PD_FI_VERSION FI_VERSION(1, 17)
#define PD_EV_LOCAL 1    /* our write/send finished: ids = job id */
#define PD_EV_RECV 2     /* a posted receive got a message: ids = job id, lens = bytes */
#define PD_EV_IMM 3      /* remote write with immediate data landed here: data = imm */
#define PD_EV_IMM_RECV 4 /* same, but it consumed a posted receive (FI_RX_CQ_DATA mode) */
#define PD_POLL_ERROR (-1000000)

typedef struct pd_slot pd_slot; /* slots.h */

/* One endpoint and everything it is bound to. Tests read the first four pointers (info,
 * fabric, domain, cq) to reach the CQ: keep them first and in this order. */
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

/* The fi_info entry at `index` of `list` (NULL past its end). */
static inline struct fi_info *pd_info_nth(struct fi_info *list, int index)
{
    while (list && index-- > 0) list = list->next;
    return list;
}

#endif
