//! Losing a rank under load (`--on-rank-loss continue`, #55) on the cpu backend: 4 ranks of a
//! DeepSeek-V3-shaped FP8 checkpoint written by the test, 32 clients of steady load checking
//! every token against the f64 reference. kill -9 of rank 2, or SIGSTOP of rank 3: no request
//! fails, every answer stays within 1e-5 per token, the longest answer delay stays within the
//! bound (3 s after a kill; --step-timeout + 3 s after a stop), GetModelInfo and the metrics
//! show the three ranks left. A loss the ranks left have no room for ends the group, saying why.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::checkpoint::{fp8_reference, write_model, Arch};
use common::prom::{scrape, sum};
use common::reference::{compare_tokens, RefLayer};
use common::*;
use epserve::model::MoeSpec;
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::GetModelInfoRequest;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::transport::Channel;

const RANKS: usize = 4;
const CLIENTS: u64 = 32;
const SEED: u64 = 55;
/// Two redundant slots per rank: each rank holds its block and the next block's first two
/// experts, so the ranks left after any one loss have room for the lost rank's experts.
const FLAGS: &[&str] = &[
    "--redundant-experts",
    "8",
    "--step-timeout",
    "2s",
    "--heartbeat-interval",
    "200ms",
    "--max-tokens-per-step",
    "128",
    // The tests say when a rank comes back (`launch` would start a lost rank again itself).
    "--rank-restarts",
    "0",
];

/// One group under load at a time: on a 2-core machine, two would measure each other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the clients saw.
#[derive(Default)]
struct Tally {
    answers: AtomicUsize,
    tokens: AtomicUsize,
    excluded: AtomicUsize,
    failures: Mutex<Vec<String>>,
    /// Each answer's (sent, answered) instants.
    spans: Mutex<Vec<(Instant, Instant)>>,
}

/// Stops the clients and waits for each to finish its request in flight.
async fn stop_load(stop: &AtomicBool, clients: Vec<tokio::task::JoinHandle<()>>) {
    stop.store(true, Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }
}

impl Tally {
    /// No request failed and no token was off (the first five said, with `logs`).
    fn none_failed(&self, logs: &str) {
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
    fn longest_after(&self, at: Instant) -> Duration {
        let spans = self.spans.lock().unwrap();
        (spans.iter())
            .filter(|(_, done)| *done > at)
            .map(|&(sent, done)| done - sent.max(at))
            .max()
            .unwrap_or_default()
    }
}

/// Steady load: each client sends 8-24 random tokens on each MoE layer in turn and checks
/// every token of every answer against the reference, until `stop`.
async fn load(
    group: &Group,
    spec: Arc<MoeSpec>,
    refs: Arc<Vec<RefLayer>>,
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
                if err > 1e-5 {
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

async fn model_info(c: &mut MoeServiceClient<Channel>) -> epserve::proto::ModelInfo {
    c.get_model_info(GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner()
}

fn checkpoint(tag: &str) -> (TempDir, MoeSpec, Vec<RefLayer>) {
    let dir = TempDir::new(tag);
    let a = Arch::deepseek_fp8_128(3);
    let (spec, mut refs) = write_model(&dir.0, &a, SEED);
    fp8_reference(&mut refs, &a);
    (dir, spec, refs)
}

/// Loses `ranks` by `sig` under load (the group started with `flags`); the answers' longest
/// delay after it within `bound`.
async fn lose_under_load(tag: &str, flags: &[&str], ranks: &[usize], sig: &str, bound: Duration) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let (dir, spec, refs) = checkpoint(tag);
    let group = Group::launch(RANKS, &dir.0.display().to_string(), flags);
    let metrics = group.metrics_addrs(RANKS);
    let mut c = group.client().await;
    let info = model_info(&mut c).await;
    assert_eq!(info.on_rank_loss, "continue", "{}", group.proc.log_text());
    assert_eq!(info.live_ranks, [0, 1, 2, 3]);
    let (spec, refs) = (Arc::new(spec), Arc::new(refs));
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let clients = load(&group, spec.clone(), refs, stop.clone(), tally.clone()).await;

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
    let live: Vec<u32> = (0..RANKS as u32).filter(|r| !lost.contains(r)).collect();
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
        4.0 - n
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_is_left_behind_and_no_request_fails() {
    lose_under_load("loss-kill", FLAGS, &[2], "KILL", Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_rank_is_fenced_and_no_request_fails() {
    // --step-timeout 2s, then 3 s.
    lose_under_load("loss-stop", FLAGS, &[3], "STOP", Duration::from_secs(5)).await;
}

/// Two simulated nodes of two ranks each: the second node's ranks are killed together; the
/// router's node (ranks 0 and 1, 8 slots each) takes every expert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_is_left_behind_and_no_request_fails() {
    let mut flags = FLAGS.to_vec();
    flags[1] = "16";
    flags.extend(["--nodes", "2"]);
    lose_under_load("loss-node", &flags, &[2, 3], "KILL", Duration::from_secs(3)).await;
}

/// The killed rank restarted with its command line rejoins: the group is whole again (epoch 2),
/// the restarted rank computes rows, and no request of the steady load fails or is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_restarted_rejoins_and_no_request_fails() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let (dir, spec, refs) = checkpoint("loss-rejoin");
    let group = Group::launch(RANKS, &dir.0.display().to_string(), FLAGS);
    let metrics = group.metrics_addrs(RANKS);
    let mut c = group.client().await;
    let (spec, refs) = (Arc::new(spec), Arc::new(refs));
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let clients = load(&group, spec.clone(), refs, stop.clone(), tally.clone()).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let pid = group.proc.rank_pid(2);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = (cmdline.split(|&b| b == 0))
        .skip(1)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8(a.to_vec()).unwrap())
        .collect();
    kill(pid, "KILL");
    let until = |want: Vec<u32>, what: &'static str| {
        let mut c = c.clone();
        async move {
            let end = Instant::now() + Duration::from_secs(60);
            while model_info(&mut c).await.live_ranks != want {
                assert!(Instant::now() < end, "{what}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    until(vec![0, 1, 3], "rank 2 never lost").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut back = Proc::spawn(&args);
    let asked = Instant::now();
    until(vec![0, 1, 2, 3], "rank 2 never rejoined").await;
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
    tally.none_failed(&format!("{}\n{}", group.proc.log_text(), back.log_text()));
    assert!(
        steps_after > steps_before,
        "the rejoined rank ran no step ({steps_before} then {steps_after})\n{}",
        back.log_text()
    );
    let info = model_info(&mut c).await;
    assert_eq!(
        (info.group_epoch, info.lost_ranks.len()),
        (2, 0),
        "{}\n{}",
        group.proc.log_text(),
        back.log_text()
    );
    let m = scrape(&metrics[0]);
    assert_eq!(sum(&m, "epserve_group_ranks", &[("state", "live")]), 4.0);
    assert_eq!(sum(&m, "epserve_rank_losses_total", &[]), 1.0);
    let answers = tally.answers.load(Ordering::Relaxed);
    eprintln!(
        "rank 2 killed, restarted and back in {rejoined:?}: {answers} answers, none failed; it ran {} steps in the 2 s after",
        steps_after - steps_before
    );
    drop(group);
    let _ = back.wait_exit(Duration::from_secs(10));
}

/// `launch` starts a killed rank again by itself (`--rank-restarts`, default 3): it rejoins,
/// and the group answers before, during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_starts_a_lost_rank_again_and_it_rejoins() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let (dir, spec, refs) = checkpoint("loss-restart");
    let flags = &FLAGS[..FLAGS.len() - 2];
    let mut group = Group::launch(RANKS, &dir.0.display().to_string(), flags);
    let mut c = group.client().await;
    let mut rng = ChaCha8Rng::seed_from_u64(SEED + 7);
    let mut exact = async |c: &mut MoeServiceClient<Channel>, id: &str| {
        let n = 16;
        let x: Vec<f32> = (0..n * spec.hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let out = forward_f32(c, id, spec.moe_layers[0], &x, spec.hidden).await;
        let xs: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let (err, token, _) = compare_tokens(&spec, &refs[0], &xs, &out, None);
        assert!(err <= 1e-5, "{id}: token {token} is {err:.3e} off");
    };
    exact(&mut c, "before").await;
    let killed = Instant::now();
    kill(group.proc.rank_pid(1), "KILL");
    group
        .proc
        .wait_for("the group goes on", Duration::from_secs(30))
        .unwrap();
    exact(&mut c, "without").await;
    group
        .proc
        .wait_for("rejoined the group", Duration::from_secs(60))
        .unwrap();
    let back = killed.elapsed();
    let info = model_info(&mut c).await;
    assert_eq!((info.live_ranks.len(), info.group_epoch), (4, 2));
    for i in 0..4 {
        exact(&mut c, &format!("after-{i}")).await;
    }
    assert!(group.proc.log_text().contains("started again"));
    eprintln!("rank 1 killed, started again by launch and back in {back:?}");
}

/// After one loss the ranks left have no room for a second one's experts: the group ends, and
/// its leader says which layer and expert had nowhere to go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_with_no_room_for_its_experts_ends_the_group_with_the_reason() {
    let (dir, spec, _) = checkpoint("loss-room");
    let mut group = Group::launch(RANKS, &dir.0.display().to_string(), FLAGS);
    let mut c = group.client().await;
    let x = vec![0.25f32; 4 * spec.hidden];
    forward_f32(&mut c, "a", spec.moe_layers[0], &x, spec.hidden).await;
    kill(group.proc.rank_pid(2), "KILL");
    group
        .proc
        .wait_for("the group goes on", Duration::from_secs(30))
        .unwrap();
    forward_f32(&mut c, "b", spec.moe_layers[0], &x, spec.hidden).await;
    kill(group.proc.rank_pid(3), "KILL");
    let why = group
        .proc
        .wait_for("cannot go on", Duration::from_secs(30))
        .unwrap();
    assert!(
        why.contains("has no slot") || why.contains("no redundant slot"),
        "{why}"
    );
    assert!(
        group
            .proc
            .wait_exit(Duration::from_secs(30))
            .is_some_and(|s| !s.success()),
        "{}",
        group.proc.log_text()
    );
}

/// `--on-rank-loss continue` where the group has no room for some rank's experts is refused
/// at startup, naming the rank, the layer and the expert.
#[test]
fn continue_without_room_is_refused_at_startup() {
    let (dir, _, _) = checkpoint("loss-refused");
    let shm = TempDir::new("shm");
    let args = launch_args(
        RANKS,
        &dir.0.display().to_string(),
        &shm,
        &["--redundant-experts", "4", "--on-rank-loss", "continue"],
    );
    let mut p = Proc::spawn(&args);
    let status = p.wait_exit(Duration::from_secs(120)).expect("it exits");
    assert!(!status.success());
    let log = p.log_text();
    assert!(
        log.contains("--on-rank-loss continue: without rank 1: layer 0:") && log.contains("expert"),
        "{log}"
    );
}
