//! The Hopper expert GEMM: DeepGEMM's SM90 bf16 m-grouped kernels (TMA loads, WGMMA,
//! warp-specialised persistent CTAs), compiled ahead of time by build.rs from the pinned headers
//! (`kernels/hopper.cu`; which tiles: build.rs's `HOPPER_TILES`). Per-expert row counts stay on
//! the device, so a captured step graph stays valid whatever the routing.
//!
//! The TMA descriptors are encoded on the host at each launch from the buffers' addresses: a
//! step graph captures them once per bucket, and eager steps pay a few microseconds of host time.

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

/// One compiled instance: its symbol and the tile it was compiled for.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    /// Its name in build.rs's tables.
    pub(super) name: &'static str,
    pub(super) symbol: &'static str,
    pub(super) block_m: u32,
    pub(super) block_n: u32,
    pub(super) stages: u32,
    pub(super) math_threads: u32,
    /// CTAs a cluster (the weight tile's TMA multicast); 1: no clusters.
    pub(super) multicast: u32,
    /// Most experts a launch takes (`kNumGroups`).
    pub(super) groups: u32,
    /// N and K fixed at compile time; 0: given at launch.
    pub(super) shape: [u32; 2],
    /// Persistent CTAs (`kNumSMs`): the launch's grid.
    pub(super) ctas: u32,
}

impl Tile {
    /// Whether a launch of `groups` experts of `n x k` weights may run this instance. A tile
    /// whose weight tile multicasts over a cluster takes only N of whole clusters of column
    /// tiles: DeepGEMM's grouped schedulers pair a cluster's CTAs by block index, so an expert
    /// of an odd count of blocks pairs a CTA with the next expert's block or with none, and its
    /// stages wait for that peer for ever (Qwen3-30B-A3B's down projection, N 2,048 in 11 tiles
    /// of 192, hung FP8 steps of 2,048 tokens: docs/benchmarks.md, "Load balance", session 56).
    pub(super) fn takes(&self, groups: usize, n: usize, k: usize) -> bool {
        let fixed = |want: u32, got: usize| want == 0 || want as usize == got;
        let clusters = n.div_ceil(self.block_n as usize) % self.multicast as usize == 0;
        groups <= self.groups as usize
            && fixed(self.shape[0], n)
            && fixed(self.shape[1], k)
            && clusters
    }
}

mod tiles {
    use super::Tile;
    // GROUPS, then PSUM, PSUM_SHARE and MASKED: build.rs's HOPPER_TILES.
    include!(concat!(env!("OUT_DIR"), "/hopper_tiles.rs"));
}

/// `kernels/hopper.cu`, compiled for sm_90a.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/hopper_kernels.fatbin"));

/// The most experts one launch takes (the instances' `kNumGroups`); `layout` arrays have this
/// many entries.
pub const MAX_GROUPS: usize = tiles::GROUPS;
/// Row alignment of each expert's block in the psum layout (the psum instance's BLOCK_M).
pub const ALIGN: usize = tiles::PSUM.block_m as usize;
/// The K slice of one pipeline stage; K must be a multiple.
const BLOCK_K: usize = 64;
/// Columns of one TMA box under the 128-byte swizzle (64 bf16).
const SWIZZLE_COLS: u32 = 64;

/// Where each expert's rows are, with the device array (`MAX_GROUPS` ints) that says how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Expert e's rows are `[align(ends[e - 1], ALIGN), ends[e])`: the expert-major layout with
    /// `ALIGN`-row-aligned blocks; `ends` past the last expert repeat the padded total.
    Psum,
    /// Expert e's rows are `[e * stride, e * stride + counts[e])`; `counts` past the last expert
    /// are 0. `stride` is a multiple of the masked instance's row tile. `mean_rows`, the rows an
    /// expert gets on average, says whether decode's own GEMM takes it (`DecodeGemm::takes`).
    Masked { stride: usize, mean_rows: usize },
}

/// The SMs a psum GEMM launch takes: every one, or the fewer of its instance that leaves the
/// rest to an exchange's kernels running beside it (two-batch overlap, `step/split.rs`).
/// Masked launches take every SM either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sms {
    All,
    BesideExchange,
}

/// A compiled DeepGEMM instance ready to launch: its function (shared memory attribute set),
/// tile and launch shape. The bf16 and FP8 kernels differ only in how much shared memory a tile
/// takes.
pub(super) struct Instance {
    f: CudaFunction,
    pub(super) block_m: u32,
    pub(super) block_n: u32,
    threads: u32,
    smem: u32,
    cluster: u32,
    /// Its persistent CTAs: every launch's grid.
    pub(super) ctas: u32,
}

impl Instance {
    /// `t` from `m`, with `smem` bytes of dynamic shared memory.
    pub(super) fn load(
        m: &std::sync::Arc<cudarc::driver::CudaModule>,
        t: Tile,
        smem: u32,
    ) -> Result<Self, DriverError> {
        let f = m.load_function(t.symbol)?;
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        Ok(Self {
            f,
            block_m: t.block_m,
            block_n: t.block_n,
            threads: 128 + t.math_threads,
            smem,
            cluster: t.multicast,
            ctas: t.ctas,
        })
    }

    pub(super) fn function(&self) -> &CudaFunction {
        &self.f
    }

    /// One persistent CTA on each of its `ctas` SMs, for a launch without clusters.
    pub(super) fn config(&self) -> LaunchConfig {
        assert_eq!(
            self.cluster, 1,
            "an instance of clusters launches by `launch_clusters`"
        );
        LaunchConfig {
            grid_dim: (self.ctas, 1, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: self.smem,
        }
    }
}

impl Instance {
    /// Launches the instance on its `ctas` persistent CTAs (a multiple of its cluster) in
    /// clusters of its multicast width, which cudarc's launch cannot ask for; `params` point at
    /// each kernel argument's value, in order.
    ///
    /// # Safety
    /// `params` must match the kernel's parameters in number, order and type, and every buffer
    /// they name must span what the kernel reads and writes.
    pub(super) unsafe fn launch_clusters(
        &self,
        stream: &CudaStream,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), DriverError> {
        let ctas = self.ctas;
        assert_eq!(
            ctas % self.cluster,
            0,
            "{ctas} CTAs in clusters of {}",
            self.cluster
        );
        let mut value = sys::CUlaunchAttributeValue { pad: [0; 64] };
        value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
            x: self.cluster,
            y: 1,
            z: 1,
        };
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: ctas,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: self.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.smem,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        stream.context().bind_to_thread()?;
        // SAFETY: cfg and attr live across the call; the function is this instance's, loaded
        // with `smem` bytes allowed; the caller vouches for `params` (this function's contract).
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

/// Shared memory of a bf16 tile, as the kernel lays it out: D tile, then each stage's A and B
/// tiles, then two barriers (8 bytes each) per stage.
fn bf16_smem(t: &Tile) -> u32 {
    let d = (t.block_m * t.block_n * 2).next_multiple_of(1024);
    let stage = (t.block_m + t.block_n) * BLOCK_K as u32 * 2;
    d + t.stages * stage + t.stages * 16
}

pub struct Hopper {
    psum: Instance,
    /// psum on fewer CTAs, for experts that run beside the exchange (`Sms::BesideExchange`).
    psum_share: Instance,
    masked: Instance,
}

/// A CUDA tensor map, passed to the kernel by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(super) struct TensorMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte, 128-aligned value that the kernel takes as a `__grid_constant__`
// parameter; it holds no host pointer.
unsafe impl DeviceRepr for TensorMap {}

/// A 2-D bf16 tensor map of `outer` rows of `inner` elements at `base`, in boxes of
/// `SWIZZLE_COLS x box_rows` with the 128-byte swizzle; out-of-bounds loads read zeros and
/// out-of-bounds stores are dropped.
pub(super) fn tensor_map(
    base: u64,
    inner: usize,
    outer: usize,
    box_rows: u32,
) -> Result<TensorMap, DriverError> {
    tensor_map_2d(
        base,
        Elem::Bf16,
        [inner, outer],
        [SWIZZLE_COLS, box_rows],
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// What a tensor map's elements are.
#[derive(Clone, Copy)]
pub(super) enum Elem {
    Bf16,
    /// E4M3 bytes (TMA moves them as bytes).
    Fp8,
    F32,
}

/// A 2-D tensor map of `dims[1]` rows of `dims[0]` elements at `base` (rows packed), in boxes
/// of `boxes[0] x boxes[1]`; out-of-bounds loads read zeros and out-of-bounds stores are dropped.
pub(super) fn tensor_map_2d(
    base: u64,
    elem: Elem,
    dims: [usize; 2],
    boxes: [u32; 2],
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TensorMap, DriverError> {
    use sys::CUtensorMapDataType as T;
    let (dtype, bytes) = match elem {
        Elem::Bf16 => (T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
        Elem::Fp8 => (T::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
        Elem::F32 => (T::CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    };
    let dims_u64 = [dims[0] as u64, dims[1] as u64];
    let strides = [(dims[0] * bytes) as u64];
    let elems = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every array has the rank (2) entries the call reads, or rank - 1 for the strides;
    // `map` is written by the call before it is read.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            2,
            base as *mut std::ffi::c_void,
            dims_u64.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elems.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(TensorMap(map.assume_init()))
    }
}

/// One grouped GEMM: `y[rows of e] = x[rows of e] . w_e^T` for every expert e < `groups`.
pub struct Gemm<'a> {
    /// `[rows, k]`.
    pub x: &'a CudaSlice<bf16>,
    pub rows: usize,
    /// `[groups][n][k]` (nn.Linear weights, stacked).
    pub w: &'a CudaSlice<bf16>,
    pub groups: usize,
    pub n: usize,
    pub k: usize,
    pub layout: Layout,
    pub sms: Sms,
    /// `MAX_GROUPS` ints: `ends` (psum) or `counts` (masked).
    pub sizes: &'a CudaSlice<i32>,
}

impl Hopper {
    pub fn load(ctx: &std::sync::Arc<CudaContext>) -> Result<Self, DriverError> {
        let m = ctx.load_module(Ptx::from_binary(FATBIN.to_vec()))?;
        Ok(Self {
            psum: Instance::load(&m, tiles::PSUM, bf16_smem(&tiles::PSUM))?,
            psum_share: Instance::load(&m, tiles::PSUM_SHARE, bf16_smem(&tiles::PSUM_SHARE))?,
            masked: Instance::load(&m, tiles::MASKED, bf16_smem(&tiles::MASKED))?,
        })
    }

    /// Whether these kernels take a GEMM of this shape and layout (else the WMMA kernels do).
    pub fn fits(layout: Layout, groups: usize, n: usize, k: usize) -> bool {
        let layout_ok = match layout {
            Layout::Psum => true,
            Layout::Masked { stride, .. } => {
                stride > 0 && stride % tiles::MASKED.block_m as usize == 0
            }
        };
        layout_ok && groups <= MAX_GROUPS && k % BLOCK_K == 0 && n % 64 == 0
    }

    /// Launches `g` writing `y [rows, n]`; rows of an expert's last tile past its count are
    /// written too (with whatever its padding rows held), never another expert's rows.
    pub fn gemm(
        &self,
        g: Gemm,
        y: &mut CudaSlice<bf16>,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        assert!(
            Self::fits(g.layout, g.groups, g.n, g.k),
            "the Hopper GEMM does not take n {} k {} over {} groups in {:?}",
            g.n,
            g.k,
            g.groups,
            g.layout
        );
        assert!(
            g.x.len() >= g.rows * g.k
                && y.len() >= g.rows * g.n
                && g.w.len() >= g.groups * g.n * g.k
                && g.sizes.len() >= MAX_GROUPS,
            "Hopper GEMM operands smaller than their shapes"
        );
        let (inst, shape_m) = match g.layout {
            Layout::Psum if g.sms == Sms::BesideExchange => (&self.psum_share, 0),
            Layout::Psum => (&self.psum, 0),
            Layout::Masked { stride, .. } => {
                assert!(stride * g.groups <= g.rows, "masked rows past the buffer");
                (&self.masked, stride as u32)
            }
        };
        let a = tensor_map(g.x.device_ptr(stream).0, g.k, g.rows, inst.block_m)?;
        let b = tensor_map(g.w.device_ptr(stream).0, g.k, g.groups * g.n, inst.block_n)?;
        let d = tensor_map(y.device_ptr_mut(stream).0, g.n, g.rows, inst.block_m)?;
        let (n, k) = (g.n as u32, g.k as u32);
        let mut l = stream.launch_builder(inst.function());
        l.arg(g.sizes)
            .arg(&shape_m)
            .arg(&n)
            .arg(&k)
            .arg(&a)
            .arg(&b)
            .arg(&d);
        // SAFETY: the tensor maps span x (rows x k), w (groups x n x k) and y (rows x n), each
        // checked above; `sizes` holds MAX_GROUPS ints, as the instances read.
        unsafe { l.launch(inst.config()) }.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic;

    /// Which presets' FFNs (gate/up, then down) the Hopper kernels take, as the step decides it
    /// per layout over a 4-rank group; the rest run on the WMMA kernels.
    #[test]
    fn the_presets_that_fit_and_the_one_that_falls_back() {
        for (name, fits) in [
            ("deepseek-v3", true),
            ("qwen3-30b-a3b", true),
            ("mixtral-8x7b", true),
            ("tiny", true),
            ("tiny-deepseek", true),
            // intermediate 96: the down projection's K is not a multiple of 64.
            ("tiny-qwen3", false),
        ] {
            let s = synthetic::preset(name).unwrap();
            let (h, i, local) = (s.hidden, s.intermediate, s.num_experts / 4);
            for layout in [
                Layout::Psum,
                Layout::Masked {
                    stride: 512,
                    mean_rows: 16,
                },
            ] {
                let got =
                    Hopper::fits(layout, local, 2 * i, h) && Hopper::fits(layout, local, h, i);
                assert_eq!(got, fits, "{name} in {layout:?}");
            }
        }
    }

    #[test]
    fn limits_on_groups_and_the_masked_stride() {
        assert!(Hopper::fits(Layout::Psum, MAX_GROUPS, 256, 256));
        assert!(!Hopper::fits(Layout::Psum, MAX_GROUPS + 1, 256, 256));
        assert!(
            !Hopper::fits(Layout::Psum, 8, 256, 96),
            "K off the 64-deep stage"
        );
        assert!(
            !Hopper::fits(Layout::Psum, 8, 96, 256),
            "N off the 64-wide store box"
        );
        // The masked tile is 64 rows: a stride that is not a multiple would let an expert's last
        // tile write into the next expert's rows.
        let masked = |stride| Layout::Masked {
            stride,
            mean_rows: 16,
        };
        assert!(Hopper::fits(masked(128), 8, 256, 256));
        assert!(!Hopper::fits(masked(96), 8, 256, 256));
        assert!(!Hopper::fits(masked(32), 8, 256, 256));
        assert!(!Hopper::fits(masked(0), 8, 256, 256));
    }
}
