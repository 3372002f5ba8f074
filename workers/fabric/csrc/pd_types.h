/* The structs Python reads, as plain C: this file is both #included by pd_fabric.h (after
 * <stdint.h>) and read verbatim into the cffi cdef by _build.py, which parses no preprocessor
 * directives; hence no include guard or #include here. */

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
