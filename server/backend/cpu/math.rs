//! The CPU backend's math: SwiGLU FFNs over blocks of rows, spread over this rank's lanes (a pool
//! of threads, its share of the host's cores), each lane with scratch sized at startup.
//!
//! Why lanes and not a threaded GEMM: a step's GEMMs are small (synthetic:tiny's are 64 wide), far
//! below where a GEMM pays for threading itself, but a step holds many independent blocks (each
//! local expert's rows, the shared expert's tokens). With one lane the blocks run on the step's own
//! thread, in order, as they always did.
//!
//! FP8 experts (`model::fp8`'s recipe) run in f64 over exactly dequantized operands: every
//! product of two E4M3 values times two f32 scales is exact in f64 and the sums round at 1e-16,
//! so the result does not depend on summation order. That makes this backend the recipe itself,
//! what the f64 reference in tests and the GPU's f32 accumulation are compared with: an f32 sum
//! here would move values across FP8 rounding boundaries (one E4M3 step is 6-12%) in a way no
//! other implementation could reproduce.

use std::sync::{Mutex, MutexGuard};

use ndarray::linalg::general_mat_mul;
use ndarray::{s, ArrayView2, ArrayViewMut2};

use crate::model::fp8::{self, BLOCK};
use crate::model::{ExpertDtype, Ffn, Matrix};

/// Most rows of one block: bounds each lane's scratch whatever the step's skew.
const CHUNK: usize = 256;
/// Fewest rows a block is cut down to for spreading, so that a block's math outweighs a lane's
/// wake-up and the GEMM's packing (a judgement, not swept).
const MIN_ROWS: usize = 16;

/// One lane's scratch: a block's rows in, their metadata, the FFN's intermediates and output.
pub struct Scratch {
    pub rows: Vec<f32>,
    pub meta: Vec<i32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    pub y: Vec<f32>,
    /// FP8 experts only.
    fp8: Option<Fp8Scratch>,
}

/// The f64 images the FP8 path computes on: a block's quantized rows (then its quantized SwiGLU
/// output), the gate/up output, one 128-row block of weights, one 128-column block of output;
/// and one row in f32 before it is quantized (an input row in bf16, or SwiGLU's output).
struct Fp8Scratch {
    x: Vec<f64>,
    gu: Vec<f64>,
    w: Vec<f64>,
    y: Vec<f64>,
    act: Vec<f32>,
}

impl Fp8Scratch {
    fn new(hidden: usize, inter: usize) -> Self {
        let wide = hidden.max(inter);
        Self {
            x: vec![0.0; CHUNK * wide],
            gu: vec![0.0; CHUNK * 2 * inter],
            w: vec![0.0; BLOCK * wide],
            y: vec![0.0; CHUNK * BLOCK],
            act: vec![0.0; wide],
        }
    }

    fn bytes(&self) -> usize {
        8 * (self.x.len() + self.gu.len() + self.w.len() + self.y.len()) + 4 * self.act.len()
    }
}

impl Scratch {
    fn new(hidden: usize, inter: usize, dtype: ExpertDtype) -> Self {
        Self {
            rows: vec![0.0; CHUNK * hidden],
            meta: vec![0; CHUNK * 3],
            gu: vec![0.0; CHUNK * 2 * inter],
            act: vec![0.0; CHUNK * inter],
            y: vec![0.0; CHUNK * hidden],
            fp8: (dtype == ExpertDtype::Fp8).then(|| Fp8Scratch::new(hidden, inter)),
        }
    }

    /// `y[..m * h] = f(rows[..m * h])`.
    pub fn forward(&mut self, f: &Ffn, m: usize, h: usize) {
        let Self {
            rows,
            gu,
            act,
            y,
            fp8,
            ..
        } = self;
        ffn_forward(f, rows, m, h, gu, act, fp8.as_mut(), y);
    }

    /// `y[..m * h] = f(x)` for `x` of `m` rows.
    pub fn forward_from(&mut self, f: &Ffn, x: &[f32], m: usize, h: usize) {
        let Self {
            gu, act, y, fp8, ..
        } = self;
        ffn_forward(f, x, m, h, gu, act, fp8.as_mut(), y);
    }

    fn bytes(&self) -> usize {
        4 * (self.rows.len() + self.meta.len() + self.gu.len() + self.act.len() + self.y.len())
            + self.fp8.as_ref().map_or(0, Fp8Scratch::bytes)
    }
}

/// `y[m, h] = down(silu(gate x) * up x)` for `x[m, h]`, in the experts' format.
#[allow(clippy::too_many_arguments)]
fn ffn_forward(
    f: &Ffn,
    x: &[f32],
    m: usize,
    h: usize,
    gu: &mut [f32],
    act: &mut [f32],
    fp8: Option<&mut Fp8Scratch>,
    y: &mut [f32],
) {
    match (&f.gate_up, &f.down, fp8) {
        (Matrix::F32(gate_up), Matrix::F32(down), _) => {
            ffn_f32(gate_up, down, f.inter, x, m, h, gu, act, y)
        }
        (Matrix::Fp8(gate_up), Matrix::Fp8(down), Some(s)) => {
            ffn_fp8(gate_up, down, f.inter, x, m, h, s, y)
        }
        _ => unreachable!("an FFN's matrices share the format the lanes were sized for"),
    }
}

/// The f32 path: two GEMMs and SwiGLU between them.
#[allow(clippy::too_many_arguments)]
fn ffn_f32(
    gate_up: &[f32],
    down: &[f32],
    i: usize,
    x: &[f32],
    m: usize,
    h: usize,
    gu: &mut [f32],
    act: &mut [f32],
    y: &mut [f32],
) {
    let xa = ArrayView2::from_shape((m, h), &x[..m * h]).expect("x shape");
    let wgu = ArrayView2::from_shape((2 * i, h), gate_up).expect("gate_up shape");
    let mut gua = ArrayViewMut2::from_shape((m, 2 * i), &mut gu[..m * 2 * i]).expect("gu shape");
    general_mat_mul(1.0, &xa, &wgu.t(), 0.0, &mut gua);
    for (row, a) in gu[..m * 2 * i]
        .chunks_exact(2 * i)
        .zip(act[..m * i].chunks_exact_mut(i))
    {
        let (g, u) = row.split_at(i);
        for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
            *a = g / (1.0 + (-g).exp()) * u;
        }
    }
    let aa = ArrayView2::from_shape((m, i), &act[..m * i]).expect("act shape");
    let wd = ArrayView2::from_shape((h, i), down).expect("down shape");
    let mut ya = ArrayViewMut2::from_shape((m, h), &mut y[..m * h]).expect("y shape");
    general_mat_mul(1.0, &aa, &wd.t(), 0.0, &mut ya);
}

/// The FP8 recipe (`model::fp8`): rows in bf16 quantized per 128 channels, gate/up against FP8
/// weight blocks, its output in bf16, SwiGLU (in f32, as a GPU holds it) quantized the same way,
/// down against FP8 blocks. Each GEMM runs one 128-row weight block at a time, so scratch holds
/// one block, not an expert.
#[allow(clippy::too_many_arguments)]
fn ffn_fp8(
    gate_up: &fp8::Blocks,
    down: &fp8::Blocks,
    i: usize,
    x: &[f32],
    m: usize,
    h: usize,
    sc: &mut Fp8Scratch,
    y: &mut [f32],
) {
    for (r, q) in x[..m * h]
        .chunks_exact(h)
        .zip(sc.x[..m * h].chunks_exact_mut(h))
    {
        let row = &mut sc.act[..h];
        row.iter_mut().zip(r).for_each(|(b, &v)| *b = fp8::bf16(v));
        fp8::quantize_row(row, q);
    }
    let mut gu = ArrayViewMut2::from_shape((m, 2 * i), &mut sc.gu[..m * 2 * i]).expect("gu shape");
    let xa = ArrayView2::from_shape((m, h), &sc.x[..m * h]).expect("x shape");
    for b in 0..2 * i / BLOCK {
        gate_up.dequantize_block_rows(b, &mut sc.w);
        let w = ArrayView2::from_shape((BLOCK, h), &sc.w[..BLOCK * h]).expect("w shape");
        let mut out = gu.slice_mut(s![.., b * BLOCK..(b + 1) * BLOCK]);
        general_mat_mul(1.0, &xa, &w.t(), 0.0, &mut out);
    }
    let act = &mut sc.act[..i];
    for (row, q) in sc.gu[..m * 2 * i]
        .chunks_exact(2 * i)
        .zip(sc.x[..m * i].chunks_exact_mut(i))
    {
        let (g, u) = row.split_at(i);
        let bf16 = |v: f64| f64::from(fp8::bf16(v as f32));
        for ((a, &g), &u) in act.iter_mut().zip(g).zip(u) {
            let (g, u) = (bf16(g), bf16(u));
            *a = (g / (1.0 + (-g).exp()) * u) as f32;
        }
        fp8::quantize_row(act, q);
    }
    let aa = ArrayView2::from_shape((m, i), &sc.x[..m * i]).expect("act shape");
    for b in 0..h / BLOCK {
        down.dequantize_block_rows(b, &mut sc.w);
        let w = ArrayView2::from_shape((BLOCK, i), &sc.w[..BLOCK * i]).expect("w shape");
        let mut out =
            ArrayViewMut2::from_shape((m, BLOCK), &mut sc.y[..m * BLOCK]).expect("y shape");
        general_mat_mul(1.0, &aa, &w.t(), 0.0, &mut out);
        for (yr, o) in y[..m * h].chunks_exact_mut(h).zip(sc.y.chunks_exact(BLOCK)) {
            for (y, &o) in yr[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(o) {
                *y = o as f32;
            }
        }
    }
}

/// This rank's threads for the step's blocks, and their scratch.
pub struct Lanes {
    /// None with one lane: the blocks run on the step's thread.
    pool: Option<rayon::ThreadPool>,
    /// One per lane, indexed by the pool's thread index; each is only ever locked by its own lane
    /// (uncontended: the lock makes the sharing safe, not serial).
    scratch: Vec<Mutex<Scratch>>,
}

impl Lanes {
    /// `lanes` threads (at least one), with scratch for FFNs up to `inter` wide in `dtype`.
    pub fn new(
        lanes: usize,
        hidden: usize,
        inter: usize,
        dtype: ExpertDtype,
    ) -> std::io::Result<Self> {
        let lanes = lanes.max(1);
        let pool = match lanes {
            1 => None,
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("cpu-lane-{i}"))
                    .build()
                    .map_err(std::io::Error::other)?,
            ),
        };
        let scratch = (0..lanes)
            .map(|_| Mutex::new(Scratch::new(hidden, inter, dtype)))
            .collect();
        Ok(Self { pool, scratch })
    }

    pub fn count(&self) -> usize {
        self.scratch.len()
    }

    /// Rows per block for a step's `rows` rows: about one block per lane, within
    /// [`MIN_ROWS`, `CHUNK`] (with one lane, `CHUNK` rows, as before lanes).
    pub fn block_rows(&self, rows: usize) -> usize {
        match self.count() {
            1 => CHUNK,
            n => rows.div_ceil(n).clamp(MIN_ROWS, CHUNK),
        }
    }

    fn lane(&self, i: usize) -> MutexGuard<'_, Scratch> {
        self.scratch[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `f(item, scratch)` for each item of `work`, over the lanes; returns when all are done.
    /// Every lane takes the next item until none is left. The caller wakes all lanes at once
    /// (rayon's `broadcast`) rather than leaving them to wake one another as a split `par_iter`
    /// does, a chain of wake-ups inside a step of a few hundred microseconds (on 16 cores the
    /// experts phase took 154-175 µs this way against 174-197 µs split: docs/benchmarks.md).
    /// One item runs on the caller's thread: waking the lanes for it would only add their wake-up.
    pub fn each<I: ExactSizeIterator + Send>(
        &self,
        work: I,
        f: impl Fn(I::Item, &mut Scratch) + Sync,
    ) {
        let pool = match &self.pool {
            Some(pool) if work.len() > 1 => pool,
            _ => {
                let mut s = self.lane(0);
                work.for_each(|w| f(w, &mut s));
                return;
            }
        };
        let work = Mutex::new(work);
        pool.broadcast(|lane| {
            let mut s = self.lane(lane.index());
            loop {
                let next = work.lock().unwrap_or_else(|e| e.into_inner()).next();
                match next {
                    Some(w) => f(w, &mut s),
                    None => break,
                }
            }
        });
    }

    /// (name, address, bytes) of each lane's scratch, for the startup log.
    pub fn buffers(&self) -> Vec<(&'static str, usize, usize)> {
        (0..self.count())
            .map(|i| {
                let s = self.lane(i);
                ("lane_scratch", s.rows.as_ptr() as usize, s.bytes())
            })
            .collect()
    }
}

/// Most lanes `default_lanes` gives a rank: a 256-token step of synthetic:tiny holds 8 to 16
/// blocks per rank, and lanes past that wake for nothing (on 32 cores, 8 lanes per rank served
/// 37.9k and 55.4k requests/s where 16 served 34.1k and 43.4k: docs/benchmarks.md).
const DEFAULT_MAX_LANES: usize = 8;

/// Lanes per rank when `--cpu-threads` is 0: this host's cores (as the process may use them)
/// shared by the group's `ranks`, all on this host with the CPU backend, at most
/// `DEFAULT_MAX_LANES`.
pub fn default_lanes(ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks.max(1)).clamp(1, DEFAULT_MAX_LANES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ffn(h: usize, i: usize, seed: u32) -> Ffn {
        let v = |n: usize, s: u32| -> Vec<f32> {
            (0..n)
                .map(|k| (((k as u32).wrapping_mul(2654435761) ^ s) % 1000) as f32 / 1000.0 - 0.5)
                .collect()
        };
        Ffn::from_parts(v(i * h, seed), v(i * h, seed + 2), v(h * i, seed + 1), i)
    }

    /// Every block is run once, on whichever lane, and the blocks' results do not depend on the
    /// lane count: one lane and four give the same bits.
    #[test]
    fn lanes_run_every_block_once_with_the_same_results() {
        let (h, i, n) = (8, 12, 100);
        let f = ffn(h, i, 7);
        let x: Vec<f32> = (0..n * h).map(|k| ((k % 13) as f32 - 6.0) / 6.0).collect();
        let run = |lanes: usize| {
            let l = Lanes::new(lanes, h, i, ExpertDtype::Bf16).unwrap();
            assert_eq!(l.count(), lanes);
            let mut out = vec![1.0f32; n * h];
            let per = l.block_rows(n);
            l.each(out.chunks_mut(per * h).enumerate(), |(b, block), s| {
                let (first, m) = (b * per, block.len() / h);
                s.forward_from(&f, &x[first * h..(first + m) * h], m, h);
                block
                    .iter_mut()
                    .zip(&s.y[..m * h])
                    .for_each(|(o, &y)| *o += y);
            });
            let seen = Mutex::new(vec![0u32; 37]);
            l.each(0..37, |t, _| seen.lock().unwrap()[t] += 1);
            assert!(seen.into_inner().unwrap().iter().all(|&c| c == 1));
            out
        };
        let one = run(1);
        assert_eq!(one, run(4));
        // Against the same FFN on all rows at once: the rows are independent.
        let mut s = Scratch::new(h, i, ExpertDtype::Bf16);
        for first in (0..n).step_by(CHUNK) {
            let m = CHUNK.min(n - first);
            s.forward_from(&f, &x[first * h..(first + m) * h], m, h);
            for (o, y) in one[first * h..(first + m) * h].iter().zip(&s.y[..m * h]) {
                assert_eq!(*o, 1.0 + y);
            }
        }
    }

    #[test]
    fn blocks_are_about_one_per_lane_within_bounds() {
        let l = Lanes::new(4, 4, 4, ExpertDtype::Bf16).unwrap();
        assert_eq!(l.block_rows(256), 64);
        assert_eq!(l.block_rows(10), MIN_ROWS);
        assert_eq!(l.block_rows(100_000), CHUNK);
        assert_eq!(
            Lanes::new(1, 4, 4, ExpertDtype::Bf16)
                .unwrap()
                .block_rows(10),
            CHUNK
        );
        assert!(default_lanes(1) >= default_lanes(2) && default_lanes(1_000_000) == 1);
        assert!((1..=DEFAULT_MAX_LANES).contains(&default_lanes(1)));
    }

    /// The FP8 path against the recipe written out in f64, row by row with no blocking: the
    /// dequantized weights, each row in bf16 quantized per 128 channels, gate/up in bf16,
    /// SwiGLU, its output quantized.
    #[test]
    fn fp8_ffn_is_the_recipe_row_by_row() {
        let (h, i, m) = (256, 384, 37);
        let f = ffn(h, i, 11).into_fp8(h);
        let (Matrix::Fp8(gu), Matrix::Fp8(down)) = (&f.gate_up, &f.down) else {
            panic!("into_fp8 keeps FP8 blocks");
        };
        // Exact in f64, as the recipe's products are (f32 would round q * s).
        let exact = |b: &fp8::Blocks| -> Vec<f64> {
            (0..b.rows * b.cols)
                .map(|k| {
                    f64::from(fp8::decode(b.q[k])) * f64::from(b.scale(k / b.cols, k % b.cols))
                })
                .collect()
        };
        let (wgu, wd) = (exact(gu), exact(down));
        let x: Vec<f32> = (0..m * h)
            .map(|k| ((k * 7 % 101) as f32 - 50.0) / 25.0 * if k % 97 == 0 { 40.0 } else { 1.0 })
            .collect();
        let mut s = Scratch::new(h, i, ExpertDtype::Fp8);
        s.forward_from(&f, &x, m, h);
        let bf16 = |v: f64| f64::from(fp8::bf16(v as f32));
        for r in 0..m {
            let mut q = vec![0f64; h];
            let row: Vec<f32> = x[r * h..(r + 1) * h]
                .iter()
                .map(|&v| fp8::bf16(v))
                .collect();
            fp8::quantize_row(&row, &mut q);
            let dot = |w: &[f64], a: &[f64]| -> f64 { w.iter().zip(a).map(|(w, a)| w * a).sum() };
            let act: Vec<f32> = (0..i)
                .map(|j| {
                    let g = bf16(dot(&wgu[j * h..(j + 1) * h], &q));
                    let u = bf16(dot(&wgu[(i + j) * h..(i + j + 1) * h], &q));
                    (g / (1.0 + (-g).exp()) * u) as f32
                })
                .collect();
            let mut qa = vec![0f64; i];
            fp8::quantize_row(&act, &mut qa);
            for o in 0..h {
                let want = dot(&wd[o * i..(o + 1) * i], &qa);
                let got = f64::from(s.y[r * h + o]);
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "row {r} column {o}: {got} against {want}"
                );
            }
        }
    }
}
