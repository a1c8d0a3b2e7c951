//! NVIDIA NCCL EP (`libnccl_ep.so`, the `nccl-extensions` wheel), API version 2, hand-declared
//! from `nccl/ep/include/nccl_ep.h` and loaded at run time. Every public struct starts with
//! `size` and `magic` (the group config also with `version`); those fields are private here, so a
//! struct can only be made by its `new()`, which sets them as the header's `*_INIT` macros do (a
//! zeroed struct is rejected by the library, or worse, mis-sized). Tests pin every size and the
//! end of every frozen `Vn` boundary to the header's `*_Vn_SIZE` values.
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_ulong, c_void};
use std::path::PathBuf;

use crate::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclResult_t, ncclWindow_t, LoadError};

/// `NCCL_EP_API_VERSION`: the struct layouts below.
pub const API_VERSION: c_uint = 2;
/// `NCCL_EP_MAGIC`.
pub const MAGIC: c_uint = 0xC00F_FFEE;
/// `NCCL_EP_TENSOR_MAGIC` (a user-initialised tensor descriptor).
pub const TENSOR_MAGIC: c_uint = 0xCAFE_CAFE;
/// `NCCL_EP_AUTO`.
pub const AUTO: c_uint = 0;

macro_rules! c_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $x:expr),* $(,)? }) => {
        $(#[$m])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name(pub c_int);
        impl $name {
            $($(#[$vm])* pub const $v: Self = Self($x);)*
        }
    };
}

c_enum!(
    /// `ncclEpAlgorithm_t`.
    ncclEpAlgorithm_t { LOW_LATENCY = 0, HIGH_THROUGHPUT = 1 }
);
c_enum!(
    /// `ncclEpOverflowPolicy_t`.
    ncclEpOverflowPolicy_t { AUTO = 0, TRAP = 1, DROP = 2 }
);
c_enum!(
    /// `ncclEpLayout_t` (UNSET must be overridden before a handle is made).
    ncclEpLayout_t { UNSET = 0, EXPERT_MAJOR = 1, RANK_MAJOR = 2, FLAT = 3 }
);
c_enum!(
    /// `ncclEpPassDir_t`.
    ncclEpPassDir_t { FWD = 0, BWD = 1 }
);
c_enum!(
    /// `ncclEpZeroCopyMode_t`.
    ncclEpZeroCopyMode_t { AUTO = 0, OFF = 1, ON = 2 }
);
c_enum!(
    /// `ncclEpExpertIdKind_t`.
    ncclEpExpertIdKind_t { AUTO = 0, LOCAL = 1, GLOBAL = 2 }
);
c_enum!(
    /// `ncclEpDispQuant_t`.
    ncclEpDispQuant_t { NONE = 0, FWD = 1, DS_FP8E3M4 = 2 }
);
c_enum!(
    /// `ncclEpCombQuant_t`.
    ncclEpCombQuant_t { NONE = 0, NVFP4 = 1 }
);

/// Opaque `ncclEpGroup_t`.
pub type ncclEpGroup_t = *mut c_void;
/// Opaque `ncclEpHandle_t`.
pub type ncclEpHandle_t = *mut c_void;
/// `cudaError_t`.
pub type cudaError_t = c_int;
pub type ncclEpAllocFn_t = Option<
    unsafe extern "C" fn(ptr: *mut *mut c_void, size: usize, ctx: *mut c_void) -> cudaError_t,
>;
pub type ncclEpFreeFn_t =
    Option<unsafe extern "C" fn(ptr: *mut c_void, ctx: *mut c_void) -> cudaError_t>;

/// `ncclEpTensor_t`: a descriptor of caller-owned device memory (or a window range).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpTensor_t {
    size: c_uint,
    magic: c_uint,
    pub ndim: c_uint,
    pub datatype: ncclDataType_t,
    pub data: *mut c_void,
    pub win_hdl: ncclWindow_t,
    pub win_offset: u64,
    /// Caller-owned `[ndim]` extents; must outlive every call that sees the descriptor.
    pub sizes: *mut usize,
}

/// `ncclEpAllocConfig_t` (embedded in the group config; all-null = cudaMalloc/cudaFree).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpAllocConfig_t {
    pub alloc_fn: ncclEpAllocFn_t,
    pub free_fn: ncclEpFreeFn_t,
    pub context: *mut c_void,
}

/// `ncclEpGroupConfig_t` (V2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpGroupConfig_t {
    size: c_uint,
    magic: c_uint,
    version: c_uint,
    pub algorithm: ncclEpAlgorithm_t,
    pub num_experts: c_uint,
    pub max_dispatch_tokens_per_rank: c_uint,
    pub max_recv_tokens_per_rank: c_uint,
    pub max_token_bytes: c_uint,
    pub rdma_buffer_size: c_ulong,
    pub num_qp_per_rank: c_uint,
    pub num_channels: c_uint,
    pub max_num_sms: c_uint,
    pub alloc: ncclEpAllocConfig_t,
    pub enable_mask: c_uint,
    pub timeout_ns: u64,
    pub zero_copy: ncclEpZeroCopyMode_t,
    pub overflow_policy: ncclEpOverflowPolicy_t,
    pub num_topk: c_uint,
    padding_v2: [u8; 4],
}

/// `ncclEpTensorAllocConfig_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpTensorAllocConfig_t {
    size: c_uint,
    magic: c_uint,
}

/// `ncclEpLayoutInfo_t` (V2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpLayoutInfo_t {
    size: c_uint,
    magic: c_uint,
    pub expert_counters: *mut ncclEpTensor_t,
    pub src_rank_counters: *mut ncclEpTensor_t,
    pub expert_offsets: *mut ncclEpTensor_t,
    pub recv_total_counter: *mut ncclEpTensor_t,
    pub recv_topk_idx_kind: ncclEpExpertIdKind_t,
    padding_v2: [u8; 4],
}

/// `ncclEpDispatchInputs_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpDispatchInputs_t {
    size: c_uint,
    magic: c_uint,
    pub tokens: *mut ncclEpTensor_t,
    pub topk_weights: *mut ncclEpTensor_t,
    pub scales: *mut ncclEpTensor_t,
}

/// `ncclEpDispatchOutputs_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpDispatchOutputs_t {
    size: c_uint,
    magic: c_uint,
    pub tokens: *mut ncclEpTensor_t,
    pub topk_weights: *mut ncclEpTensor_t,
    pub scales: *mut ncclEpTensor_t,
    pub topk_idx: *mut ncclEpTensor_t,
}

/// `ncclEpCombineInputs_t` (V2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpCombineInputs_t {
    size: c_uint,
    magic: c_uint,
    pub tokens: *mut ncclEpTensor_t,
    pub topk_weights: *mut ncclEpTensor_t,
    pub scales: *mut ncclEpTensor_t,
}

/// `ncclEpCombineOutputs_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpCombineOutputs_t {
    size: c_uint,
    magic: c_uint,
    pub tokens: *mut ncclEpTensor_t,
    pub topk_weights: *mut ncclEpTensor_t,
}

/// `ncclEpHandleConfig_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpHandleConfig_t {
    size: c_uint,
    magic: c_uint,
    pub dispatch_output_per_expert_alignment: usize,
}

/// `ncclEpDispatchConfig_t` (V2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpDispatchConfig_t {
    size: c_uint,
    magic: c_uint,
    pub send_only: c_uint,
    pub round_scales: c_uint,
    pub pass_direction: ncclEpPassDir_t,
    pub quant_recipe: ncclEpDispQuant_t,
}

/// `ncclEpCombineConfig_t` (V2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpCombineConfig_t {
    size: c_uint,
    magic: c_uint,
    pub send_only: c_uint,
    pub pass_direction: ncclEpPassDir_t,
    pub quant_recipe: ncclEpCombQuant_t,
}

/// `ncclEpCompleteConfig_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEpCompleteConfig_t {
    size: c_uint,
    magic: c_uint,
}

/// Zero-filled, then `size` and `magic` set: the header's `NCCL_EP_STRUCT_INIT`.
macro_rules! init {
    ($t:ty, $magic:expr) => {
        impl $t {
            pub fn new() -> Self {
                // SAFETY: every field is an integer, a C-enum newtype, a raw pointer or an
                // Option of a function pointer, for all of which zero bits are valid (0 / null /
                // None), exactly what the C compound literal leaves in the unnamed fields.
                let mut s: Self = unsafe { std::mem::zeroed() };
                s.size = std::mem::size_of::<Self>() as c_uint;
                s.magic = $magic;
                s
            }
            /// The `size` field (what the library reads to know the caller's version).
            pub fn abi_size(&self) -> c_uint {
                self.size
            }
            pub fn abi_magic(&self) -> c_uint {
                self.magic
            }
        }
        impl Default for $t {
            fn default() -> Self {
                Self::new()
            }
        }
    };
}

init!(ncclEpTensor_t, TENSOR_MAGIC);
init!(ncclEpTensorAllocConfig_t, MAGIC);
init!(ncclEpLayoutInfo_t, MAGIC);
init!(ncclEpDispatchInputs_t, MAGIC);
init!(ncclEpDispatchOutputs_t, MAGIC);
init!(ncclEpCombineInputs_t, MAGIC);
init!(ncclEpCombineOutputs_t, MAGIC);
init!(ncclEpHandleConfig_t, MAGIC);
init!(ncclEpDispatchConfig_t, MAGIC);
init!(ncclEpCombineConfig_t, MAGIC);
init!(ncclEpCompleteConfig_t, MAGIC);

impl ncclEpTensor_t {
    /// A descriptor of device memory at `data` with extents `sizes` (caller-owned: they must
    /// outlive every call that sees the descriptor).
    pub fn describe(data: u64, datatype: ncclDataType_t, sizes: &mut [usize]) -> Self {
        let mut t = Self::new();
        t.ndim = sizes.len() as c_uint;
        t.datatype = datatype;
        t.data = data as *mut c_void;
        t.sizes = sizes.as_mut_ptr();
        t
    }

    /// A descriptor of a registered window from byte `offset` (no data pointer: the library
    /// resolves the window), with extents `sizes` (caller-owned, as for `describe`).
    pub fn in_window(
        win: ncclWindow_t,
        offset: u64,
        datatype: ncclDataType_t,
        sizes: &mut [usize],
    ) -> Self {
        let mut t = Self::describe(0, datatype, sizes);
        t.win_hdl = win;
        t.win_offset = offset;
        t
    }
}

impl ncclEpGroupConfig_t {
    /// `NCCL_EP_GROUP_CONFIG_INIT`: size, magic and the API version set, every knob zero (auto).
    pub fn new() -> Self {
        // SAFETY: as in `init!`: integers, C-enum newtypes, pointers and optional fn pointers.
        let mut s: Self = unsafe { std::mem::zeroed() };
        s.size = std::mem::size_of::<Self>() as c_uint;
        s.magic = MAGIC;
        s.version = API_VERSION;
        s
    }
    pub fn abi_size(&self) -> c_uint {
        self.size
    }
    pub fn abi_magic(&self) -> c_uint {
        self.magic
    }
    pub fn abi_version(&self) -> c_uint {
        self.version
    }
}

impl Default for ncclEpGroupConfig_t {
    fn default() -> Self {
        Self::new()
    }
}

/// The library's functions, resolved at load.
pub struct NcclEp {
    pub path: PathBuf,
    /// `NCCL_EP_VERSION_CODE`: major * 10000 + minor * 100 + patch.
    pub version: c_int,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t,
    pub tensor_alloc: unsafe extern "C" fn(
        *mut *mut ncclEpTensor_t,
        c_uint,
        ncclDataType_t,
        *const usize,
        *const ncclEpTensorAllocConfig_t,
    ) -> ncclResult_t,
    pub tensor_destroy: unsafe extern "C" fn(*mut ncclEpTensor_t) -> ncclResult_t,
    pub create_group: unsafe extern "C" fn(
        *mut ncclEpGroup_t,
        ncclComm_t,
        *const ncclEpGroupConfig_t,
    ) -> ncclResult_t,
    pub group_destroy: unsafe extern "C" fn(ncclEpGroup_t) -> ncclResult_t,
    pub handle_mem_size: unsafe extern "C" fn(
        ncclEpGroup_t,
        ncclEpLayout_t,
        *const ncclEpHandleConfig_t,
        *mut usize,
        c_int,
    ) -> ncclResult_t,
    pub init_handle: unsafe extern "C" fn(
        *mut ncclEpHandle_t,
        ncclEpGroup_t,
        ncclEpLayout_t,
        *const ncclEpHandleConfig_t,
        c_int,
        *const ncclEpTensor_t,
    ) -> ncclResult_t,
    pub update_handle: unsafe extern "C" fn(
        ncclEpHandle_t,
        *const ncclEpTensor_t,
        *const ncclEpLayoutInfo_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub create_handle: unsafe extern "C" fn(
        *mut ncclEpHandle_t,
        ncclEpGroup_t,
        ncclEpLayout_t,
        *const ncclEpTensor_t,
        *const ncclEpLayoutInfo_t,
        *const ncclEpHandleConfig_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub handle_destroy: unsafe extern "C" fn(ncclEpHandle_t) -> ncclResult_t,
    pub dispatch: unsafe extern "C" fn(
        ncclEpHandle_t,
        *const ncclEpDispatchInputs_t,
        *const ncclEpDispatchOutputs_t,
        *const ncclEpLayoutInfo_t,
        *const ncclEpDispatchConfig_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub combine: unsafe extern "C" fn(
        ncclEpHandle_t,
        *const ncclEpCombineInputs_t,
        *const ncclEpCombineOutputs_t,
        *const ncclEpCombineConfig_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub complete: unsafe extern "C" fn(
        ncclEpHandle_t,
        *const ncclEpCompleteConfig_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub mask_query: unsafe extern "C" fn(ncclEpGroup_t, *mut c_int, cudaStream_t) -> ncclResult_t,
    pub mask_update:
        unsafe extern "C" fn(ncclEpGroup_t, *const c_int, cudaStream_t) -> ncclResult_t,
    pub mask_clean: unsafe extern "C" fn(ncclEpGroup_t, cudaStream_t) -> ncclResult_t,
    pub get_async_error: unsafe extern "C" fn(ncclEpGroup_t, *mut c_int) -> ncclResult_t,
    pub error_clear: unsafe extern "C" fn(ncclEpGroup_t) -> ncclResult_t,
    _lib: libloading::Library,
}

/// Where `NcclEp::load` looks: `NCCL_EP_LIBRARY`, the pip wheel's `nccl/ep/lib/cu13`, then the
/// loader's search path.
pub fn candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::env::var_os("NCCL_EP_LIBRARY")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    out.extend(crate::site_packages_files("nccl/ep/lib/cu13/libnccl_ep.so"));
    out.push(PathBuf::from("libnccl_ep.so"));
    out
}

macro_rules! ep_sym {
    ($lib:expr, $path:expr, $name:literal) => {
        // SAFETY: the field's type is the C signature of `$name` in nccl_ep.h (API version 2);
        // the library outlives the pointer (both live in `NcclEp`).
        *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| {
            LoadError::MissingSymbol {
                path: $path.clone(),
                symbol: $name,
            }
        })?
    };
}

impl NcclEp {
    /// Loads the first library among `candidates()`. NCCL itself must be loadable by the
    /// dynamic loader (libnccl_ep links it), so load `Nccl` first from the same place.
    pub fn load() -> Result<Self, LoadError> {
        let (lib, path) = crate::open_first(candidates())?;
        Self::from_library(lib, path)
    }

    fn from_library(lib: libloading::Library, path: PathBuf) -> Result<Self, LoadError> {
        let get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t =
            ep_sym!(lib, path, "ncclEpGetVersion");
        let mut version = 0;
        // SAFETY: a valid out-pointer.
        let r = unsafe { get_version(&mut version) };
        if r != ncclResult_t::SUCCESS {
            return Err(LoadError::Call { path, result: r });
        }
        Ok(Self {
            version,
            get_version,
            tensor_alloc: ep_sym!(lib, path, "ncclEpTensorAlloc"),
            tensor_destroy: ep_sym!(lib, path, "ncclEpTensorDestroy"),
            create_group: ep_sym!(lib, path, "ncclEpCreateGroup"),
            group_destroy: ep_sym!(lib, path, "ncclEpGroupDestroy"),
            handle_mem_size: ep_sym!(lib, path, "ncclEpHandleMemSize"),
            init_handle: ep_sym!(lib, path, "ncclEpInitHandle"),
            update_handle: ep_sym!(lib, path, "ncclEpUpdateHandle"),
            create_handle: ep_sym!(lib, path, "ncclEpCreateHandle"),
            handle_destroy: ep_sym!(lib, path, "ncclEpHandleDestroy"),
            dispatch: ep_sym!(lib, path, "ncclEpDispatch"),
            combine: ep_sym!(lib, path, "ncclEpCombine"),
            complete: ep_sym!(lib, path, "ncclEpComplete"),
            mask_query: ep_sym!(lib, path, "ncclEpMaskQuery"),
            mask_update: ep_sym!(lib, path, "ncclEpMaskUpdate"),
            mask_clean: ep_sym!(lib, path, "ncclEpMaskClean"),
            get_async_error: ep_sym!(lib, path, "ncclEpGetAsyncError"),
            error_clear: ep_sym!(lib, path, "ncclEpErrorClear"),
            path,
            _lib: lib,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// End of a field: the header's `NCCL_EP_FIELD_END`, what each `_Vn_SIZE` is checked against.
    macro_rules! end {
        ($t:ty, $f:ident) => {{
            let t = <$t>::new();
            offset_of!($t, $f) + std::mem::size_of_val(&t.$f)
        }};
    }

    /// size first, magic right after: the header's `NCCL_EP_STATIC_ASSERT_STRUCT_ABI`.
    macro_rules! head {
        ($t:ty, $magic:expr) => {{
            assert_eq!(offset_of!($t, size), 0, stringify!($t));
            assert_eq!(offset_of!($t, magic), 4, stringify!($t));
            let t = <$t>::new();
            assert_eq!(t.abi_size() as usize, size_of::<$t>(), stringify!($t));
            assert_eq!(t.abi_magic(), $magic, stringify!($t));
        }};
    }

    #[test]
    fn struct_sizes_and_version_boundaries_match_the_header() {
        // (current size, and the end of each frozen Vn's last field) from nccl_ep.h, API v2.
        head!(ncclEpTensor_t, TENSOR_MAGIC);
        assert_eq!(size_of::<ncclEpTensor_t>(), 48);
        assert_eq!(end!(ncclEpTensor_t, sizes), 48);

        head!(ncclEpTensorAllocConfig_t, MAGIC);
        assert_eq!(size_of::<ncclEpTensorAllocConfig_t>(), 8);
        assert_eq!(end!(ncclEpTensorAllocConfig_t, magic), 8);

        head!(ncclEpGroupConfig_t, MAGIC);
        assert_eq!(size_of::<ncclEpGroupConfig_t>(), 112);
        assert_eq!(end!(ncclEpGroupConfig_t, timeout_ns), 96);
        assert_eq!(end!(ncclEpGroupConfig_t, padding_v2), 112);
        assert_eq!(offset_of!(ncclEpGroupConfig_t, version), 8);

        head!(ncclEpLayoutInfo_t, MAGIC);
        assert_eq!(size_of::<ncclEpLayoutInfo_t>(), 48);
        assert_eq!(end!(ncclEpLayoutInfo_t, recv_total_counter), 40);
        assert_eq!(end!(ncclEpLayoutInfo_t, padding_v2), 48);

        head!(ncclEpDispatchInputs_t, MAGIC);
        assert_eq!(size_of::<ncclEpDispatchInputs_t>(), 32);
        assert_eq!(end!(ncclEpDispatchInputs_t, scales), 32);

        head!(ncclEpDispatchOutputs_t, MAGIC);
        assert_eq!(size_of::<ncclEpDispatchOutputs_t>(), 40);
        assert_eq!(end!(ncclEpDispatchOutputs_t, topk_idx), 40);

        head!(ncclEpCombineInputs_t, MAGIC);
        assert_eq!(size_of::<ncclEpCombineInputs_t>(), 32);
        assert_eq!(end!(ncclEpCombineInputs_t, topk_weights), 24);
        assert_eq!(end!(ncclEpCombineInputs_t, scales), 32);

        head!(ncclEpCombineOutputs_t, MAGIC);
        assert_eq!(size_of::<ncclEpCombineOutputs_t>(), 24);
        assert_eq!(end!(ncclEpCombineOutputs_t, topk_weights), 24);

        head!(ncclEpHandleConfig_t, MAGIC);
        assert_eq!(size_of::<ncclEpHandleConfig_t>(), 16);
        assert_eq!(
            end!(ncclEpHandleConfig_t, dispatch_output_per_expert_alignment),
            16
        );

        head!(ncclEpDispatchConfig_t, MAGIC);
        assert_eq!(size_of::<ncclEpDispatchConfig_t>(), 24);
        assert_eq!(end!(ncclEpDispatchConfig_t, pass_direction), 20);
        assert_eq!(end!(ncclEpDispatchConfig_t, quant_recipe), 24);

        head!(ncclEpCombineConfig_t, MAGIC);
        assert_eq!(size_of::<ncclEpCombineConfig_t>(), 20);
        assert_eq!(end!(ncclEpCombineConfig_t, pass_direction), 16);
        assert_eq!(end!(ncclEpCombineConfig_t, quant_recipe), 20);

        head!(ncclEpCompleteConfig_t, MAGIC);
        assert_eq!(size_of::<ncclEpCompleteConfig_t>(), 8);
    }

    #[test]
    fn field_offsets_follow_the_c_layout() {
        // The group config has the only padding holes (before `alloc` and `timeout_ns`).
        let g = [
            (offset_of!(ncclEpGroupConfig_t, algorithm), 12),
            (offset_of!(ncclEpGroupConfig_t, num_experts), 16),
            (
                offset_of!(ncclEpGroupConfig_t, max_dispatch_tokens_per_rank),
                20,
            ),
            (
                offset_of!(ncclEpGroupConfig_t, max_recv_tokens_per_rank),
                24,
            ),
            (offset_of!(ncclEpGroupConfig_t, max_token_bytes), 28),
            (offset_of!(ncclEpGroupConfig_t, rdma_buffer_size), 32),
            (offset_of!(ncclEpGroupConfig_t, num_qp_per_rank), 40),
            (offset_of!(ncclEpGroupConfig_t, num_channels), 44),
            (offset_of!(ncclEpGroupConfig_t, max_num_sms), 48),
            (offset_of!(ncclEpGroupConfig_t, alloc), 56),
            (offset_of!(ncclEpGroupConfig_t, enable_mask), 80),
            (offset_of!(ncclEpGroupConfig_t, timeout_ns), 88),
            (offset_of!(ncclEpGroupConfig_t, zero_copy), 96),
            (offset_of!(ncclEpGroupConfig_t, overflow_policy), 100),
            (offset_of!(ncclEpGroupConfig_t, num_topk), 104),
        ];
        for (i, (got, want)) in g.into_iter().enumerate() {
            assert_eq!(got, want, "group config field {i}");
        }
        assert_eq!(size_of::<ncclEpAllocConfig_t>(), 24);
        let t = [
            (offset_of!(ncclEpTensor_t, ndim), 8),
            (offset_of!(ncclEpTensor_t, datatype), 12),
            (offset_of!(ncclEpTensor_t, data), 16),
            (offset_of!(ncclEpTensor_t, win_hdl), 24),
            (offset_of!(ncclEpTensor_t, win_offset), 32),
            (offset_of!(ncclEpTensor_t, sizes), 40),
        ];
        for (i, (got, want)) in t.into_iter().enumerate() {
            assert_eq!(got, want, "tensor field {i}");
        }
        assert_eq!(offset_of!(ncclEpLayoutInfo_t, recv_topk_idx_kind), 40);
        assert_eq!(offset_of!(ncclEpDispatchConfig_t, round_scales), 12);
    }

    #[test]
    fn constructors_set_the_service_fields_and_zero_the_rest() {
        let g = ncclEpGroupConfig_t::new();
        assert_eq!(
            (g.abi_size(), g.abi_magic(), g.abi_version()),
            (112, MAGIC, API_VERSION)
        );
        assert_eq!(g.algorithm, ncclEpAlgorithm_t::LOW_LATENCY);
        assert_eq!(g.num_experts, 0);
        assert_eq!(g.zero_copy, ncclEpZeroCopyMode_t::AUTO);
        assert!(g.alloc.alloc_fn.is_none() && g.alloc.context.is_null());
        let h = ncclEpHandleConfig_t::new();
        // A zeroed handle config would say size 0: the library then sizes handle memory wrongly.
        assert_eq!(h.abi_size(), 16);
        assert_eq!(h.dispatch_output_per_expert_alignment, 0);
        let t = ncclEpTensor_t::default();
        assert_eq!((t.abi_size(), t.abi_magic()), (48, TENSOR_MAGIC));
        assert!(t.data.is_null() && t.sizes.is_null() && t.ndim == 0);
    }

    #[test]
    fn a_described_tensor_keeps_the_service_fields() {
        let mut sizes = [7usize, 3];
        let t = ncclEpTensor_t::describe(0x1000, ncclDataType_t::Int32, &mut sizes);
        assert_eq!((t.abi_size(), t.abi_magic()), (48, TENSOR_MAGIC));
        assert_eq!((t.ndim, t.data as u64), (2, 0x1000));
        assert_eq!(t.datatype, ncclDataType_t::Int32);
        assert_eq!(t.sizes, sizes.as_mut_ptr());
    }

    #[test]
    fn a_window_tensor_names_the_window_not_a_pointer() {
        let mut sizes = [5usize];
        let win = 0x2000 as ncclWindow_t;
        let t = ncclEpTensor_t::in_window(win, 64, ncclDataType_t::Bfloat16, &mut sizes);
        assert_eq!((t.abi_size(), t.abi_magic()), (48, TENSOR_MAGIC));
        assert!(t.data.is_null());
        assert_eq!((t.win_hdl, t.win_offset, t.ndim), (win, 64, 1));
    }

    #[test]
    fn loading_a_missing_library_lists_where_it_looked() {
        std::env::set_var("NCCL_EP_LIBRARY", "/nonexistent/libnccl_ep.so");
        match NcclEp::load() {
            Err(LoadError::NotFound(tried)) => {
                assert!(tried.iter().any(|(p, _)| p == "/nonexistent/libnccl_ep.so"));
                assert!(tried.iter().any(|(p, _)| p == "libnccl_ep.so"));
            }
            Err(e) => panic!("unexpected error {e}"),
            // Installed on this machine (a GPU host with the wheel): found past the bad path.
            Ok(l) => assert_ne!(l.path, PathBuf::from("/nonexistent/libnccl_ep.so")),
        }
    }
}
