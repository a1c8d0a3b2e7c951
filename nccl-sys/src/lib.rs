//! NCCL, loaded at run time: hand-written `extern "C"` signatures of the functions epserve uses,
//! resolved into a table of function pointers. FFI only: no policy, no safe wrappers (those live
//! in the service crate). Building needs no NCCL; `Nccl::load` finds the library at run time.
#![allow(non_camel_case_types)]

pub mod ep;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

/// Opaque communicator handle.
pub type ncclComm_t = *mut c_void;
/// A `cudaStream_t`.
pub type cudaStream_t = *mut c_void;
/// A registered window (NCCL >= 2.27 symmetric memory).
pub type ncclWindow_t = *mut c_void;

/// `NCCL_UNIQUE_ID_BYTES` = 128.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; 128],
}

impl ncclUniqueId {
    pub fn as_bytes(&self) -> [u8; 128] {
        self.internal.map(|c| c as u8)
    }
    pub fn from_bytes(b: &[u8; 128]) -> Self {
        Self {
            internal: b.map(|c| c as c_char),
        }
    }
}

/// `ncclResult_t`.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ncclResult_t(pub c_int);

impl ncclResult_t {
    pub const SUCCESS: Self = Self(0);
    pub const UNHANDLED_CUDA_ERROR: Self = Self(1);
    pub const SYSTEM_ERROR: Self = Self(2);
    pub const INTERNAL_ERROR: Self = Self(3);
    pub const INVALID_ARGUMENT: Self = Self(4);
    pub const INVALID_USAGE: Self = Self(5);
    pub const REMOTE_ERROR: Self = Self(6);
    pub const IN_PROGRESS: Self = Self(7);

    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            _ => "ncclResult(unknown)",
        }
    }

    /// `Ok(())` for success, the code otherwise.
    pub fn ok(self) -> Result<(), Self> {
        if self == Self::SUCCESS {
            Ok(())
        } else {
            Err(self)
        }
    }
}

impl fmt::Debug for ncclResult_t {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Display for ncclResult_t {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for ncclResult_t {}

/// `ncclDataType_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclDataType_t {
    Int8 = 0,
    Uint8 = 1,
    Int32 = 2,
    Uint32 = 3,
    Int64 = 4,
    Uint64 = 5,
    Float16 = 6,
    Float32 = 7,
    Float64 = 8,
    Bfloat16 = 9,
    /// NCCL 2.24 and later.
    Float8e4m3 = 10,
}

/// `ncclRedOp_t` (the built-in ones).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclRedOp_t {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    Avg = 4,
}

/// The oldest NCCL epserve runs on: 2.19 (grouped send/recv in graphs, `ncclCommAbort` semantics).
pub const MIN_VERSION: c_int = 21900;
/// `ncclCommShrink`'s flags: the default (the parent is healthy and stays in use), and end the
/// parent's operations in flight first (their peer is gone).
pub const NCCL_SHRINK_DEFAULT: c_int = 0x00;
pub const NCCL_SHRINK_ABORT: c_int = 0x01;

/// `major.minor.patch` of an `ncclGetVersion` code (>= 2.9 encoding: major*10000 + minor*100 + patch).
pub fn version_string(code: c_int) -> String {
    format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
}

type Fn0 = unsafe extern "C" fn() -> ncclResult_t;

/// The resolved functions; `Option` marks symbols that older NCCLs lack.
pub struct Nccl {
    pub path: PathBuf,
    pub version: c_int,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t,
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t,
    pub comm_init_rank:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t,
    pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    pub comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t,
    pub get_error_string: unsafe extern "C" fn(ncclResult_t) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub group_start: Fn0,
    pub group_end: Fn0,
    /// NCCL >= 2.19.
    pub mem_alloc: Option<unsafe extern "C" fn(*mut *mut c_void, usize) -> ncclResult_t>,
    pub mem_free: Option<unsafe extern "C" fn(*mut c_void) -> ncclResult_t>,
    /// NCCL >= 2.27.
    pub comm_window_register: Option<
        unsafe extern "C" fn(
            ncclComm_t,
            *mut c_void,
            usize,
            *mut ncclWindow_t,
            c_int,
        ) -> ncclResult_t,
    >,
    pub comm_window_deregister:
        Option<unsafe extern "C" fn(ncclComm_t, ncclWindow_t) -> ncclResult_t>,
    /// `ncclCommShrink(comm, exclude, count, newcomm, config, flags)` (NCCL >= 2.27).
    pub comm_shrink: Option<
        unsafe extern "C" fn(
            ncclComm_t,
            *mut c_int,
            c_int,
            *mut ncclComm_t,
            *mut c_void,
            c_int,
        ) -> ncclResult_t,
    >,
    /// Keeps the code above mapped; dropped last.
    _lib: libloading::Library,
}

#[derive(Debug)]
pub enum LoadError {
    /// No candidate could be opened; every path tried, with why.
    NotFound(Vec<(String, String)>),
    MissingSymbol {
        path: PathBuf,
        symbol: &'static str,
    },
    TooOld {
        path: PathBuf,
        version: c_int,
    },
    Call {
        path: PathBuf,
        result: ncclResult_t,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound(tried) => {
                write!(
                    f,
                    "NCCL not found (set NCCL_LIBRARY, or pip install nvidia-nccl-cu13); tried:"
                )?;
                for (p, why) in tried {
                    write!(f, " {p} ({why});")?;
                }
                Ok(())
            }
            LoadError::MissingSymbol { path, symbol } => {
                write!(f, "{} lacks {symbol}", path.display())
            }
            LoadError::TooOld { path, version } => write!(
                f,
                "{} is NCCL {}; epserve needs {} or newer",
                path.display(),
                version_string(*version),
                version_string(MIN_VERSION)
            ),
            LoadError::Call { path, result } => {
                write!(f, "{}: ncclGetVersion failed: {result}", path.display())
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// Where to look, in order: `NCCL_LIBRARY`, the pip wheel (`nvidia/nccl/lib` under the active
/// virtualenv or a system site-packages), then the loader's search path (`libnccl.so.2`).
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("NCCL_LIBRARY") {
        out.push(PathBuf::from(p));
    }
    out.extend(site_packages_files("nvidia/nccl/lib/libnccl.so.2"));
    out.push(PathBuf::from("libnccl.so.2"));
    out
}

/// `rel` under every Python's site-/dist-packages that has it: the active virtualenv, the user's
/// ~/.local, /usr/local and /usr, newest Python first.
pub fn site_packages_files(rel: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v));
    }
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(Path::new(&h).join(".local"));
    }
    roots.extend(["/usr/local", "/usr"].map(PathBuf::from));
    for root in roots {
        let Ok(entries) = std::fs::read_dir(root.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons.into_iter().rev() {
            for pkgs in ["site-packages", "dist-packages"] {
                let lib = py.join(pkgs).join(rel);
                if lib.exists() {
                    out.push(lib);
                }
            }
        }
    }
    out
}

/// The first of `paths` the dynamic loader opens, or every path tried with why.
pub(crate) fn open_first(paths: Vec<PathBuf>) -> Result<(libloading::Library, PathBuf), LoadError> {
    let mut tried = Vec::new();
    for path in paths {
        // SAFETY: loading a library runs its initialisers; NCCL's and NCCL EP's only set up
        // their own state.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => return Ok((lib, path)),
            Err(e) => tried.push((path.display().to_string(), e.to_string())),
        }
    }
    Err(LoadError::NotFound(tried))
}

macro_rules! sym {
    ($lib:expr, $path:expr, $name:literal) => {
        // SAFETY: the symbol's C signature is the one declared on the field it is stored in
        // (nccl.h, stable since 2.x); the library outlives the pointer (both live in `Nccl`).
        *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| {
            LoadError::MissingSymbol {
                path: $path.clone(),
                symbol: $name,
            }
        })?
    };
}

macro_rules! opt_sym {
    ($lib:expr, $name:literal) => {
        // SAFETY: as in `sym!`; absent on older NCCLs, hence optional.
        unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
            .ok()
            .map(|s| *s)
    };
}

impl Nccl {
    /// Loads the first NCCL among `candidates()` and checks its version.
    pub fn load() -> Result<Self, LoadError> {
        let (lib, path) = open_first(candidates())?;
        Self::from_library(lib, path)
    }

    fn from_library(lib: libloading::Library, path: PathBuf) -> Result<Self, LoadError> {
        let get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t =
            sym!(lib, path, "ncclGetVersion");
        let mut version = 0;
        // SAFETY: `version` is a valid out-pointer for the call.
        let r = unsafe { get_version(&mut version) };
        if r != ncclResult_t::SUCCESS {
            return Err(LoadError::Call { path, result: r });
        }
        if version < MIN_VERSION {
            return Err(LoadError::TooOld { path, version });
        }
        Ok(Self {
            version,
            get_version,
            get_unique_id: sym!(lib, path, "ncclGetUniqueId"),
            comm_init_rank: sym!(lib, path, "ncclCommInitRank"),
            comm_destroy: sym!(lib, path, "ncclCommDestroy"),
            comm_abort: sym!(lib, path, "ncclCommAbort"),
            comm_get_async_error: sym!(lib, path, "ncclCommGetAsyncError"),
            get_error_string: sym!(lib, path, "ncclGetErrorString"),
            get_last_error: sym!(lib, path, "ncclGetLastError"),
            all_gather: sym!(lib, path, "ncclAllGather"),
            all_reduce: sym!(lib, path, "ncclAllReduce"),
            send: sym!(lib, path, "ncclSend"),
            recv: sym!(lib, path, "ncclRecv"),
            group_start: sym!(lib, path, "ncclGroupStart"),
            group_end: sym!(lib, path, "ncclGroupEnd"),
            mem_alloc: opt_sym!(lib, "ncclMemAlloc"),
            mem_free: opt_sym!(lib, "ncclMemFree"),
            comm_window_register: opt_sym!(lib, "ncclCommWindowRegister"),
            comm_window_deregister: opt_sym!(lib, "ncclCommWindowDeregister"),
            comm_shrink: opt_sym!(lib, "ncclCommShrink"),
            path,
            _lib: lib,
        })
    }

    /// NCCL's own text for a result code.
    pub fn error_string(&self, r: ncclResult_t) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string for any code.
        let p = unsafe { (self.get_error_string)(r) };
        if p.is_null() {
            return r.to_string();
        }
        // SAFETY: non-null, NUL-terminated, static (checked above / NCCL's contract).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abi_shapes() {
        assert_eq!(std::mem::size_of::<ncclUniqueId>(), 128);
        assert_eq!(
            std::mem::size_of::<ncclResult_t>(),
            std::mem::size_of::<c_int>()
        );
        assert_eq!(std::mem::size_of::<ncclDataType_t>(), 4);
        assert_eq!(ncclDataType_t::Bfloat16 as i32, 9);
        assert_eq!(ncclDataType_t::Float8e4m3 as i32, 10);
        assert_eq!(ncclRedOp_t::Avg as i32, 4);
        let id = ncclUniqueId::from_bytes(&[7u8; 128]);
        assert_eq!(id.as_bytes(), [7u8; 128]);
    }

    #[test]
    fn results_and_versions_read_well() {
        assert_eq!(ncclResult_t(5).to_string(), "ncclInvalidUsage (5)");
        assert!(ncclResult_t::SUCCESS.ok().is_ok());
        assert_eq!(
            ncclResult_t::REMOTE_ERROR.ok(),
            Err(ncclResult_t::REMOTE_ERROR)
        );
        assert_eq!(version_string(22803), "2.28.3");
        assert_eq!(version_string(MIN_VERSION), "2.19.0");
    }

    #[test]
    fn a_missing_library_names_every_path_tried() {
        let mut tried = Vec::new();
        // SAFETY: the path does not exist; nothing is loaded.
        if let Err(e) = unsafe { libloading::Library::new("/nonexistent/libnccl.so.2") } {
            tried.push(("/nonexistent/libnccl.so.2".to_string(), e.to_string()));
        }
        let msg = LoadError::NotFound(tried).to_string();
        assert!(
            msg.contains("/nonexistent/libnccl.so.2") && msg.contains("NCCL_LIBRARY"),
            "{msg}"
        );
        assert_eq!(candidates().last().unwrap(), Path::new("libnccl.so.2"));
    }
}
