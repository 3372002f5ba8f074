"""Typed view of the compiled binding `workers.fabric._fabric_cffi` (built by `_build.py`).

Kept by hand in step with `csrc/pd_api.cdef` (functions, constants) and `csrc/pd_types.h`
(structs): every function and constant there is declared here with the Python types cffi takes
and returns. cffi values are opaque `CData`; the subclasses below only say what a value may be
used for (indexed as integers, passed as a `pd_engine *`, ...), and are no runtime classes:
import them under `TYPE_CHECKING` only (through `workers.fabric._lib`).

`ffi.new` and `ffi.cast` are typed for the C declarations the package uses; another
declaration is a type error until it is added here.
"""

from typing import Generic, Literal, TypeVar, overload

class CData:
    """Any cffi value: pointer, array or struct (`ffi.NULL` is one)."""

_T = TypeVar("_T", bound=CData)

class IntPointer(CData):
    """``uint64_t *``, ``int *``, ``size_t *``, ``fi_addr_t *``: indexed as Python ints."""

    def __getitem__(self, index: int) -> int: ...
    def __setitem__(self, index: int, value: int) -> None: ...
    def __add__(self, offset: int) -> IntPointer: ...

class IntArray(IntPointer):
    """``uint64_t[n]``: a pointer that also knows its length."""

    def __len__(self) -> int: ...

class CharArray(CData):
    """``char[n]`` (or the bytes of a buffer, `ffi.from_buffer`)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> bytes: ...

class CInt(CData):
    """A C integer value (``ffi.cast("uintptr_t", ...)``)."""

    def __int__(self) -> int: ...

class PointerOut(CData, Generic[_T]):
    """``T **``: an out-parameter the C side stores one pointer into."""

    def __getitem__(self, index: int) -> _T: ...

class PdEngine(CData):
    """``pd_engine *``: one endpoint with its fids and operation slots."""

class FiInfo(CData):
    """``struct fi_info *``: a list returned by `pd_getinfo`."""

class FidMr(CData):
    """``struct fid_mr *``: a registered memory region."""

class PdInfo(CData):
    """``pd_info_t *``: one fi_info entry, flattened (`pd_info_describe`)."""

    prov_name: CharArray
    fabric_name: CharArray
    domain_name: CharArray
    caps: int
    mode: int
    mr_mode: int
    cq_data_size: int
    max_msg_size: int
    inject_size: int
    mr_key_size: int
    tx_size: int
    rx_size: int
    ep_type: int
    data_progress: int
    threading: int
    has_nic: int
    nic_name: CharArray
    bus_type: int
    pci_domain: int
    pci_bus: int
    pci_device: int
    pci_function: int
    link_speed: int
    link_state: int
    link_address: CharArray

class PdError(CData):
    """``pd_error_t *``: the error completion `pd_poll` stopped at."""

    id: int
    flags: int
    data: int
    err: int
    prov_errno: int
    msg: CharArray

class CBuffer:
    """`ffi.buffer`: the raw bytes behind a cdata."""

    def __bytes__(self) -> bytes: ...
    def __len__(self) -> int: ...

class _FFI:
    NULL: CData

    @overload
    def new(self, cdecl: Literal["char[]"], init: bytes | int) -> CharArray: ...
    @overload
    def new(self, cdecl: Literal["char[256]"], init: bytes = ...) -> CharArray: ...
    @overload
    def new(self, cdecl: Literal["uint64_t[]"], init: int | list[int]) -> IntArray: ...
    @overload
    def new(self, cdecl: Literal["uint64_t[3]"], init: list[int] = ...) -> IntArray: ...
    @overload
    def new(
        self, cdecl: Literal["int *", "size_t *", "uint64_t *", "fi_addr_t *"], init: int = ...
    ) -> IntPointer: ...
    @overload
    def new(self, cdecl: Literal["struct fi_info **"]) -> PointerOut[FiInfo]: ...
    @overload
    def new(self, cdecl: Literal["struct fid_mr **"]) -> PointerOut[FidMr]: ...
    @overload
    def new(self, cdecl: Literal["void **"]) -> PointerOut[CData]: ...
    @overload
    def new(self, cdecl: Literal["pd_info_t *"]) -> PdInfo: ...
    @overload
    def new(self, cdecl: Literal["pd_error_t *"]) -> PdError: ...
    @overload
    def cast(self, cdecl: Literal["void *"], value: int) -> CData: ...
    @overload
    def cast(self, cdecl: Literal["uintptr_t"], value: CData) -> CInt: ...
    @overload
    def cast(self, cdecl: Literal["uint64_t *"], value: CData) -> IntPointer: ...
    def string(self, cdata: CData, maxlen: int = ...) -> bytes: ...
    def buffer(self, cdata: CData, size: int = ...) -> CBuffer: ...
    def from_buffer(self, python_buffer: object, require_writable: bool = ...) -> CharArray: ...

class _Lib:
    PD_EV_LOCAL: int
    PD_EV_RECV: int
    PD_EV_IMM: int
    PD_EV_IMM_RECV: int
    PD_POLL_ERROR: int

    FI_MR_LOCAL: int
    FI_MR_VIRT_ADDR: int
    FI_MR_ALLOCATED: int
    FI_MR_PROV_KEY: int
    FI_MR_ENDPOINT: int
    FI_MR_RAW: int
    FI_MR_HMEM: int
    FI_HMEM: int
    FI_RMA_EVENT: int
    FI_SOURCE: int
    FI_RX_CQ_DATA: int
    FI_CONTEXT: int
    FI_CONTEXT2: int
    FI_EAGAIN: int
    FI_ENODATA: int
    FI_EAVAIL: int
    FI_ECANCELED: int
    FI_REMOTE_WRITE: int
    FI_REMOTE_CQ_DATA: int
    FI_WRITE: int
    FI_READ: int
    FI_SEND: int
    FI_RECV: int
    FI_BUS_PCI: int
    FI_PROGRESS_AUTO: int
    FI_PROGRESS_MANUAL: int
    FI_THREAD_SAFE: int
    FI_THREAD_DOMAIN: int

    def fi_version(self) -> int: ...
    def fi_strerror(self, errnum: int) -> CData: ...
    def pd_getinfo(
        self,
        prov: bytes | CData,
        node: bytes | CData,
        service: bytes | CData,
        want_hmem: int,
        out: PointerOut[FiInfo],
    ) -> int: ...
    def pd_info_count(self, info_list: FiInfo) -> int: ...
    def pd_info_describe(self, info_list: FiInfo, index: int, out: PdInfo) -> int: ...
    def pd_freeinfo(self, info_list: FiInfo) -> None: ...
    def pd_engine_open(
        self, info_list: FiInfo, index: int, num_slots: int, err: CharArray, errlen: int
    ) -> PdEngine: ...
    def pd_engine_close(self, e: PdEngine) -> int: ...
    def pd_engine_getname(self, e: PdEngine, buf: CharArray, len: IntPointer) -> int: ...
    def pd_engine_mr_mode(self, e: PdEngine) -> int: ...
    def pd_engine_free_slots(self, e: PdEngine) -> int: ...
    def pd_engine_wait_fd(self, e: PdEngine) -> int: ...
    def pd_engine_drop_wait_fd(self, e: PdEngine) -> None: ...
    def pd_av_insert(self, e: PdEngine, addr: CharArray, out: IntPointer) -> int: ...
    def pd_av_remove(self, e: PdEngine, addr: int) -> int: ...
    def pd_av_straddr(self, e: PdEngine, addr: CharArray, buf: CharArray, buflen: int) -> int: ...
    def pd_mr_reg(
        self,
        e: PdEngine,
        buf: CData,
        len: int,
        requested_key: int,
        cuda_device: int,
        mr_out: PointerOut[FidMr],
        key_out: IntPointer,
        desc_out: PointerOut[CData],
    ) -> int: ...
    def pd_mr_close(self, mr: FidMr) -> int: ...
    def pd_post_writes(
        self,
        e: PdEngine,
        n: int,
        laddr: IntPointer,
        lens: IntPointer,
        desc: CData,
        dest: int,
        raddr: IntPointer,
        key: int,
        has_imm: int,
        imm: int,
        job: int,
        rc_out: IntPointer,
    ) -> int: ...
    def pd_post_send(
        self, e: PdEngine, buf: CData, len: int, desc: CData, dest: int, job: int
    ) -> int: ...
    def pd_post_recv(self, e: PdEngine, buf: CData, len: int, desc: CData, job: int) -> int: ...
    def pd_poll(
        self,
        e: PdEngine,
        max: int,
        kinds: IntPointer,
        ids: IntPointer,
        data: IntPointer,
        lens: IntPointer,
        spin_us: int,
        wait_us: int,
        err: PdError,
    ) -> int: ...
    def pd_wake(self, e: PdEngine) -> int: ...

ffi: _FFI
lib: _Lib
