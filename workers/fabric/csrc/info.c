/* fi_getinfo with our hints, and a flat copy of each fi_info entry for Python. */

#include "pd_fabric.h"

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
