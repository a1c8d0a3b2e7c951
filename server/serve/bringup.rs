//! The startup handshake after the rendezvous, written once for both sides. Each rank builds its
//! backend between two barriers (its resources created; its peers mapped, or NCCL joined): the
//! router gathers every rank's arrival and releases them all, a worker reports and waits.

use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};

use super::prepare::{Prepared, Weights};
use crate::backend::cpu::{default_lanes, CpuRank};
use crate::config::ServeArgs;
use crate::flags::OnOff;
use crate::group::{expect, send, Bringup, RouterLink};
use crate::lifecycle::Abort;
use crate::step::ring::Ring;
use crate::step::Backend;
use crate::watchdog::SetupDeadline;

/// What a GPU rank does after NCCL init that takes no deadline of its own.
const GPU_SETUP: &str = "joining NCCL, creating the NCCL EP groups and capturing the step graphs";

/// This rank's end of the control connections.
pub enum Side<'a> {
    Router(&'a mut RouterLink),
    Worker {
        stream: &'a mut TcpStream,
        rank: usize,
    },
}

impl Side<'_> {
    fn rank(&self) -> usize {
        match self {
            Side::Router(_) => 0,
            Side::Worker { rank, .. } => *rank,
        }
    }

    /// Every rank has done `what`: the router gathers `arrived` from each worker, then sends
    /// `release` to all; a worker sends its own `arrived` and waits for `release`.
    fn barrier(
        &mut self,
        what: &str,
        arrived: fn(usize) -> Bringup,
        release: Bringup,
        deadline: Instant,
    ) -> anyhow::Result<()> {
        match self {
            Side::Router(link) => {
                link.gather(what, deadline, arrived)?;
                link.broadcast(&release)?;
            }
            Side::Worker { stream, rank } => {
                send(stream, &arrived(*rank))?;
                expect_msg(stream, release, deadline)?;
            }
        }
        Ok(())
    }
}

/// Where the group meets on this host.
pub struct Site<'a> {
    /// The directory of the group's shared-memory segments.
    pub dir: &'a Path,
    pub group: &'a str,
    /// NCCL's unique id (GPU backends).
    pub nccl_id: &'a [u8],
    /// The step ring, mapped once every rank has arrived (the router creates it before then).
    pub ring: &'a dyn Fn() -> anyhow::Result<Arc<Ring>>,
    pub deadline: Instant,
}

/// This rank's backend, built in lockstep with the group.
pub fn bring_up(
    side: &mut Side,
    weights: Weights,
    p: &Prepared,
    site: Site,
    args: &ServeArgs,
    abort: Arc<Abort>,
) -> anyhow::Result<Box<dyn Backend + Send>> {
    let (rank, deadline) = (side.rank(), site.deadline);
    let created = |r| Bringup::Created { rank: r };
    let mapped = |r| Bringup::Mapped { rank: r };
    match weights {
        Weights::Host(weights) => {
            let own = CpuRank::create_segment(site.dir, site.group, rank, p.segment).with_context(
                || format!("creating the exchange segment in {}", site.dir.display()),
            )?;
            side.barrier("its exchange segment", created, Bringup::Map, deadline)?;
            let lanes = match args.cpu_threads {
                0 => default_lanes(p.member.world),
                n => n,
            };
            let backend = CpuRank::attach(
                site.dir,
                site.group,
                rank,
                own,
                p.segment,
                p.spec.clone(),
                weights,
                (site.ring)()?,
                abort,
                args.step_timeout,
                lanes,
            )
            .context("mapping the peers' exchange segments")?;
            tracing::info!(threads = lanes, "cpu backend: expert math threads");
            side.barrier("mapping every segment", mapped, Bringup::Go, deadline)?;
            backend.unlink_own();
            Ok(Box::new(backend))
        }
        Weights::Gpu(dev) => {
            side.barrier("its GPU and weights", created, Bringup::Map, deadline)?;
            let _bound = SetupDeadline::new(GPU_SETUP, deadline);
            let backend = dev.join(
                site.nccl_id,
                (site.ring)()?,
                p.buckets.clone(),
                args.cuda_graphs == OnOff::On,
                args.step_timeout,
                deadline,
            )?;
            side.barrier(
                "joining NCCL and capturing its steps",
                mapped,
                Bringup::Go,
                deadline,
            )?;
            Ok(backend)
        }
    }
}

pub fn expect_msg(stream: &mut TcpStream, want: Bringup, deadline: Instant) -> anyhow::Result<()> {
    let got = expect(stream, &format!("{want:?}"), deadline)?;
    if got != want {
        bail!("expected {want:?} from the router, got {got:?}");
    }
    Ok(())
}
