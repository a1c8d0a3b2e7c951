//! NCCL EP through the service's safe layer (`backend::cuda::sys::nccl_ep`, over nccl-sys's
//! hand-declared ABI), on every GPU of the machine (a thread per GPU): an HT group, an
//! expert-major handle, then per step UpdateHandle, Dispatch, an identity expert that scales each
//! received row by its routing weight, and Combine; every token must come back as
//! x * sum(weights), and the per-expert counters must match the routing. Needs NCCL >= 2.30.4
//! and libnccl_ep (see scripts/device-run.sh); ignored by default.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use epserve::backend::cuda::sys::nccl::Comm;
use epserve::backend::cuda::sys::nccl_ep::{Dispatch, Group, Handle, Layout, Tensor};
use epserve::backend::cuda::{device_count, Gpu};
use half::bf16;
use nccl_sys::ep::*;
use nccl_sys::{ncclResult_t, ncclUniqueId, Nccl};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const E: usize = 16;
const K: usize = 4;
const H: usize = 512; // NCCL EP's LL kernels need a multiple of 512
const T: usize = 64; // tokens per rank

/// An HT group for `tokens` per rank and an expert-major handle over its own memory.
fn open(
    comm: &Comm,
    ep: &Arc<NcclEp>,
    tokens: usize,
    recv_cap: usize,
    s: &Arc<CudaStream>,
) -> Handle {
    let mut cfg = ncclEpGroupConfig_t::new();
    cfg.algorithm = ncclEpAlgorithm_t::HIGH_THROUGHPUT;
    cfg.num_experts = E as u32;
    cfg.max_dispatch_tokens_per_rank = tokens as u32;
    cfg.max_recv_tokens_per_rank = recv_cap as u32;
    cfg.max_token_bytes = (H * 2) as u32;
    let mut hcfg = ncclEpHandleConfig_t::new();
    hcfg.dispatch_output_per_expert_alignment = 1;
    open_with(comm, ep, &cfg, &hcfg, s).unwrap()
}

/// A group of `cfg` and an expert-major handle of `hcfg` over memory of the size it asks for.
fn open_with(
    comm: &Comm,
    ep: &Arc<NcclEp>,
    cfg: &ncclEpGroupConfig_t,
    hcfg: &ncclEpHandleConfig_t,
    s: &Arc<CudaStream>,
) -> Result<Handle, epserve::backend::cuda::sys::nccl::NcclError> {
    let group = Group::create(ep, comm, cfg)?;
    let bytes = group.handle_bytes(hcfg, K)?;
    let mem = s.alloc_zeros::<u8>(bytes.max(1)).unwrap();
    Handle::init(group, hcfg, K, mem, s)
}

/// HT dispatch of `tokens` home rows `x` and their routing weights `w` into `rows` and one
/// weight per received row, which hold the group's receive capacity.
fn dispatch_ht(
    handle: &mut Handle,
    (x, w): (&CudaSlice<bf16>, &CudaSlice<f32>),
    (rows, rows_w): (&mut CudaSlice<bf16>, &mut CudaSlice<f32>),
    tokens: usize,
    s: &CudaStream,
) {
    let cap = rows_w.len();
    let mut t_x = Tensor::of(x, &[tokens, H], s);
    let mut t_w = Tensor::of(w, &[tokens, K], s);
    let mut t_r = Tensor::of_mut(rows, &[cap, H], s);
    let mut t_rw = Tensor::of_mut(rows_w, &[cap], s);
    let d = Dispatch {
        x: &mut t_x,
        w: Some(&mut t_w),
        rows: &mut t_r,
        rows_w: Some(&mut t_rw),
        scales: None,
    };
    handle.dispatch(d, None, s).unwrap();
}

/// One rank's tokens and routing (distinct experts per token, positive weights).
fn routing(rank: usize) -> (Vec<bf16>, Vec<i64>, Vec<f32>) {
    let mut r = ChaCha8Rng::seed_from_u64(500 + rank as u64);
    let x = (0..T * H)
        .map(|_| bf16::from_f32(r.random_range(-1.0..1.0)))
        .collect();
    let mut ids = Vec::with_capacity(T * K);
    for _ in 0..T {
        let mut chosen: Vec<i64> = Vec::with_capacity(K);
        while chosen.len() < K {
            let e = r.random_range(0..E as i64);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    let w = (0..T * K).map(|_| r.random_range(0.1f32..1.0)).collect();
    (x, ids, w)
}

fn rank_main(
    nccl: Arc<Nccl>,
    ep: Arc<NcclEp>,
    id: ncclUniqueId,
    world: usize,
    rank: usize,
) -> (Vec<i32>, f64) {
    let g = Gpu::new(rank).unwrap();
    g.ctx.bind_to_thread().unwrap();
    let s = g.stream.clone();
    let comm = Comm::init(nccl, &id, (world, rank), &[]).unwrap();
    let local = E / world;
    let recv_cap = world * T * K.min(local);
    let mut handle = open(&comm, &ep, T, recv_cap, &s);

    let (x, ids, w) = routing(rank);
    let dx = s.clone_htod(&x).unwrap();
    let dids = s.clone_htod(&ids).unwrap();
    let dw = s.clone_htod(&w).unwrap();
    let mut counters = s.alloc_zeros::<i32>(local).unwrap();
    let mut recv = s.alloc_zeros::<bf16>(recv_cap * H).unwrap();
    let mut recv_w = s.alloc_zeros::<f32>(recv_cap).unwrap();
    let mut out = s.alloc_zeros::<bf16>(T * H).unwrap();

    let mut t_ids = Tensor::of(&dids, &[T, K], &s);
    let mut t_cnt = Tensor::of_mut(&mut counters, &[local], &s);
    let layout = Layout {
        counters: Some(&mut t_cnt),
        ..Default::default()
    };
    handle.update(&mut t_ids, Some(layout), &s).unwrap();
    drop(t_cnt);
    {
        // recv holds recv_cap rows, the most this rank can receive.
        dispatch_ht(&mut handle, (&dx, &dw), (&mut recv, &mut recv_w), T, &s);
    }
    s.synchronize().unwrap();

    // The identity expert, weighted on the host: each received row times its routing weight.
    let cnt = s.clone_dtoh(&counters).unwrap();
    let rows: usize = cnt.iter().map(|&c| c as usize).sum();
    let mut rh = s.clone_dtoh(&recv).unwrap();
    let rw = s.clone_dtoh(&recv_w).unwrap();
    for r in 0..rows {
        for v in &mut rh[r * H..(r + 1) * H] {
            *v = bf16::from_f32(v.to_f32() * rw[r]);
        }
    }
    let scaled = s.clone_htod(&rh).unwrap();
    {
        let mut t_c = Tensor::of(&scaled, &[recv_cap, H], &s);
        let mut t_o = Tensor::of_mut(&mut out, &[T, H], &s);
        handle.combine(&mut t_c, &mut t_o, None, &s).unwrap();
    }
    s.synchronize().unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    let mut worst = 0f64;
    for t in 0..T {
        let sw: f32 = w[t * K..(t + 1) * K].iter().sum();
        for h in 0..H {
            let want = f64::from(x[t * H + h].to_f32() * sw);
            let d = (f64::from(got[t * H + h].to_f32()) - want).abs() / want.abs().max(0.25);
            worst = worst.max(d);
        }
    }
    // The handle (then its group) before the communicator and buffers go.
    drop(handle);
    (cnt, worst)
}

/// What these tests need: 2 GPUs or more dividing `E`, NCCL >= 2.30.4 and libnccl_ep. None
/// where the machine lacks one: the test then skips, saying why.
fn group_here() -> Option<(usize, Arc<Nccl>, Arc<NcclEp>)> {
    let world = device_count();
    let libs = match (world >= 2 && E % world == 0, Nccl::load(), NcclEp::load()) {
        (false, ..) => Err(format!("needs 2+ GPUs dividing {E}, found {world}")),
        (true, Err(e), _) | (true, _, Err(e)) => Err(e.to_string()),
        (true, Ok(n), Ok(ep)) => Ok((world, Arc::new(n), Arc::new(ep))),
    };
    libs.map_err(|why| eprintln!("skipped: {why} (scripts/device-run.sh ep)"))
        .ok()
}

#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn ht_expert_major_dispatch_and_combine_round_trip() {
    let Some((world, nccl, ep)) = group_here() else {
        return;
    };
    eprintln!(
        "NCCL {} ({}), NCCL EP {} ({})",
        nccl_sys::version_string(nccl.version),
        nccl.path.display(),
        ep.version,
        ep.path.display()
    );
    let (n, e) = (nccl.clone(), ep.clone());
    let outs: Vec<(Vec<i32>, f64)> = common::gpu::on_ranks(&nccl, world, move |id, rank| {
        rank_main(n.clone(), e.clone(), id, world, rank)
    });
    // Counters: rank r's local experts received every (token, k) routed to them, from all ranks.
    let mut want = vec![0i32; E];
    for r in 0..world {
        for &e in &routing(r).1 {
            want[e as usize] += 1;
        }
    }
    let got: Vec<i32> = outs.iter().flat_map(|(c, _)| c.clone()).collect();
    assert_eq!(got, want, "per-expert receive counters");
    let worst = outs.iter().map(|o| o.1).fold(0.0, f64::max);
    eprintln!("{world} GPUs: combine(dispatch(x)) worst relative error {worst:.3e}");
    assert!(worst <= 2e-2, "worst relative error {worst:.3e}");
}

const T_CAP: usize = 64; // tensor rows: a bucket
const N_REAL: usize = 40; // rows holding tokens; the rest are padding with expert id -1

/// A step's inputs: `N_REAL` tokens then padding rows routed nowhere (id -1, weight 0).
fn padded_inputs(rank: usize, step: u64) -> (Vec<bf16>, Vec<i32>, Vec<f32>) {
    let mut r = ChaCha8Rng::seed_from_u64(900 + 10 * step + rank as u64);
    let x = (0..T_CAP * H)
        .map(|_| bf16::from_f32(r.random_range(-1.0..1.0)))
        .collect();
    let mut ids = vec![-1i32; T_CAP * K];
    let mut w = vec![0f32; T_CAP * K];
    for t in 0..N_REAL {
        let mut chosen: Vec<i32> = Vec::with_capacity(K);
        while chosen.len() < K {
            let e = r.random_range(0..E as i32);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids[t * K..(t + 1) * K].copy_from_slice(&chosen);
        for v in &mut w[t * K..(t + 1) * K] {
            *v = r.random_range(0.1f32..1.0);
        }
    }
    (x, ids, w)
}

/// Worst relative error of `got` against x * sum(w) over the real rows.
fn round_trip_error(x: &[bf16], w: &[f32], got: &[bf16]) -> f64 {
    let mut worst = 0f64;
    for t in 0..N_REAL {
        let sw: f32 = w[t * K..(t + 1) * K].iter().sum();
        for h in 0..H {
            let want = f64::from(x[t * H + h].to_f32() * sw);
            let d = (f64::from(got[t * H + h].to_f32()) - want).abs() / want.abs().max(0.25);
            worst = worst.max(d);
        }
    }
    worst
}

/// One HT step's device buffers.
struct Padded {
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    w: CudaSlice<f32>,
    counters: CudaSlice<i32>,
    total: CudaSlice<i32>,
    recv: CudaSlice<bf16>,
    recv_w: CudaSlice<f32>,
    out: CudaSlice<bf16>,
    recv_cap: usize,
}

impl Padded {
    /// UpdateHandle, Dispatch, weight the received rows, Combine, on `g`'s stream only. The
    /// descriptors are made per call, as the service makes them: a captured graph keeps the
    /// device pointers they held.
    fn enqueue(&mut self, g: &Gpu, handle: &mut Handle) {
        let (s, cap, local) = (&g.stream, self.recv_cap, self.counters.len());
        {
            let mut t_ids = Tensor::of(&self.ids, &[T_CAP, K], s);
            let mut t_cnt = Tensor::of_mut(&mut self.counters, &[local], s);
            let mut t_tot = Tensor::of_mut(&mut self.total, &[1], s);
            let layout = Layout {
                counters: Some(&mut t_cnt),
                total: Some(&mut t_tot),
                ..Default::default()
            };
            handle.update(&mut t_ids, Some(layout), s).unwrap();
        }
        {
            let rows = (&mut self.recv, &mut self.recv_w);
            dispatch_ht(handle, (&self.x, &self.w), rows, T_CAP, s);
        }
        g.scale_rows(&mut self.recv, &self.recv_w, &self.total, cap, H)
            .unwrap();
        let mut t_c = Tensor::of(&self.recv, &[cap, H], s);
        let mut t_o = Tensor::of_mut(&mut self.out, &[T_CAP, H], s);
        handle.combine(&mut t_c, &mut t_o, None, s).unwrap();
    }

    /// Step `step`'s inputs into the buffers; returns them for the check.
    fn load(&mut self, s: &Arc<CudaStream>, rank: usize, step: u64) -> (Vec<bf16>, Vec<f32>) {
        let (x, ids, w) = padded_inputs(rank, step);
        s.memcpy_htod(&x, &mut self.x).unwrap();
        s.memcpy_htod(&ids, &mut self.ids).unwrap();
        s.memcpy_htod(&w, &mut self.w).unwrap();
        (x, w)
    }
}

/// One rank's step on the device only: UpdateHandle, Dispatch, weight the received rows,
/// Combine. Returns per-step (counters, worst error) for an eager step and 3 graph replays.
fn padded_rank(
    nccl: Arc<Nccl>,
    ep: Arc<NcclEp>,
    id: ncclUniqueId,
    world: usize,
    rank: usize,
) -> Vec<(Vec<i32>, f64)> {
    let g = Gpu::new(rank).unwrap();
    g.ctx.bind_to_thread().unwrap();
    let s = g.stream.clone();
    let comm = Comm::init(nccl, &id, (world, rank), &[]).unwrap();
    let local = E / world;
    let recv_cap = world * T_CAP * K.min(local);
    let mut handle = open(&comm, &ep, T_CAP, recv_cap, &s);
    let mut b = Padded {
        x: s.alloc_zeros::<bf16>(T_CAP * H).unwrap(),
        ids: s.alloc_zeros::<i32>(T_CAP * K).unwrap(),
        w: s.alloc_zeros::<f32>(T_CAP * K).unwrap(),
        counters: s.alloc_zeros::<i32>(local).unwrap(),
        total: s.alloc_zeros::<i32>(1).unwrap(),
        recv: s.alloc_zeros::<bf16>(recv_cap * H).unwrap(),
        recv_w: s.alloc_zeros::<f32>(recv_cap).unwrap(),
        out: s.alloc_zeros::<bf16>(T_CAP * H).unwrap(),
        recv_cap,
    };
    let mut results = Vec::new();
    let (x, w) = b.load(&s, rank, 0);
    b.enqueue(&g, &mut handle);
    s.synchronize().unwrap();
    let got = s.clone_dtoh(&b.out).unwrap();
    results.push((
        s.clone_dtoh(&b.counters).unwrap(),
        round_trip_error(&x, &w, &got),
    ));

    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    b.enqueue(&g, &mut handle);
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured step");
    for step in 1..=3 {
        let (x, w) = b.load(&s, rank, step);
        s.memset_zeros(&mut b.out).unwrap();
        graph.launch().unwrap();
        s.synchronize().unwrap();
        let got = s.clone_dtoh(&b.out).unwrap();
        results.push((
            s.clone_dtoh(&b.counters).unwrap(),
            round_trip_error(&x, &w, &got),
        ));
    }
    // The graph, then the handle (and its group), before the communicator and buffers go.
    drop(graph);
    drop(handle);
    results
}

#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn ht_padding_rows_are_ignored_and_captured_steps_replay() {
    let Some((world, nccl, ep)) = group_here() else {
        return;
    };
    let (n, e) = (nccl.clone(), ep.clone());
    let outs: Vec<Vec<(Vec<i32>, f64)>> = common::gpu::on_ranks(&nccl, world, move |id, rank| {
        padded_rank(n.clone(), e.clone(), id, world, rank)
    });
    for step in 0..4u64 {
        let mut want = vec![0i32; E];
        for r in 0..world {
            for &e in padded_inputs(r, step).1.iter().filter(|&&e| e >= 0) {
                want[e as usize] += 1;
            }
        }
        let got: Vec<i32> = outs
            .iter()
            .flat_map(|o| o[step as usize].0.clone())
            .collect();
        let worst = outs.iter().map(|o| o[step as usize].1).fold(0.0, f64::max);
        let how = if step == 0 { "eager" } else { "graph replay" };
        eprintln!("step {step} ({how}): worst relative error {worst:.3e}");
        assert_eq!(got, want, "step {step}: per-expert receive counters");
        assert!(
            worst <= 2e-2,
            "step {step}: worst relative error {worst:.3e}"
        );
    }
}

/// One rank's LL step: an LL group and expert-major handle for `T_CAP` tokens per rank; the
/// step's `N_REAL` tokens (then padding routed nowhere) dispatched to `[local][world x T_CAP]`
/// rows (in a registered window when `zero_copy`), an identity expert, and Combine weighing the
/// rows with the home tokens' weights. Returns (counters, rows found where the layout says,
/// worst error of x * sum(w)).
fn ll_rank(
    nccl: Arc<Nccl>,
    ep: Arc<NcclEp>,
    id: ncclUniqueId,
    world: usize,
    rank: usize,
    zero_copy: bool,
) -> (Vec<i32>, bool, f64) {
    let g = Gpu::new(rank).unwrap();
    g.ctx.bind_to_thread().unwrap();
    let s = g.stream.clone();
    let comm = Comm::init(nccl, &id, (world, rank), &[]).unwrap();
    let local = E / world;
    let stride = world * T_CAP;
    let mut cfg = ncclEpGroupConfig_t::new();
    cfg.algorithm = ncclEpAlgorithm_t::LOW_LATENCY;
    cfg.num_experts = E as u32;
    cfg.max_dispatch_tokens_per_rank = T_CAP as u32;
    cfg.max_token_bytes = (H * 2) as u32;
    cfg.num_topk = K as u32;
    cfg.zero_copy = match zero_copy {
        true => ncclEpZeroCopyMode_t::ON,
        false => ncclEpZeroCopyMode_t::OFF,
    };
    let mut handle = open_with(&comm, &ep, &cfg, &ncclEpHandleConfig_t::new(), &s).unwrap();
    let (x, ids, w) = padded_inputs(rank, 7);
    let dx = s.clone_htod(&x).unwrap();
    let dids = s.clone_htod(&ids).unwrap();
    let dw = s.clone_htod(&w).unwrap();
    let mut counters = s.alloc_zeros::<i32>(local).unwrap();
    let mut out = s.alloc_zeros::<bf16>(T_CAP * H).unwrap();
    let mut win_rows = zero_copy.then(|| comm.sym_alloc::<bf16>(local * stride * H, &s).unwrap());
    let mut plain_rows = (!zero_copy).then(|| s.alloc_zeros::<bf16>(local * stride * H).unwrap());
    let r_sz = [local, stride, H];
    let mut t_ids = Tensor::of(&dids, &[T_CAP, K], &s);
    handle.update(&mut t_ids, None, &s).unwrap();
    let dispatched = {
        let mut t_r = match (&mut win_rows, &mut plain_rows) {
            (Some(wr), _) => Tensor::window(wr, &r_sz),
            (_, Some(p)) => Tensor::of_mut(p, &r_sz, &s),
            _ => unreachable!(),
        };
        let mut t_x = Tensor::of(&dx, &[T_CAP, H], &s);
        let mut t_cnt = Tensor::of_mut(&mut counters, &[local], &s);
        let d = Dispatch {
            x: &mut t_x,
            w: None,
            rows: &mut t_r,
            rows_w: None,
            scales: None,
        };
        let layout = Layout {
            counters: Some(&mut t_cnt),
            ..Default::default()
        };
        handle.dispatch(d, Some(layout), &s)
    };
    if zero_copy {
        // NCCL EP 0.2: "zero_copy=ON on LL dispatch requires NCCL_EP_LAYOUT_RANK_MAJOR". When a
        // release takes it, this fails and the service's LL path can use windows too.
        let refused = dispatched.as_ref().err().map(|e| e.result);
        assert_eq!(
            refused,
            Some(ncclResult_t::INVALID_ARGUMENT),
            "zero-copy LL expert-major dispatch"
        );
        // The handle (and its group), then the window, before the communicator.
        drop(handle);
        drop((win_rows, plain_rows));
        return (Vec::new(), true, 0.0);
    }
    dispatched.unwrap();
    s.synchronize().unwrap();
    let cnt = s.clone_dtoh(&counters).unwrap();
    let rows = match (&win_rows, &plain_rows) {
        (Some(wr), _) => s.clone_dtoh(&**wr).unwrap(),
        (_, Some(p)) => s.clone_dtoh(p).unwrap(),
        _ => unreachable!(),
    };
    // Every source's tokens routed to local expert j, as rows, must fill j's first cnt[j] rows.
    let mut laid_out = true;
    for (j, &n) in cnt.iter().enumerate() {
        let e = (rank * local + j) as i32;
        let mut want: Vec<Vec<u16>> = Vec::new();
        for src in 0..world {
            let (sx, sids, _) = padded_inputs(src, 7);
            for t in 0..T_CAP {
                if sids[t * K..(t + 1) * K].contains(&e) {
                    want.push(sx[t * H..(t + 1) * H].iter().map(|v| v.to_bits()).collect());
                }
            }
        }
        let base = j * stride;
        let mut got: Vec<Vec<u16>> = (0..n.max(0) as usize)
            .map(|r| {
                rows[(base + r) * H..(base + r + 1) * H]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect();
        want.sort();
        got.sort();
        laid_out &= want == got;
    }
    {
        // Combine applies the weights itself in LL expert-major.
        let mut t_r = Tensor::of_mut(plain_rows.as_mut().expect("plain rows"), &r_sz, &s);
        let mut t_o = Tensor::of_mut(&mut out, &[T_CAP, H], &s);
        let mut t_w = Tensor::of(&dw, &[T_CAP, K], &s);
        handle
            .combine(&mut t_r, &mut t_o, Some(&mut t_w), &s)
            .unwrap();
    }
    s.synchronize().unwrap();
    let worst = round_trip_error(&x, &w, &s.clone_dtoh(&out).unwrap());
    // The handle (and its group), then the rows, before the communicator.
    drop(handle);
    drop((win_rows, plain_rows));
    (cnt, laid_out, worst)
}

#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn ll_expert_major_layout_and_weighted_combine_and_no_windows() {
    let Some((world, nccl, ep)) = group_here() else {
        return;
    };
    let mut want = vec![0i32; E];
    for r in 0..world {
        for &e in padded_inputs(r, 7).1.iter().filter(|&&e| e >= 0) {
            want[e as usize] += 1;
        }
    }
    for zero_copy in [false, true] {
        let (n, e) = (nccl.clone(), ep.clone());
        let outs: Vec<(Vec<i32>, bool, f64)> =
            common::gpu::on_ranks(&nccl, world, move |id, rank| {
                ll_rank(n.clone(), e.clone(), id, world, rank, zero_copy)
            });
        if zero_copy {
            eprintln!("LL expert-major, zero-copy: refused by this NCCL EP, as expected");
            continue;
        }
        let got: Vec<i32> = outs.iter().flat_map(|o| o.0.clone()).collect();
        let worst = outs.iter().map(|o| o.2).fold(0.0, f64::max);
        eprintln!("LL, zero-copy {zero_copy}: worst relative error {worst:.3e}");
        assert_eq!(
            got, want,
            "zero-copy {zero_copy}: per-expert receive counters"
        );
        assert!(
            outs.iter().all(|o| o.1),
            "zero-copy {zero_copy}: rows not where the expert-major layout puts them"
        );
        assert!(
            worst <= 2e-2,
            "zero-copy {zero_copy}: worst relative error {worst:.3e}"
        );
    }
}
