//! The startup handshake after the rendezvous, written once for both sides and every backend.
//! Each rank builds its backend between two barriers (`backend::bringup::BringUp`: its resources
//! created; its peers mapped, or NCCL joined): the router gathers every rank's arrival and
//! releases them all, a worker reports and waits.

use std::net::TcpStream;
use std::time::Instant;

use anyhow::bail;

use crate::backend::bringup::{BringUp, Site};
use crate::group::{expect, send, Bringup, RouterLink};
use crate::step::Backend;

/// This rank's end of the control connections.
pub enum Side<'a> {
    Router(&'a mut RouterLink),
    Worker {
        stream: &'a mut TcpStream,
        rank: usize,
    },
}

impl Side<'_> {
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

/// This rank's backend, built in lockstep with the group.
pub fn bring_up(
    side: &mut Side,
    mut rank: Box<dyn BringUp>,
    site: Site,
) -> anyhow::Result<Box<dyn Backend + Send>> {
    let [created, joined] = rank.barriers();
    let deadline = site.deadline;
    rank.create(&site)?;
    side.barrier(
        created,
        |r| Bringup::Created { rank: r },
        Bringup::Map,
        deadline,
    )?;
    let backend = rank.join(&site)?;
    side.barrier(
        joined,
        |r| Bringup::Mapped { rank: r },
        Bringup::Go,
        deadline,
    )?;
    backend.group_started();
    Ok(backend)
}

pub fn expect_msg(stream: &mut TcpStream, want: Bringup, deadline: Instant) -> anyhow::Result<()> {
    let got = expect(stream, &format!("{want:?}"), deadline)?;
    if got != want {
        bail!("expected {want:?} from the router, got {got:?}");
    }
    Ok(())
}
