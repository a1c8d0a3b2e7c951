//! `epserve bench` on the GPUs: one thread per GPU (or one process, `processes`), each rank
//! brought up as the service brings its ranks up (`setup::Device`, random weights), every phase
//! captured as a graph and timed with CUDA events from a start the ranks share on the device;
//! then dense cuBLAS over the same rows.
//! The configs and the summary are `backend::bench`'s (plain numbers, tested without a GPU),
//! the table `crate::bench`'s.

mod around;
mod processes;

use std::time::{Duration, Instant};

use anyhow::Context;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;
use half::bf16;

use crate::backend::bench::{median, summarize, BenchConfig, ConfigResult, Plan, RankResult};
use crate::backend::cuda::experts::DeviceFfn;
use crate::backend::cuda::placement::{Land, Staged, Write};
use crate::backend::cuda::setup::{self, Device};
use crate::backend::cuda::step::{GpuStep, HomeDtype, Variant};
use crate::backend::cuda::{device_count, GpuError};
use crate::backend::device::Seat;
use crate::backend::device::SPLIT_FROM;
use crate::backend::ep_settings::{EpMode, EpSettings, EP_LL_MAX_TOKENS};

/// Each backend of `--backends` as run: `nccl`, and `nccl-ep` once per mode and zero-copy
/// setting, each resolved as the service resolves `--ep-mode` for one bucket of the config's
/// tokens per rank (auto: the service's default threshold).
fn variants(args: &Plan, c: &BenchConfig) -> anyhow::Result<Vec<(String, Option<EpSettings>)>> {
    let mut v = Vec::new();
    for b in &args.backends {
        if b == "nccl" {
            v.push((b.clone(), None));
            continue;
        }
        for &mode in &args.ep_modes {
            for &zc in &args.zero_copy {
                let t = c.tokens_per_rank;
                if mode == EpMode::Ll && t > args.ep_ll_max_tokens {
                    tracing::info!(config = %c.name, "LL skipped: {t} tokens per rank > --ep-ll-max-tokens");
                    continue;
                }
                let (e, note) = EpSettings::resolve(mode, EP_LL_MAX_TOKENS, &[t], zc, c.hidden)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", c.name))?;
                if let Some(n) = note {
                    tracing::info!(config = %c.name, "{n}");
                }
                let ll = e.ll_max > 0;
                // NCCL EP 0.2 has no zero-copy LL in the expert-major layout (LL stages).
                let label = format!(
                    "nccl-ep {}{}",
                    if ll { "LL" } else { "HT" },
                    if e.zero_copy && !ll {
                        ", zero-copy"
                    } else {
                        ""
                    }
                );
                if !v.iter().any(|(l, _)| *l == label) {
                    v.push((label, Some(e)));
                }
            }
        }
    }
    Ok(v)
}

pub fn run(args: &Plan, configs: &[BenchConfig]) -> anyhow::Result<Vec<ConfigResult>> {
    let world = args.ranks.unwrap_or_else(device_count);
    if world == 0 || world > device_count() {
        anyhow::bail!("{world} ranks asked, {} GPUs visible", device_count());
    }
    setup::available().map_err(|e| anyhow::anyhow!(e))?;
    if args.backends.iter().any(|b| b == "nccl-ep") {
        setup::ep_gates(world).map_err(|why| anyhow::anyhow!("nccl-ep cannot run here: {why}"))?;
    }
    let mut runs = Vec::new();
    for c in configs {
        runs.extend(variants(args, c)?.into_iter().map(|v| (c, v)));
    }
    let mut out = Vec::new();
    let runs = runs.into_iter().flat_map(|(c, (label, ep))| {
        (args.overlap.iter()).flat_map(move |&o| {
            let label = label.clone();
            (args.two_batch.iter()).map(move |&t| {
                let label = format!(
                    "{label}{}{}",
                    if o { ", overlap" } else { "" },
                    if t { ", two-batch" } else { "" }
                );
                (c, (label, ep), (o, t))
            })
        })
    });
    let clock_us = match &args.child {
        Some(ch) => ch.clock_us,
        None => unix_us(),
    };
    for (run, (c, (backend, ep), (overlap, two_batch))) in runs.enumerate() {
        let slots = c.experts + c.eplb.unwrap_or(0);
        if slots % world != 0 {
            anyhow::bail!("{}: {slots} expert slots over {world} ranks", c.name);
        }
        let how = (ep, overlap, two_batch);
        if let Some(ch) = args.child.as_ref().filter(|ch| ch.run == run) {
            let r = rank_main(&ch.id, world, ch.rank, c, args, how, clock_us)?;
            std::fs::write(&ch.file, serde_json::to_vec(&r)?)
                .with_context(|| format!("writing {}", ch.file.display()))?;
        }
        if args.child.is_some() {
            continue;
        }
        let id = setup::new_unique_id()?;
        let ranks = match args.processes {
            true => processes::run(run, &id, world, clock_us),
            false => threads(&id, world, c, args, how, clock_us),
        }
        .with_context(|| format!("config {}", c.name))?;
        let summary = summarize(c, &ranks);
        tracing::info!(config = %c.name, %backend, ?summary, "measured");
        out.push(ConfigResult {
            config: c.clone(),
            backend,
            overlap,
            two_batch,
            world,
            iters: args.iters,
            ranks,
            summary,
        });
    }
    Ok(out)
}

type Phase = fn(&mut GpuStep, usize, Variant) -> Result<(), GpuError>;

/// The step a bf16 client's request runs (as the load generator sends them): rows in bf16,
/// routed on the GPU.
const BF16_ROWS: Variant = Variant::new(HomeDtype::Bf16, false);
/// `--skew`'s step: bf16 rows with the drawn routing, as a client that routes its own sends.
const SKEWED: Variant = Variant::new(HomeDtype::Bf16, true);

/// Each rank a thread of this process.
fn threads(
    id: &[u8],
    world: usize,
    c: &BenchConfig,
    args: &Plan,
    how: (Option<EpSettings>, bool, bool),
    clock_us: u64,
) -> anyhow::Result<Vec<RankResult>> {
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let (id, c, a) = (id.to_vec(), c.clone(), args.clone());
            std::thread::spawn(move || rank_main(&id, world, rank, &c, &a, how, clock_us))
        })
        .collect();
    let mut ranks = Vec::new();
    for t in threads {
        let r = t
            .join()
            .map_err(|_| anyhow::anyhow!("a bench rank panicked"))?;
        ranks.push(r?);
    }
    Ok(ranks)
}

/// µs since the Unix epoch: one clock for the ranks' launch times, threads or processes.
fn unix_us() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| d.as_micros() as u64)
}

/// One rank, brought up as the service brings its ranks up (`setup::Device`), with random
/// weights: GPU `rank`, one bucket of the config's tokens per rank.
fn rank_main(
    id: &[u8],
    world: usize,
    rank: usize,
    c: &BenchConfig,
    args: &Plan,
    (ep, overlap, two_batch): (Option<EpSettings>, bool, bool),
    clock_us: u64,
) -> anyhow::Result<RankResult> {
    let seat = Seat {
        ordinal: rank,
        place: crate::place::Place { rank, world },
        max_home: c.tokens_per_rank,
        ep,
        overlap: if overlap { usize::MAX } else { 0 },
        split: if two_batch { SPLIT_FROM } else { usize::MAX },
    };
    let slots = crate::backend::bench::eplb_slots(c, world).map_err(|e| anyhow::anyhow!(e))?;
    let dev = Device::random(seat, &c.spec(), c.expert_dtype, 7, slots.clone())?;
    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut core, mut a) = dev.connect(id, deadline, vec![true; world], &[])?;
    let shape = core.shape;
    let t = c.tokens_per_rank;
    let s = core.g.stream.clone();
    s.memcpy_htod(&[t as i32], &mut core.b.n)?;
    // Random rows, in the form the timed step reads them (`BF16_ROWS`); with --skew, each
    // token's experts drawn on the host and sent as a client's routing.
    core.g
        .fill_uniform_bf16(&mut core.b.xb, 1000 + rank as u64, 1.0)?;
    let routing = c
        .skew
        .map(|_| crate::backend::bench::skewed_routing(c, rank));
    let v = match &routing {
        Some((ids, w)) => {
            s.memcpy_htod(ids, &mut core.b.ids)?;
            s.memcpy_htod(w, &mut core.b.w)?;
            SKEWED
        }
        None => BF16_ROWS,
    };
    let mut around = match args.gap_copies {
        true => {
            let client = routing.as_ref().map(|(i, w)| (&i[..], &w[..]));
            Some(around::Around::new(&mut core, t, v, client)?)
        }
        false => None,
    };
    for _ in 0..args.warmup.max(1) {
        core.run(0, t, v)?;
    }
    s.synchronize()?;

    let phases: [Phase; 5] = [
        |c, t, v| c.gate(0, t, v),
        |c, t, _| c.prepare(t),
        |c, t, _| c.dispatch(t),
        |c, t, _| c.experts(0, t),
        |c, t, _| c.combine(0, t),
    ];
    let step = core.capture(|c| c.run(0, t, v))?;
    let graphs = phases
        .iter()
        .map(|&f| core.capture(|c| f(c, t, v)))
        .collect::<Result<Vec<_>, _>>()?;
    let ctx = core.g.ctx.clone();
    let ev = (0..6)
        .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
        .collect::<Result<Vec<CudaEvent>, _>>()?;
    let us = |a: &CudaEvent, b: &CudaEvent| -> anyhow::Result<f64> {
        Ok(f64::from(a.elapsed_ms(b)?) * 1e3)
    };
    for _ in 0..args.warmup {
        step.launch()?;
    }
    // Each timed step starts on every rank together: a one-int all-gather on the device first
    // (as the anchors' peers align their ranks), so no rank's time holds another's host wake-up.
    let one = s.clone_htod(&[rank as i32])?;
    let mut all = s.alloc_zeros::<i32>(world)?;
    let mut align = |core: &GpuStep| core.comm.all_gather(&one, &mut all, 1, &s);
    // With a gap, no all-gather: the step is the first work after the idle on every rank, and
    // a rank that waits for a late peer's host is left out by the group's least time. Each
    // launch's host time (one clock for every rank, thread or process) says how late each rank
    // came.
    let (mut launch_at_us, mut phase_launch_at_us) = (Vec::new(), Vec::new());
    let mut spread = crate::model::synthetic::SplitMix(0x9a9 ^ rank as u64);
    let mut start = |core: &GpuStep, at: &mut Vec<f64>| -> anyhow::Result<()> {
        match args.gap_us {
            Some(g) => {
                let extra = (spread.unit() * (args.gap_spread_us + 1) as f64) as u64;
                std::thread::sleep(Duration::from_micros(g + extra));
                at.push(unix_us().saturating_sub(clock_us) as f64);
            }
            None => align(core)?,
        }
        Ok(())
    };
    let mut steps = Vec::with_capacity(args.iters);
    // The host's time from the first event's record to the launch's return: the most the
    // timed span can hold of the GPU waiting for the host to enqueue the step.
    let mut enqueue_us = Vec::new();
    for _ in 0..args.iters {
        start(&core, &mut launch_at_us)?;
        if let Some(a) = &mut around {
            a.rows_in(&mut core)?;
        }
        let t = Instant::now();
        ev[0].record(&s)?;
        match &mut around {
            Some(a) => a.step(&mut core, || step.launch())?,
            None => step.launch()?,
        }
        if args.gap_us.is_some() {
            enqueue_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        ev[1].record(&s)?;
        if let Some(a) = &mut around {
            a.rows_out(&mut core)?;
        }
        if args.gap_poll {
            // As a serving rank waits for its step: `cuEventQuery` in a spin, then naps.
            let bound = Duration::from_secs(10);
            crate::backend::cuda::rank::wait_event(&ev[1], Instant::now(), bound, None)?;
        }
        s.synchronize()?;
        if let Some(a) = &around {
            a.synchronize()?;
        }
        steps.push(us(&ev[0], &ev[1])?);
    }
    let step_samples_us = match args.gap_us {
        Some(_) => steps.clone(),
        None => Vec::new(),
    };
    let mut per_phase: Vec<Vec<f64>> = (0..5).map(|_| Vec::with_capacity(args.iters)).collect();
    for _ in 0..args.iters {
        start(&core, &mut phase_launch_at_us)?;
        ev[0].record(&s)?;
        for (i, g) in graphs.iter().enumerate() {
            g.launch()?;
            ev[i + 1].record(&s)?;
        }
        s.synchronize()?;
        for (i, v) in per_phase.iter_mut().enumerate() {
            v.push(us(&ev[i], &ev[i + 1])?);
        }
    }

    // The first move: the slots the placement rewrites against contiguous blocks, copied in on
    // the step's stream before a step, as a rebalance does.
    let mut moved = (0, 0, f64::NAN, f64::NAN);
    if let (Some(m), Some(r)) = (&slots, c.eplb) {
        let start = crate::eplb::SlotMap::contiguous(c.experts, world, r, 1)
            .map_err(|e| anyhow::anyhow!(e))?;
        let first = m.slots_of(rank).start;
        let (h, i) = (c.hidden, c.inter);
        let mut rewritten = Vec::new();
        for slot in start.changed(m, rank).remove(0) {
            let w =
                DeviceFfn::random(&core.g, &mut a, (1, h, i), 50 + slot as u64, c.expert_dtype)?;
            rewritten.push((0, slot - first, w));
        }
        let bytes = rewritten.iter().map(|(_, _, w)| w.bytes()).sum();
        let mut staged = Staged::new(0, std::sync::Arc::new(m.clone()), rewritten, s.clone());
        core.table_from(&start, m, &crate::eplb::parts::plan(&start, m, None))?;
        let every: Vec<Write> = (0..staged.slots.len()).map(Write::Staged).collect();
        let (mut copy, mut with) = (Vec::new(), Vec::new());
        for it in 0..args.warmup + args.iters {
            align(&core)?;
            ev[0].record(&s)?;
            core.copy(&mut staged, &every, &s)?;
            core.rows(0, 0, &s)?;
            ev[1].record(&s)?;
            step.launch()?;
            ev[2].record(&s)?;
            s.synchronize()?;
            if it >= args.warmup {
                copy.push(us(&ev[0], &ev[1])?);
                with.push(us(&ev[0], &ev[2])?);
            }
        }
        moved = (
            staged.slots.len(),
            bytes,
            median(&mut copy),
            median(&mut with),
        );
    }

    // What moved: from the all-gathered counts of the last step.
    let m = s.clone_dtoh(&core.b.m)?;
    // Slots (experts plus redundant ones) in rank order.
    let (e, l) = (shape.experts, shape.local());
    let mine = rank * l..(rank + 1) * l;
    let from = |src: usize| -> usize { mine.clone().map(|x| m[src * e + x] as usize).sum() };
    let recv_rows_self = from(rank);
    let recv_rows_remote: usize = (0..world).filter(|&r| r != rank).map(from).sum();
    let combine_rows_remote = (0..e)
        .filter(|x| !mine.contains(x))
        .map(|x| m[rank * e + x] as usize)
        .sum();
    // The slots move their worst case; what NCCL EP moves is its own (not counted: 0).
    let wire_bytes = match ep {
        Some(_) => 0,
        None => (world - 1) * shape.slot_rows(t) * shape.slot_row_bytes(),
    };

    // Dense cuBLAS: the same FFN FLOPs as one expert over all the rows this rank received,
    // on random data scaled as the layer's (tensor cores on zeros draw less power and clock
    // higher, which would flatter the yardstick).
    let rows: usize = (recv_rows_remote + recv_rows_self).max(1);
    let (h, i) = (c.hidden, c.inter);
    let mut x = a.zeros::<bf16>(rows * h)?;
    let mut w1 = a.zeros::<bf16>(2 * i * h)?;
    let mut w2 = a.zeros::<bf16>(h * i)?;
    core.g.fill_uniform_bf16(&mut x, 2000 + rank as u64, 1.0)?;
    core.g
        .fill_uniform_bf16(&mut w1, 3000 + rank as u64, (3.0 / h as f32).sqrt())?;
    core.g
        .fill_uniform_bf16(&mut w2, 4000 + rank as u64, (3.0 / i as f32).sqrt())?;
    let mut y1 = a.zeros::<bf16>(rows * 2 * i)?;
    let mut y2 = a.zeros::<bf16>(rows * h)?;
    let mut dense = Vec::with_capacity(args.iters);
    for it in 0..args.warmup + args.iters {
        ev[0].record(&s)?;
        // Row-major Y [rows, n] = X [rows, k] . W [n, k]^T: the gate/up projection, then the
        // down projection over the first i columns' worth of the same buffers.
        core.g.gemm_bf16(&w1, &x, (rows, 2 * i, h), &mut y1)?;
        core.g.gemm_bf16(&w2, &y1, (rows, h, i), &mut y2)?;
        ev[1].record(&s)?;
        s.synchronize()?;
        if it >= args.warmup {
            dense.push(us(&ev[0], &ev[1])?);
        }
    }
    drop((step, graphs));
    let phase_samples_us = match args.gap_us {
        Some(_) => per_phase.clone(),
        None => Vec::new(),
    };
    let mut p = per_phase.into_iter().map(|mut v| median(&mut v));
    let mut next = || p.next().unwrap_or(f64::NAN);
    Ok(RankResult {
        rank,
        step_us: median(&mut steps),
        gating_us: next(),
        prepare_us: next(),
        dispatch_us: next(),
        experts_us: next(),
        combine_us: next(),
        recv_rows_remote,
        recv_rows_self,
        combine_rows_remote,
        wire_bytes,
        dense_us: median(&mut dense),
        dense_rows: rows,
        moved_slots: moved.0,
        moved_bytes: moved.1,
        move_us: moved.2,
        step_with_move_us: moved.3,
        step_samples_us,
        launch_at_us,
        enqueue_us,
        phase_samples_us,
        phase_launch_at_us,
    })
}
