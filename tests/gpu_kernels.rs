//! Each CUDA kernel against the CPU implementation on random data. They need a GPU, so they are
//! ignored by default (CI has none): run them with `--ignored` on a GPU machine (see
//! scripts/gpu-check.sh).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::gpu;
use epserve::backend::cuda::kernels::decode_gemm::{DecodeGemm, Out};
use epserve::backend::cuda::kernels::hopper::{self, Gemm, Layout, Sms};
use epserve::backend::cuda::{
    max_tiles, sigmoid_group_in_regs, Blocks, Gpu, Logits, ROUTER_PIECES, TOPK_REGS_EXPERTS,
};
use epserve::model::routing::Router;
use epserve::model::Routing;
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn bf16s(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(r.random_range(-scale..scale)))
        .collect()
}

/// How `check_topk` draws logits.
#[derive(Clone, Copy, PartialEq)]
enum Draw {
    /// Uniform, and each further slice 100x smaller (as the bf16 router's pieces' products are).
    Spread,
    /// On a grid of quarters with zeros of both signs, the rest of the slices zero: many ties,
    /// which both kernels must break to the lower index as the CPU router does.
    Ties,
}

/// Checks GPU top-k against the CPU backend's router, row by row, for logits given whole
/// (`parts` 1) or as the bf16 router's slices, which the kernel sums last slice first: the CPU
/// router gets the same f32 sums.
fn check_topk(routing: &Routing, e: usize, k: usize, parts: usize, draw: Draw, seed: u64) {
    let g = gpu();
    let (n_cap, n) = (333usize, 300usize);
    let mut r = rng(seed);
    let slices: Vec<f32> = (0..n_cap * parts * e)
        .map(|i| {
            let slice = (i / e) % parts;
            match draw {
                Draw::Spread => r.random_range(-3.0f32..3.0) * 0.01f32.powi(slice as i32),
                Draw::Ties if slice > 0 => 0.0,
                Draw::Ties => match r.random_range(-4i32..=4) {
                    0 if r.random_bool(0.5) => -0.0,
                    q => 0.25 * q as f32,
                },
            }
        })
        .collect();
    let logits: Vec<f32> = (0..n_cap * e)
        .map(|i| {
            let row = &slices[(i / e) * parts * e..][..parts * e];
            (0..parts - 1)
                .rev()
                .fold(row[(parts - 1) * e + i % e], |v, p| v + row[p * e + i % e])
        })
        .collect();
    let bias: Vec<f32> = (0..e).map(|_| r.random_range(-0.1f32..0.1)).collect();
    let s = &g.stream;
    let (dl, db, dn) = (
        Logits::from_slices(s.clone_htod(&slices).unwrap(), parts),
        s.clone_htod(&bias).unwrap(),
        s.clone_htod(&[n as i32]).unwrap(),
    );
    let mut ids = s.alloc_zeros::<i32>(n_cap * k).unwrap();
    let mut w = s.alloc_zeros::<f32>(n_cap * k).unwrap();
    match *routing {
        Routing::SoftmaxTopK { renormalize } => {
            g.topk_softmax(&dl, &dn, n_cap, e, k, renormalize, &mut ids, &mut w)
        }
        Routing::SigmoidGroupTopK {
            n_group,
            topk_group,
            renormalize,
            scaling,
        } => g.topk_sigmoid_group(
            &dl,
            &db,
            &dn,
            n_cap,
            e,
            k,
            (n_group, topk_group),
            renormalize,
            scaling,
            &mut ids,
            &mut w,
        ),
    }
    .unwrap();
    let (ids, w) = (s.clone_dtoh(&ids).unwrap(), s.clone_dtoh(&w).unwrap());
    let mut router = Router::default();
    let (mut want_ids, mut want_w) = (vec![0i32; k], vec![0f32; k]);
    for t in 0..n {
        let bias = matches!(routing, Routing::SigmoidGroupTopK { .. }).then_some(&bias[..]);
        router.route(
            routing,
            &logits[t * e..(t + 1) * e],
            bias,
            &mut want_ids,
            &mut want_w,
        );
        assert_eq!(&ids[t * k..(t + 1) * k], &want_ids[..], "row {t}");
        for (a, b) in w[t * k..(t + 1) * k].iter().zip(&want_w) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "row {t}: {a} vs {b}"
            );
        }
    }
    assert!(
        ids[n * k..].iter().all(|&i| i == -1),
        "rows past n are marked empty"
    );
}

/// Both forms of each top-k kernel: up to `TOPK_REGS_EXPERTS` experts (and for DeepSeek-V3
/// routing one group or groups of 32) the register form, past it the shared-memory form.
#[test]
#[ignore = "needs a GPU"]
fn topk_softmax_matches_the_cpu_router() {
    use Draw::*;
    // 256 experts run in registers, 384 in shared memory.
    const { assert!(TOPK_REGS_EXPERTS >= 256 && TOPK_REGS_EXPERTS < 384) };
    for renormalize in [true, false] {
        let sm = Routing::SoftmaxTopK { renormalize };
        for (e, k, parts, draw, seed) in [
            (128, 8, 1, Spread, 1),
            (8, 2, 1, Spread, 2),
            (256, 8, 3, Spread, 4),
            (256, 8, 1, Ties, 6),
            (384, 8, 1, Spread, 7),
            (384, 8, 3, Spread, 8),
            (384, 8, 1, Ties, 9),
        ] {
            check_topk(&sm, e, k, parts, draw, seed);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn topk_sigmoid_group_matches_the_cpu_router() {
    use Draw::*;
    let routing = |n_group, topk_group, renormalize, scaling| Routing::SigmoidGroupTopK {
        n_group,
        topk_group,
        renormalize,
        scaling,
    };
    let ds = routing(8, 4, true, 2.5);
    let one = routing(1, 1, true, 1.0);
    let small = routing(4, 2, false, 1.0);
    for (r, e, k, parts, draw, seed, regs) in [
        (&ds, 256, 8, 1, Spread, 3, true),
        (&ds, 256, 8, 3, Spread, 5, true),
        (&ds, 256, 8, 1, Ties, 10, true),
        (&one, 64, 6, 1, Spread, 11, true),
        (&one, 384, 8, 3, Spread, 12, false),
        (&one, 384, 8, 1, Ties, 13, false),
        (&small, 16, 4, 1, Spread, 4, false),
        (&small, 16, 4, 1, Ties, 14, false),
    ] {
        let Routing::SigmoidGroupTopK { n_group, .. } = *r else {
            unreachable!()
        };
        assert_eq!(sigmoid_group_in_regs(e, n_group), regs, "{e} experts");
        check_topk(r, e, k, parts, draw, seed);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn layout_and_gather_match_a_stable_cpu_sort() {
    let g = gpu();
    let s = &g.stream;
    let (n_cap, n, k, e, h) = (200usize, 173usize, 4usize, 32usize, 64usize);
    let mut r = rng(5);
    let mut ids = vec![-1i32; n_cap * k];
    for t in 0..n {
        let row = rand::seq::index::sample(&mut r, e, k);
        for (j, x) in row.into_iter().enumerate() {
            ids[t * k + j] = x as i32;
        }
    }
    let x = bf16s(&mut r, n_cap * h, 1.0);
    let (dids, dn, dx) = (
        s.clone_htod(&ids).unwrap(),
        s.clone_htod(&[n as i32]).unwrap(),
        s.clone_htod(&x).unwrap(),
    );
    let mut counts = s.alloc_zeros::<i32>(e).unwrap();
    let mut offsets = s.alloc_zeros::<i32>(e + 1).unwrap();
    let mut pos_of = s.alloc_zeros::<i32>(n_cap * k).unwrap();
    let mut entry_of = s.alloc_zeros::<i32>(n_cap * k).unwrap();
    g.layout(
        &dids,
        &dn,
        n_cap,
        k,
        e,
        &mut counts,
        &mut offsets,
        &mut pos_of,
        &mut entry_of,
    )
    .unwrap();
    let total = s.clone_htod(&[(n * k) as i32]).unwrap();
    let mut rows = s.alloc_zeros::<bf16>(n_cap * k * h).unwrap();
    g.gather_rows(&dx, &entry_of, &total, n_cap * k, k, h, &mut rows)
        .unwrap();
    let (counts, offsets, pos_of) = (
        s.clone_dtoh(&counts).unwrap(),
        s.clone_dtoh(&offsets).unwrap(),
        s.clone_dtoh(&pos_of).unwrap(),
    );
    let rows = s.clone_dtoh(&rows).unwrap();
    // CPU: a stable sort of the entries by expert.
    let mut order: Vec<usize> = (0..n * k).collect();
    order.sort_by_key(|&j| ids[j]);
    let mut want_counts = vec![0i32; e];
    ids[..n * k]
        .iter()
        .for_each(|&i| want_counts[i as usize] += 1);
    assert_eq!(counts, want_counts);
    assert_eq!(offsets[e] as usize, n * k);
    for (p, &j) in order.iter().enumerate() {
        assert_eq!(pos_of[j] as usize, p, "entry {j}");
        assert_eq!(
            &rows[p * h..(p + 1) * h],
            &x[(j / k) * h..(j / k + 1) * h],
            "row {p}"
        );
    }
    let mut acc = 0;
    for ei in 0..e {
        assert_eq!(offsets[ei], acc);
        acc += want_counts[ei];
    }
}

#[test]
#[ignore = "needs a GPU"]
fn swiglu_and_combine_match_f64() {
    let g = gpu();
    let s = &g.stream;
    let (rows_cap, rows, inter) = (50usize, 41usize, 96usize);
    let mut r = rng(6);
    let gu = bf16s(&mut r, rows_cap * 2 * inter, 3.0);
    // Without routing weights, then with them (as NCCL EP HT folds each row's weight in).
    let weights: Vec<f32> = (0..rows_cap).map(|_| r.random_range(0.0..1.0)).collect();
    let dw = s.clone_htod(&weights).unwrap();
    for w in [None, Some(&dw)] {
        let mut act = s.alloc_zeros::<bf16>(rows_cap * inter).unwrap();
        g.swiglu(
            &s.clone_htod(&gu).unwrap(),
            &s.clone_htod(&[rows as i32]).unwrap(),
            rows_cap,
            inter,
            w,
            &mut act,
        )
        .unwrap();
        let act = s.clone_dtoh(&act).unwrap();
        for row in 0..rows {
            let scale = w.map_or(1.0, |_| f64::from(weights[row]));
            for i in 0..inter {
                let (a, u) = (
                    gu[row * 2 * inter + i].to_f64(),
                    gu[row * 2 * inter + inter + i].to_f64(),
                );
                let want = a / (1.0 + (-a).exp()) * u * scale;
                let got = act[row * inter + i].to_f64();
                assert!(
                    (got - want).abs() <= 1e-2 * want.abs().max(0.05),
                    "{row},{i} (weighted: {}): {got} vs {want}",
                    w.is_some()
                );
            }
        }
        assert!(
            act[rows * inter..].iter().all(|v| v.to_f32() == 0.0),
            "rows past the count are untouched"
        );
    }

    let (n_cap, n, k, h) = (30usize, 27usize, 3usize, 64usize);
    let y = bf16s(&mut r, n_cap * k * h, 1.0);
    let pos: Vec<i32> = {
        let mut p: Vec<i32> = (0..(n_cap * k) as i32).collect();
        p.reverse();
        p
    };
    let w: Vec<f32> = (0..n_cap * k)
        .map(|_| r.random_range(0.0f32..1.0))
        .collect();
    let shared = bf16s(&mut r, n_cap * h, 1.0);
    let mut out = s.alloc_zeros::<f32>(n_cap * h).unwrap();
    let (dy, dp, dw, dn, dsh) = (
        s.clone_htod(&y).unwrap(),
        s.clone_htod(&pos).unwrap(),
        s.clone_htod(&w).unwrap(),
        s.clone_htod(&[n as i32]).unwrap(),
        s.clone_htod(&shared).unwrap(),
    );
    for with_shared in [false, true] {
        g.combine(
            &dy,
            &dp,
            &dw,
            &dn,
            n_cap,
            k,
            h,
            with_shared.then_some(&dsh),
            &mut out,
        )
        .unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        for t in 0..n {
            for c in 0..h {
                let mut want: f64 = (0..k)
                    .map(|j| f64::from(w[t * k + j]) * y[pos[t * k + j] as usize * h + c].to_f64())
                    .sum();
                if with_shared {
                    want += shared[t * h + c].to_f64();
                }
                assert!(
                    (f64::from(got[t * h + c]) - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{t},{c}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn grouped_gemm_matches_f64_per_expert() {
    // N = 256 runs the wide (64 x 128, pipelined) kernel, N = 192 the 64 x 64 one.
    for n in [256, 192] {
        grouped_gemm_case(n);
    }
}

fn grouped_gemm_case(n: usize) {
    let g = gpu();
    let s = &g.stream;
    let (e, kd) = (6usize, 96usize);
    let mut r = rng(7);
    // Uneven blocks, one empty, one spanning several tiles and a partial one.
    let counts = [5usize, 0, 130, 64, 1, 77];
    let rows: usize = counts.iter().sum();
    let rows_cap = rows + 20;
    let mut offsets = vec![0i32];
    counts
        .iter()
        .for_each(|c| offsets.push(offsets.last().unwrap() + *c as i32));
    let x = bf16s(&mut r, rows_cap * kd, 1.0);
    let w = bf16s(&mut r, e * n * kd, (3.0f32 / kd as f32).sqrt());
    let mut tiles = s.alloc_zeros::<i32>(2 * max_tiles(rows_cap, e)).unwrap();
    let mut n_tiles = s.alloc_zeros::<i32>(1).unwrap();
    let mut y = s
        .clone_htod(&vec![bf16::from_f32(7.0); rows_cap * n])
        .unwrap();
    let (dx, dw, doff) = (
        s.clone_htod(&x).unwrap(),
        s.clone_htod(&w).unwrap(),
        s.clone_htod(&offsets).unwrap(),
    );
    g.grouped_gemm(
        &dx,
        &dw,
        Blocks::Offsets(&doff),
        e,
        rows_cap,
        n,
        kd,
        &mut tiles,
        &mut n_tiles,
        &mut y,
    )
    .unwrap();
    let y = s.clone_dtoh(&y).unwrap();
    let worst = (0..e)
        .map(|ei| expert_error(&x, &w, &y, ei, offsets[ei] as usize, counts[ei], n, kd))
        .fold(0f64, f64::max);
    assert!(worst <= 1e-2, "N {n}: worst relative error {worst:.3e}");
    assert!(
        y[rows * n..].iter().all(|v| v.to_f32() == 7.0),
        "rows past the last block are not written"
    );
}

/// Worst relative error of `y` rows `[first, first + count)` against `x . w_e^T` in f64, over
/// every element; `want` below 0.1 in size is compared absolutely.
#[allow(clippy::too_many_arguments)]
fn expert_error(
    x: &[bf16],
    w: &[bf16],
    y: &[bf16],
    e: usize,
    first: usize,
    count: usize,
    n: usize,
    kd: usize,
) -> f64 {
    let mut worst = 0f64;
    for row in first..first + count {
        for c in 0..n {
            let want: f64 = (0..kd)
                .map(|q| x[row * kd + q].to_f64() * w[(e * n + c) * kd + q].to_f64())
                .sum();
            let got = y[row * n + c].to_f64();
            worst = worst.max((got - want).abs() / want.abs().max(0.1));
        }
    }
    worst
}

/// Runs the Hopper GEMM over host operands (`y` starts as 7.0 everywhere, so untouched rows show)
/// and returns `y`.
fn hopper_gemm(
    g: &Gpu,
    (x, w): (&[bf16], &[bf16]),
    (rows, groups, n, kd): (usize, usize, usize, usize),
    (layout, sms): (Layout, Sms),
    sizes: &cudarc::driver::CudaSlice<i32>,
) -> Vec<bf16> {
    let s = &g.stream;
    let (dx, dw) = (s.clone_htod(x).unwrap(), s.clone_htod(w).unwrap());
    let mut y = s.clone_htod(&vec![bf16::from_f32(7.0); rows * n]).unwrap();
    let gemm = Gemm {
        x: &dx,
        rows,
        w: &dw,
        groups,
        n,
        k: kd,
        layout,
        sms,
        sizes,
    };
    g.hopper.gemm(gemm, &mut y, s).unwrap();
    s.clone_dtoh(&y).unwrap()
}

#[test]
#[ignore = "needs a GPU"]
fn hopper_psum_gemm_matches_f64_per_expert() {
    // An empty expert, counts off the 128-row tile, one hot expert with most rows; N = 192 ends
    // in half a 128-column tile, K = 320 in five 64-deep stages.
    for (counts, n, kd) in [
        (vec![5usize, 0, 300, 128, 1, 77], 256usize, 192usize),
        (vec![0, 2, 1000, 3, 0, 129, 1], 192, 320),
    ] {
        let g = gpu();
        let s = &g.stream;
        let e = counts.len();
        let mut r = rng(11);
        let mut offsets = vec![0i32];
        for c in &counts {
            let next = offsets.last().unwrap() + c.next_multiple_of(hopper::ALIGN) as i32;
            offsets.push(next);
        }
        let rows = *offsets.last().unwrap() as usize + 64;
        let x = bf16s(&mut r, rows * kd, 1.0);
        let w = bf16s(&mut r, e * n * kd, (3.0f32 / kd as f32).sqrt());
        let counts32: Vec<i32> = counts.iter().map(|&c| c as i32).collect();
        let (doff, dcnt) = (
            s.clone_htod(&offsets).unwrap(),
            s.clone_htod(&counts32).unwrap(),
        );
        let mut ends = s.alloc_zeros::<i32>(hopper::MAX_GROUPS).unwrap();
        g.psum_ends(&doff, &dcnt, &mut ends).unwrap();
        let shape = (rows, e, n, kd);
        let y = hopper_gemm(&g, (&x, &w), shape, (Layout::Psum, Sms::All), &ends);
        // Two-batch overlap's instance of fewer CTAs: the same tile, so the same bits.
        let beside = (Layout::Psum, Sms::BesideExchange);
        let fewer = hopper_gemm(&g, (&x, &w), shape, beside, &ends);
        assert!(
            y.iter()
                .zip(&fewer)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "n {n} k {kd}: the psum GEMM beside an exchange differs from the one on every SM"
        );
        let ends = s.clone_dtoh(&ends).unwrap();
        for ei in 0..e {
            assert_eq!(
                ends[ei],
                offsets[ei] + counts32[ei],
                "psum end of expert {ei}"
            );
            let err = expert_error(&x, &w, &y, ei, offsets[ei] as usize, counts[ei], n, kd);
            assert!(
                err <= 1e-2,
                "n {n} k {kd}: expert {ei} ({} rows): worst relative error {err:.3e}",
                counts[ei]
            );
        }
        assert!(
            ends[e..].iter().all(|&v| v == offsets[e]),
            "ends past the last expert are the padded total"
        );
        assert!(
            y[offsets[e] as usize * n..]
                .iter()
                .all(|v| v.to_f32() == 7.0),
            "rows past the last expert's tiles are not written"
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn hopper_masked_gemm_matches_f64_per_expert() {
    // NCCL EP's low-latency layout: expert e's rows start at e x stride; counts from empty to
    // the whole stride, and one past it (clamped). N = 384 ends inside a 256-wide column tile.
    masked_case(100);
}

fn masked_case(mean_rows: usize) {
    let g = gpu();
    let s = &g.stream;
    let (stride, n, kd) = (128usize, 384usize, 256usize);
    let tile = 64;
    let counts = [0i32, 1, 128, 77, 64, 200];
    let e = counts.len();
    let rows = e * stride;
    let MaskedCase { x, w, .. } = MaskedCase::new(13, &counts, stride, n, kd);
    let masked = MaskedCase::sizes(&g, &counts, stride);
    let layout = Layout::Masked { stride, mean_rows };
    let y = hopper_gemm(&g, (&x, &w), (rows, e, n, kd), (layout, Sms::All), &masked);
    let masked = s.clone_dtoh(&masked).unwrap();
    for (ei, &c) in counts.iter().enumerate() {
        let valid = (c as usize).min(stride);
        assert_eq!(masked[ei] as usize, valid, "masked count of expert {ei}");
        let err = expert_error(&x, &w, &y, ei, ei * stride, valid, n, kd);
        assert!(
            err <= 1e-2,
            "{tile}-row tile: expert {ei} ({valid} rows): worst relative error {err:.3e}"
        );
        // The last tile may write its padding rows; rows past it stay untouched.
        let untouched = ei * stride + valid.next_multiple_of(tile);
        assert!(
            y[untouched * n..(ei + 1) * stride * n]
                .iter()
                .all(|v| v.to_f32() == 7.0),
            "{tile}-row tile: expert {ei}: rows past its last tile are not written"
        );
    }
    assert!(
        masked[e..].iter().all(|&v| v == 0),
        "no rows past the last expert"
    );
}

/// Masked operands on the host: `x [e * stride, kd]` and `w [e * n, kd]` random, `counts` as
/// NCCL EP's low-latency layout gives them (through `ll_bounds`, which clamps to the stride).
struct MaskedCase {
    x: Vec<bf16>,
    w: Vec<bf16>,
    counts: Vec<i32>,
    stride: usize,
}

impl MaskedCase {
    fn new(seed: u64, counts: &[i32], stride: usize, n: usize, kd: usize) -> Self {
        let mut r = rng(seed);
        let e = counts.len();
        Self {
            x: bf16s(&mut r, e * stride * kd, 1.0),
            w: bf16s(&mut r, e * n * kd, (3.0f32 / kd as f32).sqrt()),
            counts: counts.to_vec(),
            stride,
        }
    }

    /// The counts as the kernels read them (`hopper::MAX_GROUPS` ints), through `ll_bounds`.
    fn sizes(g: &Gpu, counts: &[i32], stride: usize) -> cudarc::driver::CudaSlice<i32> {
        let s = &g.stream;
        let dcnt = s.clone_htod(counts).unwrap();
        let mut bounds = s.alloc_zeros::<i32>(2 * counts.len()).unwrap();
        let mut masked = s.alloc_zeros::<i32>(hopper::MAX_GROUPS).unwrap();
        g.ll_bounds(&dcnt, counts.len(), stride, &mut bounds, &mut masked)
            .unwrap();
        masked
    }

    /// Runs decode's GEMM (its output starts as 7.0 everywhere) and returns the output and the
    /// clamped counts, after checking that no row past an expert's count was written.
    fn run(&self, g: &Gpu, n: usize, kd: usize, out: Out) -> (Vec<bf16>, Vec<usize>) {
        let s = &g.stream;
        let (e, stride) = (self.counts.len(), self.stride);
        let rows = e * stride;
        let cols = if out == Out::SwiGlu { n / 2 } else { n };
        let masked = Self::sizes(g, &self.counts, stride);
        let (dx, dw) = (
            s.clone_htod(&self.x).unwrap(),
            s.clone_htod(&self.w).unwrap(),
        );
        let mut y = s
            .clone_htod(&vec![bf16::from_f32(7.0); rows * cols])
            .unwrap();
        let layout = Layout::Masked {
            stride,
            mean_rows: 16,
        };
        assert!(DecodeGemm::takes(layout, e, n, kd));
        let gemm = Gemm {
            x: &dx,
            rows,
            w: &dw,
            groups: e,
            n,
            k: kd,
            layout,
            sms: Sms::All,
            sizes: &masked,
        };
        g.decode.gemm(gemm, out, &mut y).unwrap();
        let y = s.clone_dtoh(&y).unwrap();
        let valid: Vec<usize> = self
            .counts
            .iter()
            .map(|&c| (c.max(0) as usize).min(stride))
            .collect();
        for (ei, &v) in valid.iter().enumerate() {
            assert!(
                y[(ei * stride + v) * cols..(ei + 1) * stride * cols]
                    .iter()
                    .all(|v| v.to_f32() == 7.0),
                "expert {ei}: rows past its count are not written"
            );
        }
        (y, valid)
    }
}

#[test]
#[ignore = "needs a GPU"]
fn decode_gemm_matches_f64_per_expert() {
    // Counts: empty, one row, one chunk exactly and one past it, off the 8-row tiles, the whole
    // stride (a hot expert: four chunks) and past it (clamped). K = 320 is five 64-deep stages,
    // so the pipeline wraps inside a unit; N = 512 is two 256-row units. The second draw runs
    // on the same GPU after the first: its units come from the ticket the first launch left
    // at zero, so a ticket left over would leave its rows unwritten.
    let (stride, n, kd) = (128usize, 512usize, 320usize);
    let g = gpu();
    for (seed, counts) in [
        (17, [0i32, 1, 32, 33, 13, 128, 300, 7]),
        (18, [64, 2, 0, 31, 97, 16, 1, 40]),
    ] {
        let c = MaskedCase::new(seed, &counts, stride, n, kd);
        let (y, valid) = c.run(&g, n, kd, Out::Plain);
        for (ei, &v) in valid.iter().enumerate() {
            let err = expert_error(&c.x, &c.w, &y, ei, ei * stride, v, n, kd);
            assert!(
                err <= 1e-2,
                "draw {seed}: expert {ei} ({v} rows): worst relative error {err:.3e}"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn decode_gemm_swiglu_matches_f64_per_row() {
    // Gate/up of intermediate 384 (three 128-column units), K = 256; SwiGLU of the f64 products,
    // checked per row of each expert.
    let counts = [5i32, 0, 40, 128, 1, 64];
    let (stride, inter, kd) = (128usize, 384usize, 256usize);
    let n = 2 * inter;
    let g = gpu();
    let c = MaskedCase::new(19, &counts, stride, n, kd);
    let (act, valid) = c.run(&g, n, kd, Out::SwiGlu);
    let dot = |row: usize, wrow: usize| -> f64 {
        (0..kd)
            .map(|q| c.x[row * kd + q].to_f64() * c.w[wrow * kd + q].to_f64())
            .sum()
    };
    for (ei, &v) in valid.iter().enumerate() {
        for row in ei * stride..ei * stride + v {
            let mut worst = 0f64;
            for i in 0..inter {
                let (gate, up) = (dot(row, ei * n + i), dot(row, ei * n + inter + i));
                let want = gate / (1.0 + (-gate).exp()) * up;
                let got = act[row * inter + i].to_f64();
                worst = worst.max((got - want).abs() / want.abs().max(0.1));
            }
            assert!(
                worst <= 2e-2,
                "expert {ei}, row {row}: worst relative error {worst:.3e}"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn dense_bf16_gemm_matches_f64_per_row() {
    // The shared expert's GEMMs (cuBLAS, bf16 out): rows off every tile size, K not a power of 2.
    let g = gpu();
    let s = &g.stream;
    let (m, n, kd) = (37usize, 272usize, 200usize);
    let mut r = rng(23);
    let x = bf16s(&mut r, m * kd, 1.0);
    let w = bf16s(&mut r, n * kd, (3.0f32 / kd as f32).sqrt());
    let (dx, dw) = (s.clone_htod(&x).unwrap(), s.clone_htod(&w).unwrap());
    let mut y = s.alloc_zeros::<bf16>(m * n).unwrap();
    g.gemm_bf16(&dw, &dx, (m, n, kd), &mut y).unwrap();
    let y = s.clone_dtoh(&y).unwrap();
    for row in 0..m {
        let err = expert_error(&x, &w, &y, 0, row, 1, n, kd);
        assert!(err <= 1e-2, "row {row}: worst relative error {err:.3e}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn router_logits_match_f64() {
    // A decode-sized bucket and a prefill-sized one (cuBLAS picks other kernels), SGEMM over f32
    // rows and the tensor-core router over bf16 rows; then DeepSeek-V3's hidden size.
    for bf16_rows in [false, true] {
        router_logits_case(70, 130, 272, bf16_rows);
        router_logits_case(2018, 2118, 272, bf16_rows);
    }
    router_logits_case(100, 128, 7168, false);
    router_logits_case(100, 128, 7168, true);
}

/// Router logits of `n` random rows (bf16 values when `bf16_rows`) in a bucket of `n_cap`,
/// against f64 sums of the same products, per logit.
fn router_logits_case(n: usize, n_cap: usize, h: usize, bf16_rows: bool) {
    let g = gpu();
    let s = &g.stream;
    // Experts not a multiple of any tile; the step reads rows below n only.
    let e = 24usize;
    let mut r = rng(9);
    let round = |v: f32| match bf16_rows {
        true => bf16::from_f32(v).to_f32(),
        false => v,
    };
    let x: Vec<f32> = (0..n_cap * h)
        .map(|_| round(r.random_range(-1.0..1.0)))
        .collect();
    let w: Vec<f32> = (0..e * h).map(|_| r.random_range(-0.1..0.1)).collect();
    let mut logits =
        Logits::new(&mut epserve::backend::cuda::Alloc::new(s.clone()), n_cap, e).unwrap();
    let (dx, dw) = (s.clone_htod(&x).unwrap(), s.clone_htod(&w).unwrap());
    let slices = match bf16_rows {
        false => {
            g.router_logits(&dx, &dw, n_cap, e, h, &mut logits).unwrap();
            1
        }
        true => {
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let dxb = s.clone_htod(&xb).unwrap();
            let mut pieces = s.alloc_zeros::<bf16>(ROUTER_PIECES * e * h).unwrap();
            g.bf16_pieces(&dw, &mut pieces).unwrap();
            let p = s.clone_dtoh(&pieces).unwrap();
            // The pieces sum to the weights exactly.
            for (i, &want) in w.iter().enumerate() {
                let got: f64 = (0..ROUTER_PIECES)
                    .map(|q| f64::from(p[q * e * h + i]))
                    .sum();
                assert_eq!(got, f64::from(want), "weight {i}: pieces sum to {got}");
            }
            g.router_logits_bf16(&dxb, &pieces, n_cap, e, h, &mut logits)
                .unwrap();
            ROUTER_PIECES
        }
    };
    let got = s.clone_dtoh(logits.buf()).unwrap();
    let mut worst = 0f64;
    for t in 0..n {
        for j in 0..e {
            let want: f64 = (0..h)
                .map(|q| f64::from(x[t * h + q]) * f64::from(w[j * h + q]))
                .sum();
            let row = &got[t * slices * e..][..slices * e];
            let sum: f64 = (0..slices).map(|p| f64::from(row[p * e + j])).sum();
            worst = worst.max((sum - want).abs());
        }
    }
    // f32 accumulation of h products of size <= 0.1 (random signs): ~1e-6 at h 7168. TF32 (or
    // bf16 weights) would miss by ~1e-3.
    eprintln!("router logits, n_cap {n_cap}, h {h}, bf16 rows {bf16_rows}: worst {worst:.3e}");
    assert!(
        worst <= 1e-5 * (h as f64 / 272.0).sqrt(),
        "n_cap {n_cap}, h {h}, bf16 rows {bf16_rows}: worst absolute error {worst:.3e}"
    );
}
