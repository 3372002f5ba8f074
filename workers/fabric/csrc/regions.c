/* Memory registration (host memory, or CUDA memory on an FI_HMEM engine). */

#include "pd_fabric.h"

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
