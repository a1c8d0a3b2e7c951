//! What sizes a rank's step: the model's shapes over the group, the buckets' row capacities
//! for each exchange, and the device bytes they take. Plain numbers: no device, no exchange.

use crate::backend::cuda::kernels::hopper;
use crate::backend::cuda::{max_tiles, GEMM_TILE, MAX_EXPERTS};
use crate::model::{fp8, ExpertDtype, MoeSpec};

/// Everything that sizes the step's buffers.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    pub world: usize,
    pub rank: usize,
    /// Expert slots over the group (the model's experts, plus any redundant ones): what the
    /// exchanges and the expert FFN address from the gate on (`placement`).
    pub experts: usize,
    /// The model's experts, which the router picks among.
    pub model_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub inter: usize,
    /// Intermediate size of the shared expert block (0 = none).
    pub shared_inter: usize,
    /// The largest bucket: most home tokens per rank.
    pub max_home: usize,
    /// The NCCL EP exchange, or (None) the NCCL slot exchange.
    pub ep: Option<EpShape>,
    /// bf16 experts, or FP8 (their rows quantized before each GEMM, into buffers of their own).
    pub expert_dtype: ExpertDtype,
    /// Buckets of at most this many home tokens run the FP8 shared expert on a stream of its own
    /// from the gate on, under the exchange (`--overlap`; `GpuStep::shared_ahead`); 0: none.
    pub overlap: usize,
    /// Buckets of at least this many home tokens run as two micro-batches, one's rows moving
    /// while the other's experts compute (`--two-batch`; `GpuStep::run_split`); usize::MAX:
    /// none.
    pub split: usize,
}

/// How the NCCL EP exchange is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpShape {
    /// HT per-expert row alignment (the grouped GEMM's tile).
    pub align: usize,
    /// Buckets up to this many home tokens per rank run low-latency (0: none).
    pub ll_max: usize,
    pub zero_copy: bool,
    /// LL kernels waiting this long for a peer mask it and end (NCCL EP's `enable_mask`): a
    /// group that goes on without a lost rank sets it (to `--step-timeout`); None: no mask.
    pub mask_after: Option<std::time::Duration>,
}

impl EpShape {
    /// The service's and the bench's layout: HT pads each expert's rows to the Hopper GEMM's
    /// row tile, so its psum layout reads NCCL EP's rows in place.
    pub fn new(ll_max: usize, zero_copy: bool) -> Self {
        Self {
            align: hopper::ALIGN,
            ll_max,
            zero_copy,
            mask_after: None,
        }
    }
}

/// The expert-parallel exchange's layout: every rank sends each peer one slot of `slot_rows` rows.
#[derive(Clone, Copy, Debug)]
pub struct Slots {
    pub world: usize,
    pub rank: usize,
    pub experts: usize,
    /// Experts per rank.
    pub local: usize,
    pub slot_rows: usize,
}

impl StepShape {
    pub fn new(spec: &MoeSpec, world: usize, rank: usize, max_home: usize) -> Self {
        Self {
            world,
            rank,
            experts: spec.num_experts,
            model_experts: spec.num_experts,
            top_k: spec.top_k,
            hidden: spec.hidden,
            inter: spec.intermediate,
            shared_inter: spec.shared_intermediate,
            max_home,
            ep: None,
            expert_dtype: ExpertDtype::Bf16,
            overlap: 0,
            split: usize::MAX,
        }
    }
    pub fn local(&self) -> usize {
        self.experts / self.world
    }
    /// Rows one rank's NCCL EP HT expert-major receive buffer needs: every source's tokens to
    /// each of its local experts (at most min(k, local) per token), plus per-expert padding to
    /// `align`.
    pub fn ht_capacity(&self, align: usize) -> usize {
        self.world * self.max_home * self.top_k.min(self.local()) + self.local() * (align - 1)
    }
    /// Rows of NCCL EP's LL expert-major output `[local][world * ll_max]`: its row-index space.
    pub fn ll_rows(&self, ll_max: usize) -> usize {
        self.local() * self.world * ll_max
    }
    /// Rows one source sends one peer at most: each token reaches at most min(k, local) of a
    /// peer's experts.
    pub fn slot_rows(&self, bucket: usize) -> usize {
        bucket * self.top_k.min(self.local())
    }
    /// Whether the exchange moves the expert rows as FP8 (codes and scales, quantized before they
    /// move) and the FFN takes them as they land: FP8 experts, on the slots, or on NCCL EP where
    /// a row's scales fill whole 16-byte units as its forward recipe asks (a hidden size that is
    /// a multiple of 512: DeepSeek-V3's 7,168, Qwen3-MoE's 2,048); narrower rows move as bf16
    /// and are quantized after the exchange.
    ///
    /// Not where NCCL EP masks a lost peer (`EpShape::mask_after`): its LL kernels forwarding
    /// FP8 did not end a step whose peer was killed (the DeepSeek-V3 layer on 2x H100: stuck
    /// 30 s, where bf16 rows' step ended at once; docs/benchmarks.md "Losing a rank"), so a
    /// group that goes on moves bf16 rows (twice the bytes) and quantizes them on arrival.
    pub fn fp8_dispatch(&self) -> bool {
        let scales_aligned = (self.hidden / fp8::BLOCK * 4) % 16 == 0;
        let masked = self.ep.is_some_and(|e| e.mask_after.is_some());
        self.expert_dtype == ExpertDtype::Fp8 && (self.ep.is_none() || scales_aligned && !masked)
    }

    /// Whether the slot exchange moves rows as FP8 (its codes, then its scales): FP8 experts on
    /// the `nccl` backend, the rows quantized as they are packed (NCCL EP forwards codes and
    /// scales quantized before its dispatch).
    pub fn fp8_slots(&self) -> bool {
        self.ep.is_none() && self.fp8_dispatch()
    }

    /// Bytes of one slot row on the wire: bf16 values, or with `fp8_slots` the row's E4M3 codes
    /// then one f32 scale per 128 channels, padded to 16 bytes (never more than the bf16 row,
    /// so the slots serve both trips).
    pub fn slot_row_bytes(&self) -> usize {
        let h = self.hidden;
        match self.fp8_slots() {
            true => h + (h / fp8::BLOCK * 4).next_multiple_of(16),
            false => 2 * h,
        }
    }

    pub fn slots(&self, bucket: usize) -> Slots {
        Slots {
            world: self.world,
            rank: self.rank,
            experts: self.experts,
            local: self.local(),
            slot_rows: self.slot_rows(bucket),
        }
    }
    /// Rows of the slot exchange's receive side: one slot from every source.
    pub fn slot_space(&self, bucket: usize) -> usize {
        self.world * self.slot_rows(bucket)
    }
    /// Expert-major rows the FFN reads: the slots' rows with each expert's block aligned to the
    /// Hopper GEMM's tile, or NCCL EP's expert-major row space for the bucket's mode (the same
    /// for every bucket of a mode: a group is sized once).
    pub fn recv_rows(&self, bucket: usize) -> usize {
        match self.ep {
            None => self.slot_space(bucket) + self.local() * (hopper::ALIGN - 1),
            Some(e) if bucket <= e.ll_max => self.ll_rows(e.ll_max),
            Some(e) => self.ht_capacity(e.align),
        }
    }

    /// The largest row space any bucket uses (what the FFN's row buffers must span).
    pub fn row_space(&self) -> usize {
        match self.ep {
            None => self.recv_rows(self.max_home),
            Some(e) => self.ep_rows(e).0.max(self.ep_rows(e).1),
        }
    }

    /// NCCL EP's expert rows: (LL, HT), 0 for a mode no bucket uses.
    fn ep_rows(&self, e: EpShape) -> (usize, usize) {
        let ll = match e.ll_max {
            0 => 0,
            t => self.ll_rows(t),
        };
        let ht = match self.max_home > e.ll_max {
            true => self.ht_capacity(e.align),
            false => 0,
        };
        (ll, ht)
    }

    /// What the kernels need of the model's shapes, as one readable refusal.
    pub fn check(&self) -> Result<(), String> {
        let mut bad = Vec::new();
        if self.hidden % GEMM_TILE != 0 {
            bad.push(format!(
                "hidden size {} is not a multiple of 64",
                self.hidden
            ));
        }
        for (what, i) in [
            ("intermediate", self.inter),
            ("shared intermediate", self.shared_inter),
        ] {
            if i % 32 != 0 {
                bad.push(format!("{what} size {i} is not a multiple of 32"));
            }
        }
        if self.experts > MAX_EXPERTS {
            bad.push(format!("{} experts (at most {MAX_EXPERTS})", self.experts));
        }
        if self.top_k > 32 {
            bad.push(format!("top-k {} (at most 32)", self.top_k));
        }
        if self.experts % self.world != 0 {
            bad.push(format!(
                "{} experts do not split over {} ranks",
                self.experts, self.world
            ));
        } else if self.local() > hopper::MAX_GROUPS {
            // The grouped GEMM's layouts and the exchanges' maps hold a rank's slots as groups.
            bad.push(format!(
                "{} expert slots a rank (at most {}): spread them over more ranks, or use fewer \
                 redundant experts",
                self.local(),
                hopper::MAX_GROUPS
            ));
        }
        if self.expert_dtype == ExpertDtype::Fp8 {
            for (what, n) in [
                ("hidden", self.hidden),
                ("intermediate", self.inter),
                ("shared intermediate", self.shared_inter),
            ] {
                if n % fp8::BLOCK != 0 {
                    bad.push(format!(
                        "FP8 experts: {what} size {n} is not a multiple of 128"
                    ));
                }
            }
            // NCCL EP's low-latency rows: each expert's block is world x ll_max rows.
            if let Some(e) = self.ep.filter(|e| e.ll_max > 0) {
                let stride = self.world * e.ll_max;
                if stride % crate::backend::cuda::kernels::fp8::MASKED_ROWS != 0 {
                    bad.push(format!(
                        "FP8 experts: NCCL EP low-latency blocks of {stride} rows are not a multiple of {}",
                        crate::backend::cuda::kernels::fp8::MASKED_ROWS
                    ));
                }
            }
        }
        match bad.is_empty() {
            true => Ok(()),
            false => Err(format!(
                "the GPU kernels cannot run this model: {}",
                bad.join("; ")
            )),
        }
    }

    /// Device bytes of the step buffers (weights not included).
    pub fn buffer_bytes(&self) -> usize {
        let (t, h, k, e, w) = (
            self.max_home,
            self.hidden,
            self.top_k,
            self.experts,
            self.world,
        );
        let rows = self.row_space();
        // Slot send and receive buffers beside the expert rows, or NCCL EP's expert rows (one
        // buffer per mode in use).
        let expert_rows = match self.ep {
            None => 2 * self.slot_space(t) + rows,
            Some(e) => self.ep_rows(e).0 + self.ep_rows(e).1,
        };
        let (i, si) = (self.inter, self.shared_inter);
        let ints =
            3 + t * k * 4 + 2 * e + 1 + w * e + rows + self.local() + 3 + 2 * hopper::MAX_GROUPS;
        let tiles = 2 * (max_tiles(rows, self.local()) + max_tiles(t, 1)) + 2;
        t * h * 4 * 2                       // x, out
            + t * e * 4 + t * k * 4         // logits, weights
            + t * h * 2 + t * h * 4 * 2     // xb, inbox, outbox
            + expert_rows * h * 2           // send, recv, expert rows
            + rows * 3 * i * 2              // gate/up, act
            + t * (3 * si + h) * 2          // shared expert
            + (ints + tiles) * 4
            + self.fp8_bytes()
    }

    /// FP8 experts' quantized rows: the expert rows and their activations, the shared expert's
    /// home rows and its activations, each with one f32 scale per 128 values (rows rounded up
    /// to 4): `cuda::kernels::fp8::Fp8Rows`.
    pub fn fp8_rows(&self) -> [(usize, usize); 4] {
        let (rows, t) = (self.row_space(), self.max_home);
        [
            (rows, self.hidden),
            (rows, self.inter),
            (t, self.hidden),
            (t, self.shared_inter),
        ]
    }

    /// FP8 experts' rows and scales: `fp8_rows`, the expert rows being the exchange's (NCCL EP:
    /// each mode's, its scales also as they land, token-major, and the home rows' codes and
    /// scales it sends).
    fn fp8_bytes(&self) -> usize {
        let q = |(r, k): (usize, usize)| r * k + r.next_multiple_of(4) * (k / fp8::BLOCK) * 4;
        let [x, act, sx, sa] = self.fp8_rows();
        let rows_in = match self.ep {
            Some(e) if self.fp8_dispatch() => {
                let ((ll, ht), t, h) = (self.ep_rows(e), self.max_home, self.hidden);
                q((ll, h)) + q((ht, h)) + q((t, h)) + (ll + ht) * (h / fp8::BLOCK) * 4
            }
            _ => q(x),
        };
        match self.expert_dtype {
            ExpertDtype::Bf16 => 0,
            ExpertDtype::Fp8 => rows_in + q(act) + q(sx) + q(sa),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_exchanges_expert_rows_hold_every_block_aligned() {
        let s = StepShape {
            world: 4,
            rank: 1,
            experts: 32,
            model_experts: 32,
            top_k: 4,
            hidden: 64,
            inter: 64,
            shared_inter: 0,
            max_home: 100,
            ep: None,
            expert_dtype: ExpertDtype::Bf16,
            overlap: 0,
            split: usize::MAX,
        };
        let (slots, rows, local) = (s.slot_space(s.max_home), s.recv_rows(s.max_home), s.local());
        assert_eq!(slots, 4 * 100 * 4);
        // The worst case: every expert's block ends one row past a tile boundary.
        let counts: Vec<usize> = (0..local).map(|_| hopper::ALIGN + 1).collect();
        let padded: usize = counts
            .iter()
            .map(|c| c.next_multiple_of(hopper::ALIGN))
            .sum();
        assert!(counts.iter().sum::<usize>() <= slots);
        assert!(padded <= rows, "{padded} aligned rows in a space of {rows}");
        assert_eq!(rows, slots + local * (hopper::ALIGN - 1));
        assert_eq!(s.row_space(), rows);
    }

    #[test]
    fn a_rank_with_more_slots_than_the_gemm_has_groups_is_refused() {
        let mut s = StepShape::new(&crate::model::synthetic::preset("tiny").unwrap(), 1, 0, 64);
        s.experts = hopper::MAX_GROUPS;
        assert_eq!(s.check(), Ok(()));
        // DeepSeek-V3's 256 experts and 2 redundant slots on one GPU.
        s.experts = hopper::MAX_GROUPS + 2;
        let e = s.check().unwrap_err();
        assert!(e.contains("258 expert slots a rank (at most 256)"), "{e}");
        s.world = 2;
        assert_eq!(s.check(), Ok(()));
    }

    #[test]
    fn fp8_slot_rows_hold_codes_and_scales_aligned_within_a_bf16_row() {
        let mut s = StepShape::new(&crate::model::synthetic::preset("tiny").unwrap(), 2, 0, 64);
        s.expert_dtype = ExpertDtype::Fp8;
        for h in [128, 256, 384, 640, 2048, 7168] {
            s.hidden = h;
            let r = s.slot_row_bytes();
            assert!(s.fp8_slots());
            assert_eq!(r % 16, 0, "hidden {h}: {r} bytes, not 16-byte rows");
            assert!(r >= h + h / fp8::BLOCK * 4, "hidden {h}: {r} bytes");
            assert!(r < h + h / fp8::BLOCK * 4 + 16, "hidden {h}: {r} bytes");
            assert!(
                r <= 2 * h,
                "hidden {h}: {r} bytes, more than its bf16 slot row"
            );
        }
        assert_eq!(s.slot_row_bytes(), 7168 + 224);
        s.ep = Some(EpShape::new(0, false));
        assert!(!s.fp8_slots(), "NCCL EP moves rows itself");
        assert_eq!(s.slot_row_bytes(), 2 * 7168);
        s.ep = None;
        s.expert_dtype = ExpertDtype::Bf16;
        assert_eq!(s.slot_row_bytes(), 2 * 7168);
    }

    #[test]
    fn nccl_ep_forwards_fp8_rows_whose_scales_fill_16_byte_units() {
        let mut s = StepShape::new(&crate::model::synthetic::preset("tiny").unwrap(), 2, 0, 64);
        s.expert_dtype = ExpertDtype::Fp8;
        s.ep = Some(EpShape::new(0, false));
        for (h, forwards) in [
            (128, false),
            (256, false),
            (384, false),
            (512, true),
            (2048, true),
            (7168, true),
        ] {
            s.hidden = h;
            assert_eq!(
                s.fp8_dispatch(),
                forwards,
                "hidden {h}: {} bytes of scales a row",
                h / fp8::BLOCK * 4
            );
        }
        s.expert_dtype = ExpertDtype::Bf16;
        assert!(!s.fp8_dispatch(), "bf16 experts move bf16 rows");
    }
}
