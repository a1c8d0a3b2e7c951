//! NCCL EP through nccl-sys's hand-declared ABI, on every GPU of the machine (a thread per GPU):
//! an HT group, an expert-major handle, then per step UpdateHandle, Dispatch, an identity expert
//! that scales each received row by its routing weight, and Combine; every token must come back
//! as x * sum(weights), and the per-expert counters must match the routing. Needs NCCL >= 2.30.4
//! and libnccl_ep (see scripts/device-run.sh); ignored by default.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use epserve::backend::cuda::sys::nccl::Comm;
use epserve::backend::cuda::{device_count, Gpu};
use half::bf16;
use nccl_sys::ep::*;
use nccl_sys::{ncclDataType_t, ncclResult_t, ncclUniqueId, Nccl};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const E: usize = 16;
const K: usize = 4;
const H: usize = 512; // NCCL EP's LL kernels need a multiple of 512
const T: usize = 64; // tokens per rank

fn ok(what: &str, r: ncclResult_t) {
    assert_eq!(r, ncclResult_t::SUCCESS, "{what}: {r}");
}

fn dptr<T>(s: &CudaSlice<T>, st: &CudaStream) -> u64 {
    s.device_ptr(st).0
}

fn dptr_mut<T>(s: &mut CudaSlice<T>, st: &CudaStream) -> u64 {
    s.device_ptr_mut(st).0
}

/// An HT group for `tokens` per rank and an expert-major handle over memory it returns (which
/// must outlive the handle).
fn open(
    ep: &NcclEp,
    comm: &Comm,
    tokens: usize,
    recv_cap: usize,
    s: &Arc<CudaStream>,
) -> (ncclEpGroup_t, ncclEpHandle_t, CudaSlice<u8>) {
    let mut cfg = ncclEpGroupConfig_t::new();
    cfg.algorithm = ncclEpAlgorithm_t::HIGH_THROUGHPUT;
    cfg.num_experts = E as u32;
    cfg.max_dispatch_tokens_per_rank = tokens as u32;
    cfg.max_recv_tokens_per_rank = recv_cap as u32;
    cfg.max_token_bytes = (H * 2) as u32;
    let mut hcfg = ncclEpHandleConfig_t::new();
    hcfg.dispatch_output_per_expert_alignment = 1;
    open_with(ep, comm, &cfg, &hcfg, s)
}

/// A group of `cfg` and an expert-major handle of `hcfg` over memory it returns (which must
/// outlive the handle).
fn open_with(
    ep: &NcclEp,
    comm: &Comm,
    cfg: &ncclEpGroupConfig_t,
    hcfg: &ncclEpHandleConfig_t,
    s: &Arc<CudaStream>,
) -> (ncclEpGroup_t, ncclEpHandle_t, CudaSlice<u8>) {
    let mut group: ncclEpGroup_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer, live communicator, a config built by its constructor.
    ok("ncclEpCreateGroup", unsafe {
        (ep.create_group)(&mut group, comm.raw(), cfg)
    });
    let mut mem_size = 0usize;
    // SAFETY: live group, valid config and out-pointer.
    ok("ncclEpHandleMemSize", unsafe {
        (ep.handle_mem_size)(
            group,
            ncclEpLayout_t::EXPERT_MAJOR,
            hcfg,
            &mut mem_size,
            K as i32,
        )
    });
    let mut handle_mem = s.alloc_zeros::<u8>(mem_size.max(1)).unwrap();
    let mut hm_sizes = [mem_size];
    let hm = ncclEpTensor_t::describe(
        handle_mem.device_ptr_mut(s).0,
        ncclDataType_t::Uint8,
        &mut hm_sizes,
    );
    let mut handle: ncclEpHandle_t = std::ptr::null_mut();
    // SAFETY: handle_mem holds mem_size bytes; the caller keeps it past the handle.
    ok("ncclEpInitHandle", unsafe {
        (ep.init_handle)(
            &mut handle,
            group,
            ncclEpLayout_t::EXPERT_MAJOR,
            hcfg,
            K as i32,
            &hm,
        )
    });
    (group, handle, handle_mem)
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
    let raw = s.cu_stream() as nccl_sys::cudaStream_t;
    let comm = Comm::init(nccl, &id, world, rank).unwrap();
    let local = E / world;
    let recv_cap = world * T * K.min(local);

    let (group, handle, handle_mem) = open(&ep, &comm, T, recv_cap, &s);

    let (x, ids, w) = routing(rank);
    let dx = s.clone_htod(&x).unwrap();
    let dids = s.clone_htod(&ids).unwrap();
    let dw = s.clone_htod(&w).unwrap();
    let mut counters = s.alloc_zeros::<i32>(local).unwrap();
    let mut recv = s.alloc_zeros::<bf16>(recv_cap * H).unwrap();
    let mut recv_w = s.alloc_zeros::<f32>(recv_cap).unwrap();
    let mut out = s.alloc_zeros::<bf16>(T * H).unwrap();

    let (mut ids_sz, mut cnt_sz) = ([T, K], [local]);
    let t_ids = ncclEpTensor_t::describe(dptr(&dids, &s), ncclDataType_t::Int64, &mut ids_sz);
    let mut t_cnt = ncclEpTensor_t::describe(
        dptr_mut(&mut counters, &s),
        ncclDataType_t::Int32,
        &mut cnt_sz,
    );
    let mut li = ncclEpLayoutInfo_t::new();
    li.expert_counters = &mut t_cnt;
    // SAFETY: descriptors and their size arrays live on this frame through the call.
    ok("ncclEpUpdateHandle", unsafe {
        (ep.update_handle)(handle, &t_ids, &li, raw)
    });

    let (mut x_sz, mut w_sz, mut r_sz, mut rw_sz) = ([T, H], [T, K], [recv_cap, H], [recv_cap]);
    let mut t_x = ncclEpTensor_t::describe(dptr(&dx, &s), ncclDataType_t::Bfloat16, &mut x_sz);
    let mut t_w = ncclEpTensor_t::describe(dptr(&dw, &s), ncclDataType_t::Float32, &mut w_sz);
    let mut t_r =
        ncclEpTensor_t::describe(dptr_mut(&mut recv, &s), ncclDataType_t::Bfloat16, &mut r_sz);
    let mut t_rw = ncclEpTensor_t::describe(
        dptr_mut(&mut recv_w, &s),
        ncclDataType_t::Float32,
        &mut rw_sz,
    );
    let mut din = ncclEpDispatchInputs_t::new();
    din.tokens = &mut t_x;
    din.topk_weights = &mut t_w;
    let mut dout = ncclEpDispatchOutputs_t::new();
    dout.tokens = &mut t_r;
    dout.topk_weights = &mut t_rw;
    let dcfg = ncclEpDispatchConfig_t::new();
    // SAFETY: as above; recv holds recv_cap rows, the most this rank can receive.
    ok("ncclEpDispatch", unsafe {
        (ep.dispatch)(handle, &din, &dout, std::ptr::null(), &dcfg, raw)
    });
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
    let mut c_sz = [recv_cap, H];
    let mut o_sz = [T, H];
    let mut t_c = ncclEpTensor_t::describe(dptr(&scaled, &s), ncclDataType_t::Bfloat16, &mut c_sz);
    let mut t_o =
        ncclEpTensor_t::describe(dptr_mut(&mut out, &s), ncclDataType_t::Bfloat16, &mut o_sz);
    let mut cin = ncclEpCombineInputs_t::new();
    cin.tokens = &mut t_c;
    let mut cout = ncclEpCombineOutputs_t::new();
    cout.tokens = &mut t_o;
    let ccfg = ncclEpCombineConfig_t::new();
    // SAFETY: as for dispatch.
    ok("ncclEpCombine", unsafe {
        (ep.combine)(handle, &cin, &cout, &ccfg, raw)
    });
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
    // SAFETY: the handle, then the group, before the communicator and buffers go.
    unsafe {
        ok("ncclEpHandleDestroy", (ep.handle_destroy)(handle));
        ok("ncclEpGroupDestroy", (ep.group_destroy)(group));
    }
    drop(handle_mem);
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
    let id = Comm::unique_id(&nccl).unwrap();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let (nccl, ep) = (nccl.clone(), ep.clone());
            std::thread::spawn(move || rank_main(nccl, ep, id, world, rank))
        })
        .collect();
    let outs: Vec<(Vec<i32>, f64)> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
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
    let raw = s.cu_stream() as nccl_sys::cudaStream_t;
    let comm = Comm::init(nccl, &id, world, rank).unwrap();
    let local = E / world;
    let recv_cap = world * T_CAP * K.min(local);
    let (group, handle, _handle_mem) = open(&ep, &comm, T_CAP, recv_cap, &s);
    let mut dx = s.alloc_zeros::<bf16>(T_CAP * H).unwrap();
    let mut dids = s.alloc_zeros::<i32>(T_CAP * K).unwrap();
    let mut dw = s.alloc_zeros::<f32>(T_CAP * K).unwrap();
    let mut counters = s.alloc_zeros::<i32>(local).unwrap();
    let mut total = s.alloc_zeros::<i32>(1).unwrap();
    let mut recv = s.alloc_zeros::<bf16>(recv_cap * H).unwrap();
    let mut recv_w = s.alloc_zeros::<f32>(recv_cap).unwrap();
    let mut out = s.alloc_zeros::<bf16>(T_CAP * H).unwrap();
    // Descriptors and their extents live for the whole test: a captured graph replays the
    // pointers they held at capture.
    let (mut ids_sz, mut cnt_sz, mut tot_sz) = ([T_CAP, K], [local], [1usize]);
    let (mut x_sz, mut w_sz, mut r_sz, mut rw_sz) =
        ([T_CAP, H], [T_CAP, K], [recv_cap, H], [recv_cap]);
    let mut o_sz = [T_CAP, H];
    let mut c_sz = [recv_cap, H];
    let t_ids = ncclEpTensor_t::describe(dptr(&dids, &s), ncclDataType_t::Int32, &mut ids_sz);
    let mut t_cnt = ncclEpTensor_t::describe(
        dptr_mut(&mut counters, &s),
        ncclDataType_t::Int32,
        &mut cnt_sz,
    );
    let mut t_tot =
        ncclEpTensor_t::describe(dptr_mut(&mut total, &s), ncclDataType_t::Int32, &mut tot_sz);
    let mut t_x = ncclEpTensor_t::describe(dptr(&dx, &s), ncclDataType_t::Bfloat16, &mut x_sz);
    let mut t_w = ncclEpTensor_t::describe(dptr(&dw, &s), ncclDataType_t::Float32, &mut w_sz);
    let mut t_r =
        ncclEpTensor_t::describe(dptr_mut(&mut recv, &s), ncclDataType_t::Bfloat16, &mut r_sz);
    let mut t_rw = ncclEpTensor_t::describe(
        dptr_mut(&mut recv_w, &s),
        ncclDataType_t::Float32,
        &mut rw_sz,
    );
    let mut t_c = ncclEpTensor_t::describe(dptr(&recv, &s), ncclDataType_t::Bfloat16, &mut c_sz);
    let mut t_o =
        ncclEpTensor_t::describe(dptr_mut(&mut out, &s), ncclDataType_t::Bfloat16, &mut o_sz);
    let mut li = ncclEpLayoutInfo_t::new();
    li.expert_counters = &mut t_cnt;
    li.recv_total_counter = &mut t_tot;
    let mut din = ncclEpDispatchInputs_t::new();
    din.tokens = &mut t_x;
    din.topk_weights = &mut t_w;
    let mut dout = ncclEpDispatchOutputs_t::new();
    dout.tokens = &mut t_r;
    dout.topk_weights = &mut t_rw;
    let mut cin = ncclEpCombineInputs_t::new();
    cin.tokens = &mut t_c;
    let mut cout = ncclEpCombineOutputs_t::new();
    cout.tokens = &mut t_o;
    let (dcfg, ccfg) = (ncclEpDispatchConfig_t::new(), ncclEpCombineConfig_t::new());

    let enqueue = |recv: &mut CudaSlice<bf16>| {
        // SAFETY: every descriptor above points at live buffers of the sizes it states.
        unsafe {
            ok(
                "ncclEpUpdateHandle",
                (ep.update_handle)(handle, &t_ids, &li, raw),
            );
            ok(
                "ncclEpDispatch",
                (ep.dispatch)(handle, &din, &dout, std::ptr::null(), &dcfg, raw),
            );
        }
        g.scale_rows(recv, &recv_w, &total, recv_cap, H).unwrap();
        // SAFETY: as above.
        ok("ncclEpCombine", unsafe {
            (ep.combine)(handle, &cin, &cout, &ccfg, raw)
        });
    };
    let mut results = Vec::new();
    let load = |step: u64,
                dx: &mut CudaSlice<bf16>,
                dids: &mut CudaSlice<i32>,
                dw: &mut CudaSlice<f32>| {
        let (x, ids, w) = padded_inputs(rank, step);
        s.memcpy_htod(&x, dx).unwrap();
        s.memcpy_htod(&ids, dids).unwrap();
        s.memcpy_htod(&w, dw).unwrap();
        (x, w)
    };
    let (x, w) = load(0, &mut dx, &mut dids, &mut dw);
    enqueue(&mut recv);
    s.synchronize().unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    results.push((
        s.clone_dtoh(&counters).unwrap(),
        round_trip_error(&x, &w, &got),
    ));

    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    enqueue(&mut recv);
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured step");
    for step in 1..=3 {
        let (x, w) = load(step, &mut dx, &mut dids, &mut dw);
        s.memset_zeros(&mut out).unwrap();
        graph.launch().unwrap();
        s.synchronize().unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        results.push((
            s.clone_dtoh(&counters).unwrap(),
            round_trip_error(&x, &w, &got),
        ));
    }
    drop(graph);
    // SAFETY: handle, then group, before the communicator and buffers go.
    unsafe {
        ok("ncclEpHandleDestroy", (ep.handle_destroy)(handle));
        ok("ncclEpGroupDestroy", (ep.group_destroy)(group));
    }
    results
}

#[test]
#[ignore = "needs GPUs, NCCL >= 2.30.4 and libnccl_ep"]
fn ht_padding_rows_are_ignored_and_captured_steps_replay() {
    let Some((world, nccl, ep)) = group_here() else {
        return;
    };
    let id = Comm::unique_id(&nccl).unwrap();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let (nccl, ep) = (nccl.clone(), ep.clone());
            std::thread::spawn(move || padded_rank(nccl, ep, id, world, rank))
        })
        .collect();
    let outs: Vec<Vec<(Vec<i32>, f64)>> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
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
    let raw = s.cu_stream() as nccl_sys::cudaStream_t;
    let comm = Comm::init(nccl, &id, world, rank).unwrap();
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
    let (group, handle, handle_mem) = open_with(&ep, &comm, &cfg, &ncclEpHandleConfig_t::new(), &s);
    let (x, ids, w) = padded_inputs(rank, 7);
    let dx = s.clone_htod(&x).unwrap();
    let dids = s.clone_htod(&ids).unwrap();
    let dw = s.clone_htod(&w).unwrap();
    let mut counters = s.alloc_zeros::<i32>(local).unwrap();
    let mut out = s.alloc_zeros::<bf16>(T_CAP * H).unwrap();
    let mut win_rows = zero_copy.then(|| comm.sym_alloc::<bf16>(local * stride * H, &s).unwrap());
    let mut plain_rows = (!zero_copy).then(|| s.alloc_zeros::<bf16>(local * stride * H).unwrap());
    let mut r_sz = [local, stride, H];
    let mut t_r = match (&mut win_rows, &mut plain_rows) {
        (Some(wr), _) => {
            ncclEpTensor_t::in_window(wr.window(), 0, ncclDataType_t::Bfloat16, &mut r_sz)
        }
        (_, Some(p)) => {
            ncclEpTensor_t::describe(dptr_mut(p, &s), ncclDataType_t::Bfloat16, &mut r_sz)
        }
        _ => unreachable!(),
    };
    let (mut ids_sz, mut x_sz, mut w_sz, mut o_sz, mut cnt_sz) =
        ([T_CAP, K], [T_CAP, H], [T_CAP, K], [T_CAP, H], [local]);
    let t_ids = ncclEpTensor_t::describe(dptr(&dids, &s), ncclDataType_t::Int32, &mut ids_sz);
    let mut t_x = ncclEpTensor_t::describe(dptr(&dx, &s), ncclDataType_t::Bfloat16, &mut x_sz);
    let mut t_w = ncclEpTensor_t::describe(dptr(&dw, &s), ncclDataType_t::Float32, &mut w_sz);
    let mut t_o =
        ncclEpTensor_t::describe(dptr_mut(&mut out, &s), ncclDataType_t::Bfloat16, &mut o_sz);
    let mut t_cnt = ncclEpTensor_t::describe(
        dptr_mut(&mut counters, &s),
        ncclDataType_t::Int32,
        &mut cnt_sz,
    );
    let mut li = ncclEpLayoutInfo_t::new();
    li.expert_counters = &mut t_cnt;
    let mut din = ncclEpDispatchInputs_t::new();
    din.tokens = &mut t_x;
    let mut dout = ncclEpDispatchOutputs_t::new();
    dout.tokens = &mut t_r;
    let mut cin = ncclEpCombineInputs_t::new();
    cin.tokens = &mut t_r;
    let mut cout = ncclEpCombineOutputs_t::new();
    cout.tokens = &mut t_o;
    cout.topk_weights = &mut t_w;
    let (dcfg, ccfg) = (ncclEpDispatchConfig_t::new(), ncclEpCombineConfig_t::new());
    // SAFETY: every descriptor points at live buffers of the extents it states, on this frame.
    ok("ncclEpUpdateHandle (LL)", unsafe {
        (ep.update_handle)(handle, &t_ids, std::ptr::null(), raw)
    });
    // SAFETY: as above.
    let r = unsafe { (ep.dispatch)(handle, &din, &dout, &li, &dcfg, raw) };
    if zero_copy {
        // NCCL EP 0.2: "zero_copy=ON on LL dispatch requires NCCL_EP_LAYOUT_RANK_MAJOR". When a
        // release takes it, this fails and the service's LL path can use windows too.
        assert_eq!(
            r,
            ncclResult_t::INVALID_ARGUMENT,
            "zero-copy LL expert-major dispatch"
        );
        // SAFETY: handle, then group, then the window, before the communicator.
        unsafe {
            ok("ncclEpHandleDestroy", (ep.handle_destroy)(handle));
            ok("ncclEpGroupDestroy", (ep.group_destroy)(group));
        }
        drop((win_rows, plain_rows, handle_mem));
        return (Vec::new(), true, 0.0);
    }
    ok("ncclEpDispatch (LL)", r);
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
    // SAFETY: as above; Combine applies the weights itself in LL expert-major.
    ok("ncclEpCombine (LL)", unsafe {
        (ep.combine)(handle, &cin, &cout, &ccfg, raw)
    });
    s.synchronize().unwrap();
    let worst = round_trip_error(&x, &w, &s.clone_dtoh(&out).unwrap());
    // SAFETY: handle, then group, then the window, before the communicator.
    unsafe {
        ok("ncclEpHandleDestroy", (ep.handle_destroy)(handle));
        ok("ncclEpGroupDestroy", (ep.group_destroy)(group));
    }
    drop((win_rows, plain_rows, handle_mem));
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
        let id = Comm::unique_id(&nccl).unwrap();
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let (nccl, ep) = (nccl.clone(), ep.clone());
                std::thread::spawn(move || ll_rank(nccl, ep, id, world, rank, zero_copy))
            })
            .collect();
        let outs: Vec<(Vec<i32>, bool, f64)> =
            ranks.into_iter().map(|h| h.join().unwrap()).collect();
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
