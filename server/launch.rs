//! `epserve launch`: N local rank processes of one group, supervised. Signals are forwarded; if
//! rank 0 fails (or any rank, under `--on-rank-loss exit`), the others are stopped and the
//! launcher exits non-zero; another rank's failure is the leader's to judge (it goes on without
//! the rank, or exits, which stops the group). `--nodes K` splits
//! the ranks over K simulated nodes (each its own `--node-id` and `--shm-dir` subdirectory), so
//! the paths between nodes run on one host; with `--node-index I` it runs node I's ranks only,
//! one launcher per real node (a pod of a LeaderWorkerSet).

use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::process::Stdio;

use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tracing::{error, info};

use crate::config::{Ingress, LaunchArgs, OnRankLoss};

/// A rank lost from a group that goes on is started again after this, at most
/// `--rank-restarts` times (it rejoins the group; one that keeps failing is left out).
const RESTART_AFTER: Duration = Duration::from_secs(1);

/// Grace between SIGTERM and SIGKILL when stopping the group after a failure.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// After a rank fails, how long the others have to report and exit on their own before they are
/// stopped: a rank refusing its checkpoint tells the others first, and stopping the group at the
/// first exit could kill it before it logged why (#56).
const REPORT_GRACE: Duration = Duration::from_secs(2);

/// Flags `launch` sets per rank itself, and the group token, which ranks get in their
/// environment (`EPSERVE_GROUP_TOKEN`), not on their command lines where `ps` shows it.
const PER_RANK: &[&str] = &[
    "--ranks",
    "--nodes",
    "--node-index",
    "--rank-restarts",
    "--metrics-listen",
    "--listen",
    "--http-listen",
    "--data-listen",
    "--node-id",
    "--shm-dir",
    "--group-token",
];

/// One rank this launcher runs.
#[derive(Debug, PartialEq)]
struct Child {
    rank: usize,
    /// Its index among this launcher's ranks: per-rank ports are the base port plus it.
    local: usize,
    /// Its node's index.
    node: usize,
    node_id: Option<String>,
    shm_dir: PathBuf,
}

/// The ranks this launcher runs: all of them (on simulated nodes when `--nodes` > 1), or with
/// `--node-index` only that node's, as one pod of a multi-node group.
fn children(args: &LaunchArgs) -> Vec<Child> {
    let node_of = |rank: usize| rank * args.nodes / args.ranks;
    let shm = &args.serve.shm_dir;
    let mut out = Vec::new();
    for rank in 0..args.ranks {
        let node = node_of(rank);
        let (node_id, shm_dir) = match args.node_index {
            Some(i) if i != node => continue,
            None if args.nodes > 1 => {
                let base = args
                    .serve
                    .node_id
                    .clone()
                    .unwrap_or_else(crate::telemetry::node_name);
                (
                    Some(format!("{base}-node{node}")),
                    shm.join(format!("node{node}")),
                )
            }
            _ => (args.serve.node_id.clone(), shm.clone()),
        };
        out.push(Child {
            rank,
            local: out.len(),
            node,
            node_id,
            shm_dir,
        });
    }
    out
}

/// Each simulated node's --shm-dir subdirectory, this user's only.
fn make_node_dirs(args: &LaunchArgs, children: &[Child]) -> anyhow::Result<Vec<PathBuf>> {
    use std::os::unix::fs::DirBuilderExt;
    let mut dirs: Vec<PathBuf> = Vec::new();
    if args.nodes <= 1 || args.node_index.is_some() {
        return Ok(dirs);
    }
    for child in children {
        let dir = &child.shm_dir;
        if !dirs.contains(dir) {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .or_else(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => Ok(()),
                    _ => Err(e),
                })
                .with_context(|| format!("creating the node directory {}", dir.display()))?;
            dirs.push(dir.clone());
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
    ready: Arc<AtomicBool>,
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
            match line == crate::sys::READY_LINE {
                true => ready.store(true, Ordering::Release),
                false => println!("{line}"),
            }
        }
    });
    found
}

/// A rank's address of a per-rank port (`flag`): the base port plus its local index (port 0
/// stays 0: any free port).
fn rank_addr(
    base: std::net::SocketAddr,
    local: usize,
    flag: &str,
) -> anyhow::Result<std::net::SocketAddr> {
    let mut a = base;
    if a.port() != 0 {
        let port = usize::from(a.port()) + local;
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
    if let Some(i) = args.node_index {
        if i >= args.nodes {
            bail!("--node-index {i} is not one of --nodes {}", args.nodes);
        }
    }
    let children = children(&args);
    let node_dirs = make_node_dirs(&args, &children)?;
    // Without --rendezvous, rank 0 binds port 0 and reports the port it got: no port is ever
    // picked by one process and bound by another. One node of several leaves it to the ranks
    // (--rendezvous, MASTER_ADDR or LWS_LEADER_ADDRESS, and MASTER_PORT): the other nodes
    // must know it in advance.
    let mut rendezvous = args.serve.rendezvous.clone();
    let report_port = rendezvous.is_none() && args.node_index.is_none();
    let exe = std::env::current_exe().context("locating the epserve binary")?;
    let flags = passthrough();
    // Only the leader serves gRPC unless every rank does.
    let listen = |local: usize| match args.serve.ingress {
        Ingress::All => rank_addr(args.serve.listen, local, "--listen"),
        Ingress::Leader => Ok(args.serve.listen),
    };
    // REST beside gRPC, on the same ranks.
    let http_listen = |local: usize| -> anyhow::Result<String> {
        Ok(match args.serve.http_listen.0 {
            None => "off".into(),
            Some(a) if args.serve.ingress == Ingress::All => {
                rank_addr(a, local, "--http-listen")?.to_string()
            }
            Some(a) => a.to_string(),
        })
    };
    if args.serve.ingress == Ingress::All && args.serve.listen.port() != 0 {
        for child in &children {
            let rank = child.rank;
            info!(rank, "gRPC of rank {rank} on {}", listen(child.local)?);
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Rank 0 here says when the group serves (`sys::READY_LINE` on its stdout).
    let group_ready = Arc::new(AtomicBool::new(false));
    // One rank's process, to the rendezvous `rendezvous` (None: rank 0 picks its port and
    // reports it, or the ranks resolve it).
    let here = children.len();
    let command = |c: &Child, rendezvous: Option<&str>| -> anyhow::Result<Command> {
        let (rank, local) = (c.rank, c.local);
        let mut cmd = Command::new(&exe);
        cmd.arg("serve")
            .args(&flags)
            .args([
                "--rank",
                &rank.to_string(),
                "--world-size",
                &args.ranks.to_string(),
            ])
            .arg("--shm-dir")
            .arg(&c.shm_dir)
            .args([
                "--metrics-listen",
                &match args.serve.metrics_listen.0 {
                    Some(a) => rank_addr(a, local, "--metrics-listen")?.to_string(),
                    None => "off".into(),
                },
            ])
            .args(["--listen", &listen(local)?.to_string()])
            .args(["--http-listen", &http_listen(local)?])
            .kill_on_drop(true);
        match (rendezvous, report_port) {
            (Some(addr), _) => cmd.args(["--rendezvous", addr]),
            (None, true) => cmd
                .args(["--rendezvous", "127.0.0.1:0"])
                .stdout(Stdio::piped()),
            (None, false) => &mut cmd,
        };
        if let Some(data) = args.serve.data_listen {
            cmd.args([
                "--data-listen",
                &rank_addr(data, local, "--data-listen")?.to_string(),
            ]);
        }
        if let Some(id) = &c.node_id {
            cmd.args(["--node-id", id]);
        }
        if let Some(token) = &args.serve.group_token {
            cmd.env("EPSERVE_GROUP_TOKEN", token);
        }
        // The ranks on this host, as torchrun says it: each rank's share of the cores.
        cmd.env("LOCAL_WORLD_SIZE", here.to_string());
        // The rank ends with this launcher, however it ends (SIGKILL included).
        cmd.env(crate::sys::LAUNCHER_PID, std::process::id().to_string());
        Ok(cmd)
    };
    runtime.block_on(async move {
        let (exit_tx, mut exit_rx) = mpsc::channel::<(usize, std::io::Result<ExitStatus>)>(children.len().max(1));
        let mut pids = Vec::new();
        let mut spawned = 0;
        for c in &children {
            let (rank, local) = (c.rank, c.local);
            if args.nodes > 1 {
                let node = c.node;
                info!(rank, node, "rank {rank} on node {node}");
            }
            let mut cmd = command(c, rendezvous.as_deref())?;
            let mut child = cmd.spawn().with_context(|| format!("spawning rank {rank}"))?;
            if let Some(out) = child.stdout.take() {
                let timeout = args.serve.rendezvous_timeout;
                rendezvous = read_rendezvous(out, timeout, group_ready.clone()).await;
            }
            pids.push(child.id().map(|p| Pid::from_raw(p as i32)));
            let tx = exit_tx.clone();
            tokio::spawn(async move {
                let status = child.wait().await;
                let _ = tx.send((local, status)).await;
            });
            spawned += 1;
            if report_port && rendezvous.is_none() {
                // Rank 0 did not come up; its own error says why, and its exit ends the launch.
                break;
            }
        }
        let rejoin_at = rendezvous.clone();
        let rendezvous = rendezvous.unwrap_or_else(|| "as the ranks resolve it".into());
        let ranks: Vec<usize> = children.iter().map(|s| s.rank).collect();
        info!(world = args.ranks, ?ranks, %rendezvous, "launched");
        let signal_all = |pids: &[Option<Pid>], sig: Signal| {
            for pid in pids.iter().flatten() {
                let _ = kill(*pid, sig);
            }
        };
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        // SIGHUP (a closed terminal; a pod's reload): with --placement the ranks' (rank 0 reads
        // the file again), else a drain as SIGTERM; by default it ended the launcher alone.
        let mut hup = signal(SignalKind::hangup())?;
        let hup_sends = match args.serve.placement {
            Some(_) => Signal::SIGHUP,
            None => Signal::SIGTERM,
        };
        let mut failed: Option<String> = None;
        let go_on = args.serve.on_rank_loss != OnRankLoss::Exit;
        let mut stop_at: Option<tokio::time::Instant> = None;
        let mut kill_at: Option<tokio::time::Instant> = None;
        let mut running = spawned;
        // A lost rank started again (it rejoins the group), at most RESTARTS times a rank.
        let (mut restarts, mut restart_at) = (vec![0u32; children.len()], Vec::<(tokio::time::Instant, usize)>::new());
        let mut stopping = false;
        while running > 0 {
            let next_restart = restart_at.iter().map(|r| r.0).min();
            tokio::select! {
                _ = int.recv() => {
                    stopping = true;
                    signal_all(&pids, Signal::SIGINT)
                }
                _ = term.recv() => {
                    stopping = true;
                    signal_all(&pids, Signal::SIGTERM)
                }
                _ = tokio::time::sleep_until(next_restart.unwrap_or_else(tokio::time::Instant::now)), if next_restart.is_some() => {
                    let now = tokio::time::Instant::now();
                    let due: Vec<usize> = restart_at.iter().filter(|r| r.0 <= now).map(|r| r.1).collect();
                    restart_at.retain(|r| r.0 > now);
                    for local in due.into_iter().filter(|_| !stopping && failed.is_none()) {
                        let c = &children[local];
                        let spawned = command(c, rejoin_at.as_deref()).and_then(|mut cmd| {
                            cmd.spawn().with_context(|| format!("starting rank {} again", c.rank))
                        });
                        match spawned {
                            Ok(mut child) => {
                                info!(rank = c.rank, "rank {} started again: it rejoins the group", c.rank);
                                pids[local] = child.id().map(|p| Pid::from_raw(p as i32));
                                let tx = exit_tx.clone();
                                tokio::spawn(async move {
                                    let status = child.wait().await;
                                    let _ = tx.send((local, status)).await;
                                });
                                running += 1;
                            }
                            Err(e) => error!("{e:#}"),
                        }
                    }
                }
                _ = hup.recv() => signal_all(&pids, hup_sends),
                Some((local, status)) = exit_rx.recv() => {
                    running -= 1;
                    pids[local] = None;
                    let rank = children[local].rank;
                    let ok = status.as_ref().is_ok_and(ExitStatus::success);
                    // Once the group serves, the leader decides whether it goes on without
                    // another rank: if it cannot, it exits too, and its exit stops the group.
                    // Before (or with no rank 0 here to say so), a failed rank stops it.
                    if !ok && rank != 0 && go_on && group_ready.load(Ordering::Acquire) {
                        let why = match &status {
                            Ok(s) => s.to_string(),
                            Err(e) => e.to_string(),
                        };
                        restarts[local] += 1;
                        // A rank rejoins a group on one node only, for now (the leader refuses
                        // it otherwise); where the group cannot go on, the leader exits.
                        let back = args.nodes == 1;
                        let most = if back { args.rank_restarts } else { 0 };
                        match restarts[local] <= most && !stopping {
                            true => {
                                error!("rank {rank} {why}; the group goes on without it where it can (--on-rank-loss); starting it again in {RESTART_AFTER:?} (restart {} of {most})", restarts[local]);
                                restart_at.push((tokio::time::Instant::now() + RESTART_AFTER, local));
                            }
                            false => error!("rank {rank} {why}; the group goes on without it where it can (--on-rank-loss); not started again"),
                        }
                        continue;
                    }
                    if !ok && failed.is_none() {
                        let why = match status {
                            Ok(s) => s.to_string(),
                            Err(e) => e.to_string(),
                        };
                        error!(
                            "rank {rank} {why}; stopping the group in {REPORT_GRACE:?} (the others \
                             report first)"
                        );
                        failed = Some(format!("rank {rank} {why}"));
                        stop_at = Some(tokio::time::Instant::now() + REPORT_GRACE);
                    }
                }
                _ = tokio::time::sleep_until(stop_at.unwrap_or_else(tokio::time::Instant::now)), if stop_at.is_some() => {
                    signal_all(&pids, Signal::SIGTERM);
                    stop_at = None;
                    kill_at = Some(tokio::time::Instant::now() + KILL_GRACE);
                }
                _ = tokio::time::sleep_until(kill_at.unwrap_or_else(tokio::time::Instant::now)), if kill_at.is_some() => {
                    signal_all(&pids, Signal::SIGKILL);
                    kill_at = None;
                }
            }
        }
        // The node directories, once empty (each rank's private directory first).
        for dir in &node_dirs {
            let _ = std::fs::remove_dir(crate::sys::shm::private_path(dir));
            let _ = std::fs::remove_dir(dir);
        }
        match failed {
            Some(why) => bail!("the group failed: {why}"),
            None => Ok(()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{children, rank_addr, Child};
    use crate::config::{Cli, Command, LaunchArgs};
    use clap::Parser;
    use std::path::PathBuf;

    fn launch(flags: &[&str]) -> LaunchArgs {
        let argv = ["epserve", "launch", "--shm-dir", "/s"].iter().chain(flags);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Launch(a) => a,
            other => panic!("{other:?}"),
        }
    }

    fn child(rank: usize, local: usize, node: usize, id: Option<&str>, shm: &str) -> Child {
        Child {
            rank,
            local,
            node,
            node_id: id.map(str::to_string),
            shm_dir: PathBuf::from(shm),
        }
    }

    /// Simulated nodes split the ranks in rank order, each its own id and directory; ports
    /// count from the group's first rank.
    #[test]
    fn simulated_nodes_split_the_ranks_in_rank_order() {
        let a = launch(&["--ranks", "4", "--nodes", "2", "--node-id", "h"]);
        assert_eq!(
            children(&a),
            vec![
                child(0, 0, 0, Some("h-node0"), "/s/node0"),
                child(1, 1, 0, Some("h-node0"), "/s/node0"),
                child(2, 2, 1, Some("h-node1"), "/s/node1"),
                child(3, 3, 1, Some("h-node1"), "/s/node1"),
            ]
        );
        let one = launch(&["--ranks", "2"]);
        assert_eq!(
            children(&one),
            vec![child(0, 0, 0, None, "/s"), child(1, 1, 0, None, "/s")]
        );
    }

    /// One node of several (a pod): only its ranks, its own id and directory as given, ports
    /// counted from its first rank so that every pod declares the same ones.
    #[test]
    fn one_node_of_several_runs_only_its_ranks() {
        let a = launch(&["--ranks", "8", "--nodes", "2", "--node-index", "1"]);
        let got = children(&a);
        let want: Vec<Child> = (4..8).map(|r| child(r, r - 4, 1, None, "/s")).collect();
        assert_eq!(got, want);
        let base = "0.0.0.0:9400".parse().unwrap();
        assert_eq!(rank_addr(base, got[3].local, "m").unwrap().port(), 9403);
        let first = launch(&["--ranks", "8", "--nodes", "2", "--node-index", "0"]);
        assert_eq!(
            children(&first).iter().map(|s| s.rank).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
    }
}
