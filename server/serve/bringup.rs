//! The startup handshake after the rendezvous, written once for both sides and every backend.
//! Each rank builds its backend between two barriers (`backend::bringup::BringUp`: its resources
//! created; its peers mapped, or NCCL joined): the leader gathers every rank's arrival and
//! releases them all, a worker reports and waits. Between the barriers, before the backend
//! joins, every rank makes its data connections to the ranks of other nodes (none on one node).

use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::backend::bringup::{BringUp, Site};
use crate::group::{expect, send, Bringup, ControlLink};
use crate::nodes::mirror::Targets;
use crate::nodes::plane::{DataLinks, DataListener, Mesh};
use crate::nodes::Roster;
use crate::step::ring::{Remote, Ring};
use crate::step::Backend;
use crate::sys::shm::Shm;

/// This rank's end of the control connections.
pub enum Side<'a> {
    Leader(&'a mut ControlLink),
    Worker {
        stream: &'a mut TcpStream,
        rank: usize,
    },
}

impl Side<'_> {
    /// Every rank has done `what`: the leader gathers `arrived` from each worker, then sends
    /// `release` to all; a worker sends its own `arrived` and waits for `release`.
    fn barrier(
        &mut self,
        what: &str,
        arrived: fn(usize) -> Bringup,
        release: Bringup,
        deadline: Instant,
    ) -> anyhow::Result<()> {
        match self {
            Side::Leader(link) => {
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

/// This rank's way to the other nodes.
pub struct Reach {
    pub listener: DataListener,
    pub rank: usize,
    /// --group-token ("" for none).
    pub token: String,
    pub step_timeout: Duration,
}

/// This rank's backend, built in lockstep with the group.
pub fn bring_up(
    side: &mut Side,
    mut rank: Box<dyn BringUp>,
    site: Site,
    reach: Reach,
) -> anyhow::Result<Box<dyn Backend + Send>> {
    let [created, joined] = rank.barriers();
    let (deadline, keep) = (site.deadline, site.keep_files);
    rank.create(&site)?;
    side.barrier(
        created,
        |r| Bringup::Created { rank: r },
        Bringup::Map,
        deadline,
    )?;
    let links = connect_nodes(&site, rank.as_ref(), reach)?;
    let backend = rank.join(&site, &links)?;
    side.barrier(
        joined,
        |r| Bringup::Mapped { rank: r },
        Bringup::Go,
        deadline,
    )?;
    if !keep {
        backend.group_started();
    }
    Ok(backend)
}

/// The data connections to the ranks of other nodes, and the step ring joined to theirs.
fn connect_nodes(site: &Site, rank: &dyn BringUp, reach: Reach) -> anyhow::Result<DataLinks> {
    let (me, roster) = (reach.rank, site.roster);
    let ring = (site.ring)()?;
    let mut targets = Targets::default();
    if roster.spans_nodes() {
        targets.segment = rank.mirrored(site)?;
        if roster.leader(me) == me {
            let path = super::site::ring_path(site.dir, site.group);
            targets.ring = Some(Shm::open(&path, ring.shape.bytes())?);
        }
    }
    let links = Mesh {
        roster,
        rank: me,
        group: site.group,
        token: &reach.token,
        step_timeout: reach.step_timeout,
        deadline: site.deadline,
        abort: site.abort.clone(),
    }
    .connect(reach.listener, targets)?;
    join_rings(&ring, roster, me, &links)?;
    Ok(links)
}

/// Rank 0's ring sends to each other node's leader; a rank of another node sends to rank 0.
fn join_rings(ring: &Ring, roster: &Roster, me: usize, links: &DataLinks) -> anyhow::Result<()> {
    let link = |r: usize| {
        links
            .to(r)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no data connection to rank {r}"))
    };
    if me == 0 && roster.spans_nodes() {
        let nodes = roster
            .other_nodes()
            .into_iter()
            .map(|(leader, ranks)| Ok((link(leader)?, ranks)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        ring.connect(Remote::Leader(nodes));
    } else if !roster.same_node(me, 0) {
        ring.connect(Remote::Away(link(0)?));
    }
    Ok(())
}

pub fn expect_msg(stream: &mut TcpStream, want: Bringup, deadline: Instant) -> anyhow::Result<()> {
    let got = expect(stream, &format!("{want:?}"), deadline)?;
    if got != want {
        bail!("expected {want:?} from the leader, got {got:?}");
    }
    Ok(())
}
