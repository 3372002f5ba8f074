/* Draining the completion queue into arrays, waiting for work, and waking the waiter. */

#include "slots.h"

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
