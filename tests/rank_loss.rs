//! Losing a rank under load (`--on-rank-loss continue`, #55) on the cpu backend: 4 ranks of a
//! DeepSeek-V3-shaped FP8 checkpoint written by the test, 32 clients of steady load checking
//! every token against the f64 reference. kill -9 of rank 2, or SIGSTOP of rank 3: no request
//! fails, every answer stays within 1e-5 per token, the longest answer delay stays within the
//! bound (3 s after a kill; --step-timeout + 3 s after a stop), GetModelInfo and the metrics
//! show the three ranks left. A loss the ranks left have no room for ends the group, saying why.

mod common;

use std::time::{Duration, Instant};

use common::loss::*;
use common::reference::compare_tokens;
use common::*;
use epserve::proto::moe_service_client::MoeServiceClient;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::transport::Channel;

const RANKS: usize = 4;
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

/// Rank 2 of 4, or ranks `ranks` of `flags`' group, lost by `sig`: the cpu backend, each token
/// within 1e-5 of the f64 reference.
async fn drill(tag: &str, flags: &[&str], ranks: &[usize], sig: &str, bound: Duration) {
    let d = Drill {
        tag,
        world: RANKS,
        flags,
        ranks,
        sig,
        bound,
        tol: 1e-5,
        fp8: true,
        hidden: HIDDEN,
    };
    lose_under_load(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_is_left_behind_and_no_request_fails() {
    drill("loss-kill", FLAGS, &[2], "KILL", Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_rank_is_fenced_and_no_request_fails() {
    // --step-timeout 2s, then 3 s.
    drill("loss-stop", FLAGS, &[3], "STOP", Duration::from_secs(5)).await;
}

/// Two simulated nodes of two ranks each: the second node's ranks are killed together; the
/// router's node (ranks 0 and 1, 8 slots each) takes every expert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_is_left_behind_and_no_request_fails() {
    let mut flags = FLAGS.to_vec();
    flags[1] = "16";
    flags.extend(["--nodes", "2"]);
    drill("loss-node", &flags, &[2, 3], "KILL", Duration::from_secs(3)).await;
}

/// The killed rank restarted with its command line rejoins: the group is whole again (epoch 2),
/// the restarted rank computes rows, and no request of the steady load fails or is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_restarted_rejoins_and_no_request_fails() {
    lose_and_rejoin("loss-rejoin", (RANKS, 2), FLAGS, (1e-5, true, HIDDEN)).await;
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
