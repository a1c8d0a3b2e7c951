//! `epserve launch`: N local rank processes of one group, supervised. Signals are forwarded; if
//! any rank fails, the others are stopped and the launcher exits non-zero. `--nodes K` splits
//! the ranks over K simulated nodes (each its own `--node-id` and `--shm-dir` subdirectory), so
//! the paths between nodes run on one host.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::process::Stdio;

use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tracing::{error, info};

use crate::config::{Ingress, LaunchArgs};

/// Grace between SIGTERM and SIGKILL when stopping the group after a failure.
const KILL_GRACE: Duration = Duration::from_secs(5);

/// Flags `launch` sets per rank itself, and the group token, which ranks get in their
/// environment (`EPSERVE_GROUP_TOKEN`), not on their command lines where `ps` shows it.
const PER_RANK: &[&str] = &[
    "--ranks",
    "--nodes",
    "--metrics-listen",
    "--listen",
    "--http-listen",
    "--data-listen",
    "--node-id",
    "--shm-dir",
    "--group-token",
];

/// Where rank `rank` of `ranks` runs when they are split evenly, in rank order, over `nodes`
/// simulated nodes: (its node's index, its --node-id, its --shm-dir).
fn node_of(args: &LaunchArgs, rank: usize) -> (usize, Option<String>, PathBuf) {
    let shm = args.serve.shm_dir.clone();
    if args.nodes <= 1 {
        return (0, args.serve.node_id.clone(), shm);
    }
    let k = rank * args.nodes / args.ranks;
    let base = args
        .serve
        .node_id
        .clone()
        .unwrap_or_else(crate::telemetry::node_name);
    (
        k,
        Some(format!("{base}-node{k}")),
        shm.join(format!("node{k}")),
    )
}

/// Each simulated node's --shm-dir subdirectory, this user's only.
fn make_node_dirs(args: &LaunchArgs) -> anyhow::Result<Vec<PathBuf>> {
    use std::os::unix::fs::DirBuilderExt;
    let mut dirs: Vec<PathBuf> = Vec::new();
    for rank in 0..args.ranks {
        let (_, _, dir) = node_of(args, rank);
        if args.nodes > 1 && !dirs.contains(&dir) {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .or_else(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => Ok(()),
                    _ => Err(e),
                })
                .with_context(|| format!("creating the node directory {}", dir.display()))?;
            dirs.push(dir);
        }
    }
    Ok(dirs)
}

/// The serve flags the user gave `launch`, minus the per-rank ones.
fn passthrough() -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip_while(|a| a != "launch").skip(1);
    while let Some(a) = args.next() {
        if PER_RANK.contains(&a.as_str()) {
            args.next();
        } else if !PER_RANK.iter().any(|f| a.starts_with(&format!("{f}="))) {
            out.push(a);
        }
    }
    out
}

/// Reads rank 0's stdout until it reports its rendezvous address, then passes the rest through.
async fn read_rendezvous(
    out: tokio::process::ChildStdout,
    timeout: std::time::Duration,
) -> Option<String> {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut lines = BufReader::new(out).lines();
    let found = tokio::time::timeout(timeout, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(addr) = line.strip_prefix(crate::serve::RENDEZVOUS_LINE) {
                return Some(addr.trim().to_string());
            }
            println!("{line}");
        }
        None
    })
    .await
    .ok()
    .flatten();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            println!("{line}");
        }
    });
    found
}

/// Rank r's address of a per-rank port (`flag`): the base port plus r (port 0 stays 0: any free
/// port).
fn rank_addr(
    base: std::net::SocketAddr,
    rank: usize,
    flag: &str,
) -> anyhow::Result<std::net::SocketAddr> {
    let mut a = base;
    if a.port() != 0 {
        let port = usize::from(a.port()) + rank;
        a.set_port(
            u16::try_from(port).with_context(|| format!("{flag} port + rank exceeds 65535"))?,
        );
    }
    Ok(a)
}

pub fn launch(args: LaunchArgs) -> anyhow::Result<()> {
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    if args.serve.rank.is_some() || args.serve.world_size.is_some() {
        bail!("launch sets --rank and --world-size itself; pass --ranks");
    }
    if args.nodes == 0 || args.nodes > args.ranks {
        bail!(
            "--nodes {} must be between 1 and --ranks ({})",
            args.nodes,
            args.ranks
        );
    }
    let node_dirs = make_node_dirs(&args)?;
    let nodes: Vec<_> = (0..args.ranks).map(|r| node_of(&args, r)).collect();
    // Without --rendezvous, rank 0 binds port 0 and reports the port it got: no port is ever
    // picked by one process and bound by another.
    let mut rendezvous = args.serve.rendezvous.clone();
    let exe = std::env::current_exe().context("locating the epserve binary")?;
    let flags = passthrough();
    // Only the router serves gRPC unless every rank does.
    let listen = |rank: usize| match args.serve.ingress {
        Ingress::All => rank_addr(args.serve.listen, rank, "--listen"),
        Ingress::Router => Ok(args.serve.listen),
    };
    // REST beside gRPC, on the same ranks.
    let http_listen = |rank: usize| -> anyhow::Result<String> {
        Ok(match args.serve.http_listen.0 {
            None => "off".into(),
            Some(a) if args.serve.ingress == Ingress::All => {
                rank_addr(a, rank, "--http-listen")?.to_string()
            }
            Some(a) => a.to_string(),
        })
    };
    if args.serve.ingress == Ingress::All && args.serve.listen.port() != 0 {
        for rank in 0..args.ranks {
            info!(rank, "gRPC of rank {rank} on {}", listen(rank)?);
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let (exit_tx, mut exit_rx) = mpsc::channel::<(usize, std::io::Result<ExitStatus>)>(args.ranks);
        let mut pids = Vec::new();
        let mut spawned = 0;
        for (rank, (node, node_id, shm_dir)) in nodes.into_iter().enumerate() {
            let addr = rendezvous.clone().unwrap_or_else(|| "127.0.0.1:0".into());
            let mut cmd = Command::new(&exe);
            cmd.arg("serve")
                .args(&flags)
                .args(["--rank", &rank.to_string(), "--world-size", &args.ranks.to_string()])
                .args(["--rendezvous", &addr])
                .arg("--shm-dir")
                .arg(&shm_dir)
                .args(["--data-listen", &rank_addr(args.serve.data_listen, rank, "--data-listen")?.to_string()])
                .args(["--metrics-listen", &rank_addr(args.serve.metrics_listen, rank, "--metrics-listen")?.to_string()])
                .args(["--listen", &listen(rank)?.to_string()])
                .args(["--http-listen", &http_listen(rank)?])
                .kill_on_drop(true);
            if let Some(id) = node_id {
                cmd.args(["--node-id", &id]);
            }
            if args.nodes > 1 {
                info!(rank, node, "rank {rank} on simulated node {node}");
            }
            if let Some(token) = &args.serve.group_token {
                cmd.env("EPSERVE_GROUP_TOKEN", token);
            }
            if rendezvous.is_none() {
                cmd.stdout(Stdio::piped());
            }
            let mut child = cmd.spawn().with_context(|| format!("spawning rank {rank}"))?;
            if let Some(out) = child.stdout.take() {
                rendezvous = read_rendezvous(out, args.serve.rendezvous_timeout).await;
            }
            pids.push(child.id().map(|p| Pid::from_raw(p as i32)));
            let tx = exit_tx.clone();
            tokio::spawn(async move {
                let status = child.wait().await;
                let _ = tx.send((rank, status)).await;
            });
            spawned += 1;
            if rendezvous.is_none() {
                // Rank 0 did not come up; its own error says why, and its exit ends the launch.
                break;
            }
        }
        let rendezvous = rendezvous.unwrap_or_default();
        info!(ranks = args.ranks, %rendezvous, "launched");
        let signal_all = |pids: &[Option<Pid>], sig: Signal| {
            for pid in pids.iter().flatten() {
                let _ = kill(*pid, sig);
            }
        };
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut failed: Option<String> = None;
        let mut kill_at: Option<tokio::time::Instant> = None;
        let mut running = spawned;
        while running > 0 {
            tokio::select! {
                _ = int.recv() => signal_all(&pids, Signal::SIGINT),
                _ = term.recv() => signal_all(&pids, Signal::SIGTERM),
                Some((rank, status)) = exit_rx.recv() => {
                    running -= 1;
                    pids[rank] = None;
                    let ok = status.as_ref().is_ok_and(ExitStatus::success);
                    if !ok && failed.is_none() {
                        let why = match status {
                            Ok(s) => s.to_string(),
                            Err(e) => e.to_string(),
                        };
                        error!("rank {rank} {why}; stopping the group");
                        failed = Some(format!("rank {rank} {why}"));
                        signal_all(&pids, Signal::SIGTERM);
                        kill_at = Some(tokio::time::Instant::now() + KILL_GRACE);
                    }
                }
                _ = tokio::time::sleep_until(kill_at.unwrap_or_else(tokio::time::Instant::now)), if kill_at.is_some() => {
                    signal_all(&pids, Signal::SIGKILL);
                    kill_at = None;
                }
            }
        }
        // The node directories, once empty (each rank's private directory first).
        for dir in &node_dirs {
            let uid = nix::unistd::getuid();
            let _ = std::fs::remove_dir(dir.join(format!("epserve-{uid}")));
            let _ = std::fs::remove_dir(dir);
        }
        match failed {
            Some(why) => bail!("the group failed: {why}"),
            None => Ok(()),
        }
    })
}
