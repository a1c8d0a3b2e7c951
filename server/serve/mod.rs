//! One rank's life, by concern: `prepare` (model, backend, weights, before the group), `bringup`
//! (the startup handshake, the same on every rank), then `leader` (rank 0: gRPC, batcher, step
//! executor, drain) or `worker` (follows the leader's steps); `grpc` and `stop` serve the leader.

mod bringup;
mod grpc;
mod ingress;
mod leader;
mod loss;
mod prepare;
mod site;
mod stop;
mod unknown;
mod worker;

use std::net::{SocketAddr, TcpListener};

use anyhow::{anyhow, Context};

use crate::config::ServeArgs;

/// A startup stage that lasts longer is said again this often (`startup: still ...`).
const STILL_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// `epserve serve`: one rank's whole life.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    crate::sys::tie_to_launcher()?;
    let member = args.member().map_err(|e| anyhow!(e))?;
    let rank = member.place.rank;
    match crate::transport::listen::raise_open_files() {
        Ok((before, now)) => tracing::info!(before, now, "open files limit (soft)"),
        Err(e) => tracing::warn!("open files limit: {e}"),
    }
    // The leader binds its rendezvous port before anything slow, so ranks can connect while it
    // loads; given port 0 it says on stdout which port it got (how `launch` avoids port races).
    let listener = match rank {
        0 => Some(bind_rendezvous(&member.rendezvous, args.rendezvous_bind).context("rank 0")?),
        _ => None,
    };
    let p = prepare::plan(&args, member).with_context(|| format!("rank {rank}"))?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        model = %p.source.describe(),
        architecture = %p.spec.architecture,
        layers = p.spec.moe_layers.len(),
        experts = p.spec.num_experts,
        expert_dtype = p.expert_dtype.name(),
        backend = prepare::backend_name(p.backend),
        world = p.member.place.world,
        ingress = args.ingress.name(),
        max_tokens_per_step = args.max_tokens_per_step,
        "epserve starting"
    );
    // Metrics (and, on the ranks that take requests, gRPC and REST) answer from here on, while
    // the weights load; a port that is taken fails the start before anything slow.
    crate::metrics::install()?;
    serve_metrics(&args, rank).with_context(|| format!("rank {rank}"))?;
    if args.metrics_per_expert {
        let experts = p.slots.experts_of(rank);
        crate::metrics::zero_expert_series(&p.spec.moe_layers, &experts);
    }
    crate::stats_log::spawn(args.log_stats_interval)?;
    crate::startup::watch(STILL_EVERY)?;
    let r = match listener {
        Some(l) => leader::run(&args, p, l),
        None => worker::run(&args, p),
    };
    r.with_context(|| format!("rank {rank}"))
}

/// `/metrics` on a small runtime of its own for the life of the process (the step loops stay
/// plain blocking code); returns once the port is bound.
fn serve_metrics(args: &ServeArgs, rank: usize) -> anyhow::Result<()> {
    let Some(listen) = args.metrics_listen.0 else {
        tracing::info!("rank {rank} metrics off (--metrics-listen off)");
        return Ok(());
    };
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let conns = args.conn.clone();
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = bound_tx.send(Err(anyhow::Error::from(e)));
                    return;
                }
            };
            rt.block_on(async {
                let r = crate::metrics::serve(listen, conns, rank).await;
                let ok = r.is_ok();
                let _ = bound_tx.send(r.map(|_| ()));
                if ok {
                    std::future::pending::<()>().await;
                }
            });
        })?;
    bound_rx
        .recv()
        .map_err(|_| anyhow!("the metrics thread died"))?
}

/// The line rank 0 prints on stdout when it bound rendezvous port 0.
pub const RENDEZVOUS_LINE: &str = "epserve-rendezvous ";

fn bind_rendezvous(addr: &str, given: Option<SocketAddr>) -> anyhow::Result<TcpListener> {
    let bind = match given {
        Some(a) => a,
        None => rendezvous_bind(addr)?,
    };
    let listener =
        TcpListener::bind(bind).with_context(|| format!("binding the rendezvous port {bind}"))?;
    if bind.port() == 0 {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{RENDEZVOUS_LINE}{}", listener.local_addr()?)?;
        out.flush()?;
    }
    Ok(listener)
}

/// The rendezvous listener binds the address the rendezvous name resolves to (its first IPv4
/// one where there is one): ranks reach the leader there, and nothing else is opened.
fn rendezvous_bind(addr: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let all: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .with_context(|| format!("rendezvous address '{addr}' is not HOST:PORT that resolves"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| anyhow!("rendezvous address '{addr}' resolves to no address"))
}
