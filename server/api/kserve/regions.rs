//! Triton's system shared memory: a client registers a region of its POSIX shared-memory object
//! and requests name it for their inputs and outputs instead of carrying the bytes.
//!
//! Client shared memory is off unless `--allow-client-shm` (as Triton's, after CVE-2025-23319,
//! -23320 and -23334): any API client could otherwise register another process's object of the
//! service's user by name, read it through error messages and overwrite it with an output.
//! When on, what a client names is checked before it is used: the key is one POSIX name under
//! `--shm-regions-dir` starting with `--shm-regions-prefix` (no path, no link), a regular file
//! owned by the service's uid with no mode bit beyond `--shm-regions-mode`, and the region lies
//! inside it; each request's offset
//! and size lie inside the region. The object is read and written with `pread`/`pwrite` on the
//! descriptor opened at registration, not mapped: a client that truncates its object then gets
//! an error, where a mapping would take the server down with SIGBUS. The hidden states are read
//! straight into the step ring as their step is packed (and checked there, `sched::rows`); the
//! output and the small routing tensors go through the request (see `KserveApi::decode`).
//! A request holds its region (the descriptor) until answered, so unregistering one in use frees
//! nothing it still reads.
//!
//! CUDA shared memory (on the GPU backends): a client registers a raw CUDA IPC handle of its
//! device memory, opened once here by the backend's `OpenDevice` handed in at startup (the
//! handle's size and device checked) and
//! held by requests the same way. Its hidden states and output stay there: the GPU rank of this
//! process copies its rows device to device (`step::direct`); only other ranks' rows and the
//! small routing tensors cross the host. Both kinds share one namespace and
//! `--shm-regions-max`, as in Triton.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use clap::Args;
use tonic::Status;

use crate::infer::quote::quote;
use crate::inference::cuda_shared_memory_status_response::RegionStatus as CudaStatus;
use crate::inference::system_shared_memory_status_response::RegionStatus;
use crate::metric_names;
use crate::request::{ClientMemory, ClientSpan, Failure, OpenDevice};

#[derive(Args, Debug, Clone)]
pub struct RegionArgs {
    /// Serve KServe's system and CUDA shared-memory registration (off: every register call is
    /// refused with PERMISSION_DENIED).
    #[arg(long, env = "EPSERVE_ALLOW_CLIENT_SHM", default_value_t = false,
          action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
          default_missing_value = "true")]
    pub allow_client_shm: bool,
    /// The names (after the leading '/') a client's POSIX object must start with, e.g.
    /// `epserve-` (default: any name in --shm-regions-dir).
    #[arg(long, env = "EPSERVE_SHM_REGIONS_PREFIX", default_value = "")]
    pub shm_regions_prefix: String,
    /// Where clients' POSIX shared-memory objects are (shm_open's names are files here).
    #[arg(long, env = "EPSERVE_SHM_REGIONS_DIR", default_value = "/dev/shm")]
    pub shm_regions_dir: PathBuf,
    /// The widest mode a client's object may have (octal); the owner must be the service's uid.
    #[arg(long, env = "EPSERVE_SHM_REGIONS_MODE", default_value = "600", value_parser = octal)]
    pub shm_regions_mode: u32,
    /// Most regions registered at once (each holds one open file).
    #[arg(long, env = "EPSERVE_SHM_REGIONS_MAX", default_value_t = 256)]
    pub shm_regions_max: usize,
}

fn octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal mode (e.g. 600)"))
}

/// One registered region: `size` bytes from `offset` of the object behind `file`.
pub struct Region {
    pub name: String,
    size: u64,
    backing: Backing,
}

/// What a region is.
enum Backing {
    /// A POSIX object's `[offset, offset + size)`.
    File(Arc<FileRegion>),
    /// A client's CUDA allocation on device `device`.
    Device {
        mem: Arc<dyn ClientMemory>,
        device: u64,
    },
}

/// A POSIX object's part, read and written with `pread`/`pwrite` on the descriptor opened at
/// registration.
struct FileRegion {
    name: String,
    key: String,
    offset: u64,
    file: File,
}

impl FileRegion {
    fn failure(&self, doing: &str, e: std::io::Error) -> String {
        format!(
            "{doing} shared-memory region {} (key {}): {e} (was the object truncated?)",
            quote(&self.name),
            quote(&self.key)
        )
    }
}

impl ClientMemory for FileRegion {
    /// A short read (the client truncated its object) is an error, not a fault.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        self.file
            .read_exact_at(out, self.offset + offset)
            .map_err(|e| self.failure("reading", e))?;
        metrics::counter!(metric_names::SHM_BYTES_TOTAL, "direction" => "in")
            .increment(out.len() as u64);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.file
            .write_all_at(data, self.offset + offset)
            .map_err(|e| self.failure("writing", e))?;
        metrics::counter!(metric_names::SHM_BYTES_TOTAL, "direction" => "out")
            .increment(data.len() as u64);
        Ok(())
    }
}

/// The two kinds, as their calls name them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    System,
    Cuda,
}

impl Region {
    fn kind(&self) -> Kind {
        match self.backing {
            Backing::File(_) => Kind::System,
            Backing::Device { .. } => Kind::Cuda,
        }
    }
}

/// Where a tensor lies in a region, as a request's parameters give it.
pub struct Span {
    pub region: Arc<Region>,
    /// Within the region.
    pub offset: u64,
    pub len: usize,
}

impl Region {
    /// `len` bytes at `offset` within the region, checked against its bounds.
    pub fn span(self: &Arc<Self>, offset: u64, len: u64, what: &str) -> Result<Span, Failure> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(Span {
                region: self.clone(),
                offset,
                len: len as usize,
            }),
            _ => Err(Failure::invalid(format!(
                "{what}: shared_memory_offset {offset} + shared_memory_byte_size {len} lies \
                 outside region {} ({} bytes)",
                quote(&self.name),
                self.size
            ))),
        }
    }
}

impl Span {
    /// The span as the step path reads and writes it: holding it keeps the region's memory
    /// open after the region is unregistered.
    pub fn client(&self) -> ClientSpan {
        let mem: Arc<dyn ClientMemory> = match &self.region.backing {
            Backing::File(f) => f.clone(),
            Backing::Device { mem, .. } => mem.clone(),
        };
        ClientSpan {
            mem,
            offset: self.offset,
            len: self.len,
        }
    }

    /// Whether the span is a client's CUDA memory.
    pub fn on_device(&self) -> bool {
        matches!(self.region.backing, Backing::Device { .. })
    }

    /// Reads the span. A short read (the client truncated its object) is INVALID_ARGUMENT.
    pub fn read(&self) -> Result<Bytes, Failure> {
        let mut buf = vec![0u8; self.len];
        self.client()
            .read(&mut buf)
            .map_err(|e| match self.on_device() {
                true => Failure::invalid(format!(
                    "reading CUDA shared-memory region {}: {e}",
                    quote(&self.region.name)
                )),
                false => Failure::invalid(e),
            })?;
        if self.on_device() {
            metrics::counter!(metric_names::SHM_BYTES_TOTAL, "direction" => "in")
                .increment(self.len as u64);
        }
        Ok(buf.into())
    }
}

pub struct Regions {
    args: RegionArgs,
    map: Mutex<HashMap<String, Arc<Region>>>,
    /// What opens CUDA regions, or why they are not served here (the cpu backend, a build
    /// without CUDA).
    cuda: Result<Arc<dyn OpenDevice>, String>,
}

impl Regions {
    pub fn new(args: RegionArgs, cuda: Result<Arc<dyn OpenDevice>, String>) -> Self {
        Self {
            args,
            map: Mutex::new(HashMap::new()),
            cuda,
        }
    }

    /// Whether CUDA regions are served.
    pub fn cuda(&self) -> bool {
        self.cuda.is_ok()
    }

    /// Adds `region` under its name, unless the name is taken or the table full.
    fn insert(&self, region: Region) -> Result<(), Status> {
        let mut map = self.map();
        if map.contains_key(&region.name) {
            return Err(Status::already_exists(format!(
                "shared-memory region {} is already registered",
                quote(&region.name)
            )));
        }
        if map.len() >= self.args.shm_regions_max {
            return Err(Status::resource_exhausted(format!(
                "{} regions are registered, the most --shm-regions-max allows",
                map.len()
            )));
        }
        map.insert(region.name.clone(), Arc::new(region));
        Ok(())
    }

    /// A client's CUDA memory, from its raw IPC handle.
    pub fn register_cuda(
        &self,
        name: &str,
        handle: &[u8],
        device: i64,
        size: u64,
    ) -> Result<(), Status> {
        let opener = self.cuda.as_ref().map_err(|why| {
            Status::unavailable(format!(
                "CUDA shared memory is not served here ({why}): use system shared memory \
                 (SystemSharedMemoryRegister)"
            ))
        })?;
        self.allowed()?;
        Self::named(name, size)?;
        if self.map().contains_key(name) {
            return Err(Status::already_exists(format!(
                "shared-memory region {} is already registered",
                quote(name)
            )));
        }
        let mem = opener.open(handle, device, size).map_err(|e| {
            Status::invalid_argument(format!("CUDA shared-memory region {}: {e}", quote(name)))
        })?;
        self.insert(Region {
            name: name.into(),
            size,
            backing: Backing::Device {
                mem,
                // `open` checked it names a device here.
                device: device as u64,
            },
        })
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Region>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new region's name and size, checked.
    fn named(name: &str, size: u64) -> Result<(), Status> {
        if name.is_empty() {
            return Err(Status::invalid_argument("a region needs a name"));
        }
        if size == 0 {
            return Err(Status::invalid_argument(format!(
                "region {}: byte_size 0",
                quote(name)
            )));
        }
        Ok(())
    }

    /// PERMISSION_DENIED unless client shared memory is allowed.
    fn allowed(&self) -> Result<(), Status> {
        if self.args.allow_client_shm {
            return Ok(());
        }
        Err(Status::permission_denied(
            "client shared memory is off: start the service with --allow-client-shm \
             (EPSERVE_ALLOW_CLIENT_SHM=true) to register regions",
        ))
    }

    pub fn register(&self, name: &str, key: &str, offset: u64, size: u64) -> Result<(), Status> {
        self.allowed()?;
        Self::named(name, size)?;
        let file = self.open(key, offset, size)?;
        self.insert(Region {
            name: name.into(),
            size,
            backing: Backing::File(Arc::new(FileRegion {
                name: name.into(),
                key: key.into(),
                offset,
                file,
            })),
        })
    }

    /// The object behind `key`, checked: a POSIX name, a regular file of ours, no wider mode
    /// than accepted, and long enough.
    fn open(&self, key: &str, offset: u64, size: u64) -> Result<File, Status> {
        let bad_key = || {
            Status::invalid_argument(format!(
                "key {}: not a POSIX shared-memory name ('/' and 1 to 255 characters, no other \
                 '/')",
                quote(key)
            ))
        };
        let base = key.strip_prefix('/').ok_or_else(bad_key)?;
        if base.is_empty() || base.len() > 255 || base.contains('/') || base == "." || base == ".."
        {
            return Err(bad_key());
        }
        if !base.starts_with(&self.args.shm_regions_prefix) {
            return Err(Status::permission_denied(format!(
                "key {}: not under the names this service serves (--shm-regions-prefix {})",
                quote(key),
                quote(&self.args.shm_regions_prefix)
            )));
        }
        let path = self.args.shm_regions_dir.join(base);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| {
                let s = format!("key {} does not open: {e}", quote(key));
                match e.kind() {
                    std::io::ErrorKind::NotFound => Status::not_found(s),
                    std::io::ErrorKind::PermissionDenied => Status::permission_denied(s),
                    _ => Status::invalid_argument(s),
                }
            })?;
        let meta = file
            .metadata()
            .map_err(|e| Status::internal(format!("key {}: {e}", quote(key))))?;
        if !meta.file_type().is_file() {
            return Err(Status::invalid_argument(format!(
                "key {}: not a shared-memory object (a regular file)",
                quote(key)
            )));
        }
        let uid = nix::unistd::geteuid().as_raw();
        if meta.uid() != uid {
            return Err(Status::permission_denied(format!(
                "key {}: owned by uid {}, not the service's uid {uid}",
                quote(key),
                meta.uid()
            )));
        }
        let mode = meta.mode() & 0o777;
        if mode & !self.args.shm_regions_mode != 0 {
            return Err(Status::permission_denied(format!(
                "key {}: mode {mode:03o} is wider than the service accepts ({:03o}, \
                 --shm-regions-mode)",
                quote(key),
                self.args.shm_regions_mode
            )));
        }
        match offset.checked_add(size) {
            Some(end) if end <= meta.len() => Ok(file),
            _ => Err(Status::invalid_argument(format!(
                "key {}: offset {offset} + byte_size {size} exceeds the object's {} bytes",
                quote(key),
                meta.len()
            ))),
        }
    }

    /// Unregisters `name`, or every region for an empty name; requests that use a region keep
    /// it until they are answered. An unknown name is not an error (as in Triton).
    /// Unregisters the system region `name`, or every system region for an empty name.
    pub fn unregister(&self, name: &str) {
        self.unregister_kind(name, Kind::System)
    }

    /// Unregisters the CUDA region `name`, or every CUDA region for an empty name.
    pub fn unregister_cuda(&self, name: &str) {
        self.unregister_kind(name, Kind::Cuda)
    }

    /// A region of the other kind is left alone: each kind's calls see only their own.
    fn unregister_kind(&self, name: &str, kind: Kind) {
        let mut map = self.map();
        if name.is_empty() {
            map.retain(|_, r| r.kind() != kind);
        } else if map.get(name).is_some_and(|r| r.kind() == kind) {
            map.remove(name);
        }
    }

    /// The regions of `kind` as `status` gives them: `name`'s, or all for an empty name.
    fn listed<T>(
        &self,
        name: &str,
        kind: Kind,
        status: impl Fn(&Region) -> T,
    ) -> Result<HashMap<String, T>, Status> {
        let map = self.map();
        if name.is_empty() {
            return Ok(map
                .iter()
                .filter(|(_, r)| r.kind() == kind)
                .map(|(k, r)| (k.clone(), status(r)))
                .collect());
        }
        let what = if kind == Kind::Cuda { "CUDA " } else { "" };
        let r = map.get(name).filter(|r| r.kind() == kind).ok_or_else(|| {
            Status::not_found(format!(
                "no {what}shared-memory region {} is registered",
                quote(name)
            ))
        })?;
        Ok([(name.to_string(), status(r))].into())
    }

    /// The status of system region `name`, or of every one for an empty name.
    pub fn status(&self, name: &str) -> Result<HashMap<String, RegionStatus>, Status> {
        self.listed(name, Kind::System, |r| {
            let (key, offset) = match &r.backing {
                Backing::File(f) => (f.key.clone(), f.offset),
                Backing::Device { .. } => unreachable!("listed by kind"),
            };
            RegionStatus {
                name: r.name.clone(),
                key,
                offset,
                byte_size: r.size,
            }
        })
    }

    /// The status of CUDA region `name`, or of every one for an empty name.
    pub fn cuda_status(&self, name: &str) -> Result<HashMap<String, CudaStatus>, Status> {
        self.listed(name, Kind::Cuda, |r| CudaStatus {
            name: r.name.clone(),
            device_id: match &r.backing {
                Backing::Device { device, .. } => *device,
                Backing::File(_) => unreachable!("listed by kind"),
            },
            byte_size: r.size,
        })
    }

    /// The region a request names.
    pub fn get(&self, name: &str, what: &str) -> Result<Arc<Region>, Failure> {
        self.map().get(name).cloned().ok_or_else(|| {
            Failure::invalid(format!(
                "{what}: shared-memory region {} is not registered",
                quote(name)
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn regions_with(dir: &std::path::Path, allow: bool, prefix: &str) -> Regions {
        Regions::new(
            RegionArgs {
                allow_client_shm: allow,
                shm_regions_prefix: prefix.into(),
                shm_regions_dir: dir.into(),
                shm_regions_mode: 0o600,
                shm_regions_max: 2,
            },
            Err("a test".into()),
        )
    }

    fn regions(dir: &std::path::Path) -> Regions {
        regions_with(dir, true, "")
    }

    fn object(dir: &std::path::Path, name: &str, len: usize, mode: u32) {
        let p = dir.join(name);
        std::fs::write(&p, vec![7u8; len]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn what_a_client_names_is_checked_before_use() {
        let dir = std::env::temp_dir().join(format!("epserve-regions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        object(&dir, "a", 4096, 0o600);
        object(&dir, "wide", 4096, 0o666);
        std::os::unix::fs::symlink(dir.join("a"), dir.join("link")).unwrap();
        let code = |res: Result<(), Status>| res.unwrap_err().code();
        use tonic::Code;
        // Off by default: nothing registers, system or CUDA, whatever it names.
        let off = regions_with(&dir, false, "");
        let e = off.register("x", "/a", 0, 16).unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        assert!(e.message().contains("--allow-client-shm"), "{e:?}");
        // A prefix: only names under it.
        let prefixed = regions_with(&dir, true, "ep-");
        assert_eq!(
            code(prefixed.register("x", "/a", 0, 16)),
            Code::PermissionDenied
        );
        object(&dir, "ep-a", 4096, 0o600);
        prefixed.register("x", "/ep-a", 0, 16).unwrap();
        let r = regions(&dir);
        assert_eq!(code(r.register("x", "a", 0, 16)), Code::InvalidArgument);
        assert_eq!(code(r.register("x", "/../a", 0, 16)), Code::InvalidArgument);
        assert_eq!(code(r.register("x", "/", 0, 16)), Code::InvalidArgument);
        assert_eq!(code(r.register("x", "/missing", 0, 16)), Code::NotFound);
        assert_eq!(code(r.register("x", "/link", 0, 16)), Code::InvalidArgument);
        assert_eq!(
            code(r.register("x", "/wide", 0, 16)),
            Code::PermissionDenied
        );
        // Another uid's object (only root can make one here).
        if nix::unistd::geteuid().is_root() {
            object(&dir, "theirs", 4096, 0o600);
            std::os::unix::fs::chown(dir.join("theirs"), Some(65534), None).unwrap();
            let e = r.register("x", "/theirs", 0, 16).unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied);
            assert!(e.message().contains("not the service's uid"), "{e:?}");
        }
        assert_eq!(code(r.register("x", "/a", 4000, 97)), Code::InvalidArgument);
        assert_eq!(
            code(r.register("x", "/a", u64::MAX, 2)),
            Code::InvalidArgument
        );
        assert_eq!(code(r.register("x", "/a", 0, 0)), Code::InvalidArgument);
        assert_eq!(code(r.register("", "/a", 0, 16)), Code::InvalidArgument);
        r.register("x", "/a", 1024, 1024).unwrap();
        assert_eq!(code(r.register("x", "/a", 0, 16)), Code::AlreadyExists);
        r.register("y", "/a", 0, 16).unwrap();
        assert_eq!(code(r.register("z", "/a", 0, 16)), Code::ResourceExhausted);
        assert_eq!(r.status("").unwrap().len(), 2);
        assert_eq!(r.status("x").unwrap()["x"].offset, 1024);
        assert_eq!(r.status("nope").unwrap_err().code(), Code::NotFound);

        // Spans within the region only; reads and writes land at region offset + span offset.
        let x = r.get("x", "t").unwrap();
        assert!(x.span(1000, 24, "t").is_ok());
        assert!(x.span(1000, 25, "t").is_err());
        assert!(x.span(u64::MAX, 2, "t").is_err());
        let s = x.span(8, 4, "t").unwrap();
        s.client().write(&[1, 2, 3, 4]).unwrap();
        assert_eq!(&s.read().unwrap()[..], &[1, 2, 3, 4]);
        assert_eq!(
            &std::fs::read(dir.join("a")).unwrap()[1032..1036],
            &[1, 2, 3, 4]
        );

        // Unregistered while held: the holder still reads; a truncated object is an error.
        r.unregister("x");
        assert!(r.get("x", "t").is_err());
        assert_eq!(&s.read().unwrap()[..], &[1, 2, 3, 4]);
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("a"))
            .unwrap()
            .set_len(100)
            .unwrap();
        let e = s.read().unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        r.unregister("");
        assert!(r.status("").unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
