//! Which kernels run the experts, chosen from the step's shape alone (the expert dtype, the
//! bucket, the rows' layout), so every rank chooses alike: once per (bucket, row format), kept
//! for the step's life (`Choices`). The FP8 weights' GEMM instance is chosen with their shape
//! when they are made (`kernels::fp8::Fp8Weights::new`). The choices follow measurements:
//! docs/benchmarks.md ("Where the decode GEMM stops paying", the shared expert on cuBLAS at
//! decode).

use std::collections::HashMap;

use crate::backend::cuda::exchange::ExpertRows;
use crate::backend::cuda::kernels::decode_gemm::DecodeGemm;
use crate::backend::cuda::kernels::hopper::{Hopper, Layout};
use crate::backend::cuda::shape::StepShape;
use crate::model::ExpertDtype;

/// How the exchange leaves the expert rows (`ExpertRows`' two forms).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowFormat {
    /// Contiguous blocks aligned to the Hopper GEMM's tile.
    Blocks,
    /// Expert e's rows from `e * stride`.
    Strided { stride: usize },
}

impl ExpertRows<'_> {
    pub fn format(&self) -> RowFormat {
        match self {
            ExpertRows::Blocks { .. } => RowFormat::Blocks,
            ExpertRows::Strided { stride, .. } => RowFormat::Strided { stride: *stride },
        }
    }
}

/// The kernels the routed experts run on, for one bucket and row format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    /// bf16 blocks: DeepGEMM's psum layout, SwiGLU between (a row's weight scales its
    /// activation: the down projection is linear).
    Psum,
    /// bf16 blocks the Hopper GEMM does not fit: the WMMA kernels over 64-row tiles, then each
    /// row's weight scales its output.
    BlockTiles,
    /// bf16 strides: decode's own GEMM (SwiGLU in its gate/up pass).
    Decode,
    /// bf16 strides: DeepGEMM's masked layout.
    Masked,
    /// bf16 strides neither fits: the WMMA kernels over the strides' tiles.
    StrideTiles,
    /// FP8: DeepGEMM's FP8 GEMM in the rows' layout, or decode's own FP8 GEMM (`decode`).
    Fp8 { decode: bool },
}

impl Routed {
    /// What runs `bucket` home tokens a rank, in `rows` (every choice is `s`'s to make: the same
    /// shape chooses the same kernels on every rank).
    pub fn choose(s: &StepShape, bucket: usize, rows: RowFormat) -> Self {
        let (groups, h, i) = (s.local(), s.hidden, s.inter);
        let mean_rows = mean_rows(s, bucket);
        if s.expert_dtype == ExpertDtype::Fp8 {
            let stride = match rows {
                RowFormat::Blocks => None,
                RowFormat::Strided { stride } => Some(stride),
            };
            let takes = |n, k| DecodeGemm::takes_fp8(mean_rows, stride, groups, n, k);
            return Routed::Fp8 {
                decode: takes(2 * i, h) && takes(h, i),
            };
        }
        let layout = match rows {
            RowFormat::Blocks => Layout::Psum,
            RowFormat::Strided { stride } => Layout::Masked { stride, mean_rows },
        };
        let both = |fits: fn(Layout, usize, usize, usize) -> bool| {
            fits(layout, groups, 2 * i, h) && fits(layout, groups, h, i)
        };
        let tile = both(Hopper::fits);
        match rows {
            RowFormat::Blocks if tile => Routed::Psum,
            RowFormat::Blocks => Routed::BlockTiles,
            // The decode GEMM where it is the faster kernel, and where DeepGEMM's tile does not
            // fit (a stride off its 64 rows): it beats the WMMA kernels from decode to 128 rows
            // per expert.
            RowFormat::Strided { .. }
                if both(DecodeGemm::takes) || (both(DecodeGemm::fits) && !tile) =>
            {
                Routed::Decode
            }
            RowFormat::Strided { .. } if tile => Routed::Masked,
            RowFormat::Strided { .. } => Routed::StrideTiles,
        }
    }
}

/// Rows an expert gets on average from a full bucket on every rank.
pub(super) fn mean_rows(s: &StepShape, bucket: usize) -> usize {
    (s.world * bucket * s.top_k).div_ceil(s.experts)
}

/// Buckets of at most this many rows run the shared expert on cuBLAS over the whole bucket: its
/// weights' read dominates, and one expert's block would give the grouped GEMM a few column
/// tiles and leave most SMs idle (at decode, 139 µs on DeepGEMM against 33 µs on cuBLAS:
/// docs/benchmarks.md). Past it compute dominates, the block has tiles for every SM, and the
/// grouped GEMM skips the bucket's padding rows, which cuBLAS would compute.
const SHARED_DENSE_ROWS: usize = 256;

/// The kernels the shared expert runs on, for one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    /// cuBLAS over the whole bucket.
    Dense,
    /// DeepGEMM, one psum block of the bucket's rows.
    Psum,
    /// DeepGEMM's FP8 GEMM, one psum block.
    Fp8,
}

impl Shared {
    pub fn choose(s: &StepShape, bucket: usize) -> Self {
        let (h, i) = (s.hidden, s.shared_inter);
        let psum = Layout::Psum;
        if s.expert_dtype == ExpertDtype::Fp8 {
            Shared::Fp8
        } else if bucket <= SHARED_DENSE_ROWS
            || !(Hopper::fits(psum, 1, 2 * i, h) && Hopper::fits(psum, 1, h, i))
        {
            Shared::Dense
        } else {
            Shared::Psum
        }
    }
}

/// Every choice made so far, by bucket (and row format): made on first use (the capture of that
/// bucket's graph), kept for the step's life.
#[derive(Default)]
pub struct Choices {
    routed: HashMap<(usize, RowFormat), Routed>,
    shared: HashMap<usize, Shared>,
}

impl Choices {
    pub fn routed(&mut self, s: &StepShape, bucket: usize, rows: RowFormat) -> Routed {
        *self.routed.entry((bucket, rows)).or_insert_with(|| {
            let k = Routed::choose(s, bucket, rows);
            tracing::debug!(bucket, ?rows, kernels = ?k, "routed experts' kernels");
            k
        })
    }

    pub fn shared(&mut self, s: &StepShape, bucket: usize) -> Shared {
        *self.shared.entry(bucket).or_insert_with(|| {
            let k = Shared::choose(s, bucket);
            tracing::debug!(bucket, kernels = ?k, "shared expert's kernels");
            k
        })
    }
}
