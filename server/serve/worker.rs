//! Ranks 1..: join the router's group, build the backend in lockstep, then run each step the
//! router sends until told to stop or the router is gone.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use metrics_exporter_prometheus::PrometheusHandle;
use tracing::{error, info};

use super::bringup::{bring_up, Side, Site};
use super::prepare::{Prepared, Weights};
use crate::config::ServeArgs;
use crate::group::{self, send, Ctl, Joined};
use crate::shm::Abort;
use crate::step::ring::Ring;
use crate::step::{Backend, Driver, StepError};
use crate::watchdog::{self, Progress};

/// Joins the router's group and runs its steps until told to stop.
pub fn run(
    args: &ServeArgs,
    p: Prepared,
    weights: Weights,
    metrics: PrometheusHandle,
) -> anyhow::Result<()> {
    let rank = p.member.rank;
    // Metrics on a small runtime of their own: the step loop stays plain blocking code.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let listen = args.metrics_listen;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let r = rt.map_err(anyhow::Error::from).and_then(|rt| {
                rt.block_on(async {
                    let r = crate::metrics::serve(listen, metrics, rank).await;
                    let ok = r.is_ok();
                    let _ = addr_tx.send(r);
                    if ok {
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                })
            });
            if let Err(e) = r {
                error!("metrics endpoint: {e:#}");
            }
        })?;
    addr_rx
        .recv()
        .map_err(|_| anyhow!("the metrics thread died"))??;
    let timeout = args.rendezvous_timeout;
    let addr = &p.member.rendezvous;
    let Joined {
        mut stream,
        group: group_id,
        nccl_id,
    } = group::join(
        addr,
        rank,
        p.member.world,
        &p.fingerprint,
        args.group_token.as_deref().unwrap_or_default(),
        timeout,
    )?;
    let deadline = Instant::now() + timeout;
    let dir = super::segment_dir(args)?;
    let dir = dir.as_path();
    let setup = {
        let open_ring = || -> anyhow::Result<Arc<Ring>> {
            let ring = Ring::open(&super::ring_path(dir, &group_id), p.ring)
                .context("mapping the step ring")?;
            Ok(Arc::new(ring))
        };
        let site = Site {
            dir,
            group: &group_id,
            nccl_id: nccl_id.as_deref().unwrap_or_default(),
            ring: &open_ring,
            deadline,
        };
        let mut side = Side::Worker {
            stream: &mut stream,
            rank,
        };
        bring_up(
            &mut side,
            weights,
            &p,
            site,
            args,
            Arc::new(Abort::default()),
        )
    };
    let backend = match setup {
        Ok(b) => b,
        Err(e) => {
            let _ = send(
                &mut stream,
                &Ctl::Failed {
                    rank,
                    reason: format!("{e:#}"),
                },
            );
            return Err(e);
        }
    };
    // The router sends a step or a heartbeat at least every heartbeat interval plus one step.
    let silence = args.heartbeat_interval + args.step_timeout + Duration::from_secs(1);
    stream.set_read_timeout(Some(silence))?;
    super::group_info(p.backend, rank, p.member.world);
    // The router drives the drain: a signalled rank keeps running the router's steps until it is
    // told to stop or loses the router, so nothing admitted is lost when every pod gets SIGTERM.
    let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, signalled.clone())?;
    }
    info!(buffers = ?backend.buffers(), "joined the group");
    let driver = Driver::new(
        backend,
        rank,
        p.member.world,
        p.spec.moe_layers.clone(),
        args.metrics_per_expert,
        p.ring,
    );
    follow_steps(&mut stream, driver, silence, args.step_timeout)
}

/// Runs each step the router sends, until told to stop. A step that outlives --step-timeout
/// (a device call that never returns) ends the process from the watchdog: nothing here could.
fn follow_steps<B: Backend>(
    stream: &mut TcpStream,
    mut driver: Driver<B>,
    silence: Duration,
    step_timeout: Duration,
) -> anyhow::Result<()> {
    let progress = Arc::new(Progress::default());
    let mut report = stream.try_clone()?;
    let rank = driver.rank;
    watchdog::watch_steps(progress.clone(), step_timeout, move |d| {
        let reason = format!("a step has run {d:.1?}, past --step-timeout {step_timeout:?}");
        let _ = send(
            &mut report,
            &Ctl::Failed {
                rank,
                reason: reason.clone(),
            },
        );
        watchdog::exit_now(1, &reason);
    })?;
    loop {
        match group::recv(stream) {
            Ok(Ctl::Step(desc)) => {
                progress.begin();
                let r = driver.run(&desc);
                progress.end();
                if let Err(e) = r {
                    let reason = e.to_string();
                    let msg = match e {
                        StepError::Corrupt { .. } => Ctl::Corrupt { rank, reason },
                        _ => Ctl::Failed { rank, reason },
                    };
                    let _ = send(stream, &msg);
                    return Err(e.into());
                }
            }
            Ok(Ctl::Shutdown) => {
                info!("router asked to stop; exiting");
                return Ok(());
            }
            Ok(Ctl::Failed { reason, .. }) => bail!("the EP group stopped: {reason}"),
            Ok(other) => bail!("unexpected control message {other:?}"),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("the router (rank 0) sent nothing for {silence:?}: it is stuck or gone")
            }
            Err(e) => bail!("lost the connection to the router (rank 0): {e}"),
        }
    }
}
