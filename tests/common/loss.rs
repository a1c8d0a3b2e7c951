//! Losing a rank under load (`--on-rank-loss continue`, #55), as the cpu and GPU tests drill
//! it: a DeepSeek-V3-shaped FP8 checkpoint written by the test, 32 clients of steady load
//! checking every token against the f64 reference, and what the group must show after.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::checkpoint::{fp8_reference, write_model, Arch};
use super::prom::{scrape, sum};
use super::reference::{compare_tokens, RefLayer};
use super::*;
use epserve::model::MoeSpec;
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::GetModelInfoRequest;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::transport::Channel;

pub const CLIENTS: u64 = 32;
pub const SEED: u64 = 55;
/// The test checkpoint's hidden size; NCCL EP's low-latency kernels need a multiple of 512.
pub const HIDDEN: usize = 256;
pub const HIDDEN_LL: usize = 2048;

/// One group under load at a time: on a 2-core machine, two would measure each other.
pub static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the clients saw.
#[derive(Default)]
pub struct Tally {
    pub answers: AtomicUsize,
    pub tokens: AtomicUsize,
    pub excluded: AtomicUsize,
    pub failures: Mutex<Vec<String>>,
    /// Each answer's (sent, answered) instants.
    pub spans: Mutex<Vec<(Instant, Instant)>>,
}

/// Stops the clients and waits for each to finish its request in flight.
pub async fn stop_load(stop: &AtomicBool, clients: Vec<tokio::task::JoinHandle<()>>) {
    stop.store(true, Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }
}

impl Tally {
    /// No request failed and no token was off (the first five said, with `logs`).
    pub fn none_failed(&self, logs: &str) {
        let failures = self.failures.lock().unwrap().clone();
        assert!(
            failures.is_empty(),
            "{} failed: {:?}\n{logs}",
            failures.len(),
            &failures[..failures.len().min(5)],
        );
    }

    /// The longest wait of a request answered after `at`, counted from `at` or its sending,
    /// whichever came later: how long the group took to serve again.
    pub fn longest_after(&self, at: Instant) -> Duration {
        let spans = self.spans.lock().unwrap();
        (spans.iter())
            .filter(|(_, done)| *done > at)
            .map(|&(sent, done)| done - sent.max(at))
            .max()
            .unwrap_or_default()
    }
}

/// Steady load: each client sends 8-24 random tokens on each MoE layer in turn and checks
/// every token of every answer against the reference (within `tol`), until `stop`.
pub async fn load_on(
    group: &Group,
    (spec, refs): (Arc<MoeSpec>, Arc<Vec<RefLayer>>),
    tol: f64,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let (spec, refs, stop, tally) = (spec.clone(), refs.clone(), stop.clone(), tally.clone());
        let mut c = group.client().await;
        clients.push(tokio::spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(SEED + 100 + i);
            let mut sent = 0usize;
            while !stop.load(Ordering::Acquire) {
                let slot = sent % spec.moe_layers.len();
                let n = 8 + rng.random_range(0..17usize);
                let x: Vec<f32> = (0..n * spec.hidden)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let id = format!("c{i}-{sent}");
                sent += 1;
                let t0 = Instant::now();
                let req = request(&id, spec.moe_layers[slot], f32_tensor(&x, [n, spec.hidden]));
                let out = match c.forward(req).await {
                    Ok(r) => decode(r.into_inner().output.as_ref().unwrap()),
                    Err(e) => {
                        tally.failures.lock().unwrap().push(format!("{id}: {e:?}"));
                        return;
                    }
                };
                tally.spans.lock().unwrap().push((t0, Instant::now()));
                let xs: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
                let (err, token, excluded) = compare_tokens(&spec, &refs[slot], &xs, &out, None);
                if err > tol {
                    let zero = out.iter().filter(|&&v| v == 0.0).count();
                    let msg = format!(
                        "{id}: token {token} is {err:.3e} off ({n} tokens, {zero} of {} values 0, sent {:?} after the start)",
                        out.len(),
                        t0.elapsed()
                    );
                    tally.failures.lock().unwrap().push(msg);
                }
                tally.answers.fetch_add(1, Ordering::Relaxed);
                tally.tokens.fetch_add(n, Ordering::Relaxed);
                tally.excluded.fetch_add(excluded, Ordering::Relaxed);
            }
        }));
    }
    clients
}

pub async fn model_info(c: &mut MoeServiceClient<Channel>) -> epserve::proto::ModelInfo {
    c.get_model_info(GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// A DeepSeek-V3-shaped FP8 checkpoint (16 experts, 3 layers) and its f64 reference.
pub fn checkpoint(tag: &str) -> (TempDir, MoeSpec, Vec<RefLayer>) {
    checkpoint_for(tag, true, HIDDEN)
}

/// The same, with the reference of experts served in FP8 (DeepSeek-V3's recipe: the shared
/// expert quantized too) or, `fp8` false, in bf16 (the checkpoint's values as they are); rows
/// of `hidden`.
pub fn checkpoint_for(tag: &str, fp8: bool, hidden: usize) -> (TempDir, MoeSpec, Vec<RefLayer>) {
    let dir = TempDir::new(tag);
    let a = Arch {
        hidden,
        ..Arch::deepseek_fp8_128(3)
    };
    let (spec, mut refs) = write_model(&dir.0, &a, SEED);
    if fp8 {
        fp8_reference(&mut refs, &a);
    }
    (dir, spec, refs)
}

/// A group that goes on without a lost rank, on a checkpoint of its own, under the steady load.
pub struct Loaded {
    pub _dir: TempDir,
    pub group: Group,
    /// Each rank's `/metrics` address.
    pub metrics: Vec<String>,
    pub c: MoeServiceClient<Channel>,
    pub spec: Arc<MoeSpec>,
    pub stop: Arc<AtomicBool>,
    pub tally: Arc<Tally>,
    pub clients: Vec<tokio::task::JoinHandle<()>>,
}

impl Loaded {
    /// `world` ranks started with `flags` (every one live, going on without a lost rank),
    /// each token of the load checked within `tol` of the (`fp8`) reference, rows of `hidden`.
    pub async fn start(
        tag: &str,
        world: usize,
        flags: &[&str],
        (tol, fp8, hidden): (f64, bool, usize),
    ) -> Self {
        let (dir, spec, refs) = checkpoint_for(tag, fp8, hidden);
        let group = Group::launch(world, &dir.0.display().to_string(), flags);
        let metrics = group.metrics_addrs(world);
        let mut c = group.client().await;
        let info = model_info(&mut c).await;
        assert_eq!(info.on_rank_loss, "continue", "{}", group.proc.log_text());
        assert_eq!(info.live_ranks, (0..world as u32).collect::<Vec<_>>());
        let (spec, refs) = (Arc::new(spec), Arc::new(refs));
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let load = (spec.clone(), refs);
        let clients = load_on(&group, load, tol, stop.clone(), tally.clone()).await;
        Self {
            _dir: dir,
            group,
            metrics,
            c,
            spec,
            stop,
            tally,
            clients,
        }
    }
}

/// A loss under load: a group of `world` ranks started with `flags`, `ranks` lost by `sig`.
pub struct Drill<'a> {
    pub tag: &'a str,
    pub world: usize,
    pub flags: &'a [&'a str],
    pub ranks: &'a [usize],
    pub sig: &'a str,
    /// The longest an answer may wait after the loss.
    pub bound: Duration,
    /// The largest error of a token against the f64 reference.
    pub tol: f64,
    /// The experts run in FP8 (the reference follows DeepSeek-V3's recipe), else bf16 or f32.
    pub fp8: bool,
    /// The checkpoint's hidden size.
    pub hidden: usize,
}

/// Loses `d.ranks` by `d.sig` under load: no request fails or is off, the answers' longest
/// delay after the loss is within `d.bound`, the ranks left serve every expert, the metrics say
/// so. Returns the leader's recovery line.
pub async fn lose_under_load(d: &Drill<'_>) -> String {
    let (ranks, sig, bound, world) = (d.ranks, d.sig, d.bound, d.world);
    let _alone = ONE_AT_A_TIME.lock().await;
    let Loaded {
        _dir,
        group,
        metrics,
        mut c,
        spec,
        stop,
        tally,
        clients,
    } = Loaded::start(d.tag, world, d.flags, (d.tol, d.fp8, d.hidden)).await;

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = tally.answers.load(Ordering::Relaxed);
    assert!(before > 0, "no answers before the loss");
    let pids: Vec<u32> = ranks.iter().map(|&r| group.proc.rank_pid(r)).collect();
    let lost_at = Instant::now();
    for &pid in &pids {
        kill(pid, sig);
    }
    let lost: Vec<u32> = ranks.iter().map(|&r| r as u32).collect();
    // Serving again: answers keep coming after the loss is dealt with.
    let end = lost_at + bound + Duration::from_secs(30);
    loop {
        let info = model_info(&mut c).await;
        if info.lost_ranks == lost {
            break;
        }
        assert!(
            Instant::now() < end,
            "ranks {ranks:?} never lost\n{}",
            group.proc.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_load(&stop, clients).await;
    if sig == "STOP" {
        // Fenced by the leader: a stopped rank never wakes to write into a survivor's segment.
        for (&rank, &pid) in ranks.iter().zip(&pids) {
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists()
                    || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .unwrap_or_default()
                        .contains(") Z"),
                "the stopped rank {rank} (pid {pid}) is still there"
            );
        }
    }
    tally.none_failed(&group.proc.log_text());
    let (answers, tokens) = (
        tally.answers.load(Ordering::Relaxed),
        tally.tokens.load(Ordering::Relaxed),
    );
    let excluded = tally.excluded.load(Ordering::Relaxed);
    assert!(
        answers > before && excluded * 100 <= tokens,
        "{answers} answers ({before} before the loss), {excluded} of {tokens} near-ties"
    );
    let after: usize = (tally.spans.lock().unwrap().iter())
        .filter(|(sent, _)| *sent > recovered_at)
        .count();
    assert!(after > 0, "no request sent after the recovery was answered");
    let longest = tally.longest_after(lost_at);
    assert!(
        longest <= bound,
        "an answer waited {longest:?} after the loss (bound {bound:?})\n{}",
        group.proc.log_text()
    );
    let info = model_info(&mut c).await;
    let live: Vec<u32> = (0..world as u32).filter(|r| !lost.contains(r)).collect();
    assert_eq!(info.live_ranks, live);
    assert_eq!(info.group_epoch, 1);
    // Every expert is served by a rank left.
    for l in &info.layer_placement {
        let per = info.slots_per_rank as usize;
        let mut held = vec![false; spec.num_experts];
        for (s, &g) in l.phy2log.iter().enumerate() {
            if !lost.contains(&((s / per) as u32)) {
                held[g as usize] = true;
            }
        }
        assert!(
            held.iter().all(|&h| h),
            "layer {}: {:?}",
            l.layer,
            l.phy2log
        );
    }
    let m = scrape(&metrics[0]);
    let n = ranks.len() as f64;
    assert_eq!(
        sum(&m, "epserve_group_ranks", &[("state", "live")]),
        world as f64 - n
    );
    assert_eq!(sum(&m, "epserve_group_ranks", &[("state", "lost")]), n);
    assert_eq!(sum(&m, "epserve_rank_losses_total", &[]), n);
    assert_eq!(sum(&m, "epserve_recovery_seconds_count", &[]), 1.0);
    let usual = (tally.spans.lock().unwrap().iter())
        .filter(|(_, done)| *done < lost_at)
        .map(|&(sent, done)| done - sent)
        .max()
        .unwrap_or_default();
    let phases = (group.proc.log_text().lines())
        .find(|l| l.contains("the group goes on") && l.contains("total_ms"))
        .map(|l| l[l.find("epoch=").unwrap_or(0)..].to_string())
        .unwrap_or_default();
    eprintln!("ranks {ranks:?} lost by SIG{sig}, the leader: {phases}");
    eprintln!(
        "ranks {ranks:?} lost by SIG{sig}: {answers} answers of {tokens} tokens ({before} before), none failed; longest answer delay after the loss {longest:?} (before it: {usual:?})"
    );
    phases
}

/// The restarted rank's command line: the killed process's own (`/proc/PID/cmdline`), its
/// environment as the tests' (a GPU rank's device follows from its rank).
fn command_line(pid: u32) -> Vec<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    (cmdline.split(|&b| b == 0))
        .skip(1)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8(a.to_vec()).unwrap())
        .collect()
}

/// Kills rank `rank` of `world` under load and starts it again with its command line: it
/// rejoins (the group whole again, epoch 2), computes rows, and no request of the steady load
/// fails or is off (`tol`). Returns the leader's rejoin line.
pub async fn lose_and_rejoin(
    tag: &str,
    (world, rank): (usize, usize),
    flags: &[&str],
    (tol, fp8, hidden): (f64, bool, usize),
) -> String {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Loaded {
        _dir,
        group,
        metrics,
        mut c,
        stop,
        tally,
        clients,
        ..
    } = Loaded::start(tag, world, flags, (tol, fp8, hidden)).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let pid = group.proc.rank_pid(rank);
    let args = command_line(pid);
    kill(pid, "KILL");
    let until = |want: Vec<u32>, what: &'static str| {
        let mut c = c.clone();
        let log = group.proc.log.clone();
        async move {
            let end = Instant::now() + Duration::from_secs(60);
            while model_info(&mut c).await.live_ranks != want {
                let logs = || log.lock().unwrap().join("\n");
                assert!(Instant::now() < end, "{what}\n{}", logs());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let all: Vec<u32> = (0..world as u32).collect();
    let left: Vec<u32> = (0..world as u32).filter(|&r| r as usize != rank).collect();
    until(left, "the killed rank was never lost").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut back = Proc::spawn(&args);
    let asked = Instant::now();
    until(all, "the restarted rank never rejoined").await;
    let rejoined = asked.elapsed();
    let at = back
        .wait_for(" metrics on http://", Duration::from_secs(5))
        .unwrap();
    let at = at
        .split_whitespace()
        .next()
        .unwrap()
        .trim_end_matches("/metrics");
    let steps_before = sum(&scrape(at), "epserve_steps_total", &[]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let steps_after = sum(&scrape(at), "epserve_steps_total", &[]);
    stop_load(&stop, clients).await;
    let logs = || format!("{}\n{}", group.proc.log_text(), back.log_text());
    tally.none_failed(&logs());
    assert!(
        steps_after > steps_before,
        "the rejoined rank ran no step ({steps_before} then {steps_after})\n{}",
        logs()
    );
    let info = model_info(&mut c).await;
    assert_eq!(
        (info.group_epoch, info.lost_ranks.len()),
        (2, 0),
        "{}",
        logs()
    );
    let m = scrape(&metrics[0]);
    assert_eq!(
        sum(&m, "epserve_group_ranks", &[("state", "live")]),
        world as f64
    );
    assert_eq!(sum(&m, "epserve_rank_losses_total", &[]), 1.0);
    let answers = tally.answers.load(Ordering::Relaxed);
    let line = (group.proc.log_text().lines())
        .find(|l| l.contains("rejoined the group") && l.contains("total_ms"))
        .map(|l| l[l.find("epoch=").unwrap_or(0)..].to_string())
        .unwrap_or_default();
    eprintln!(
        "rank {rank} killed, restarted and back in {rejoined:?}: {answers} answers, none failed; it ran {} steps in the 2 s after; the leader: {line}",
        steps_after - steps_before
    );
    drop(group);
    let _ = back.wait_exit(Duration::from_secs(10));
    line
}
