//! A lost rank coming back (`--on-rank-loss continue`). After the group forms the leader keeps
//! its rendezvous port and reads the hellos that arrive there, each on a thread of its own
//! within `HELLO_TIMEOUT`: one with the group's world size, token and fingerprint, from a rank
//! the group lost, on that rank's node, goes to the step executor (`Comer`), which brings the
//! rank in between steps; anything else is told why and closed.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{first_difference, read_hello, recv_until, send, Bringup, Fingerprint, GroupError};
use crate::nodes::{RankNode, Roster};

/// A restarted rank, its hello checked.
pub struct Comer {
    pub rank: usize,
    pub stream: TcpStream,
    pub seat: RankNode,
}

impl Comer {
    /// Waits (until `deadline`) for the rank's `want` in the bring-up's lockstep.
    pub fn expect(&mut self, want: Bringup, deadline: Instant) -> Result<(), GroupError> {
        let from = format!("rank {}", self.rank);
        match recv_until::<Bringup>(&mut self.stream, deadline, &format!("{want:?}"), &from)? {
            m if m == want => Ok(()),
            Bringup::Failed { reason, .. } => Err(GroupError::Rejected(format!(
                "rank {} failed: {reason}",
                self.rank
            ))),
            m => Err(GroupError::Protocol(format!(
                "rank {} sent {m:?}, expected {want:?}",
                self.rank
            ))),
        }
    }
}

/// What a rank coming back must match.
pub struct Door {
    pub world: usize,
    pub fingerprint: Fingerprint,
    pub token: String,
    /// Every rank's node as the group formed: a rank comes back on its own node.
    pub roster: Roster,
    /// The leader's host: a rank of the leader's node runs there.
    pub host: String,
}

/// Reads hellos on `listener` for the life of the process; `lost(rank)` says whether the group
/// is without that rank now. Returns once the thread is running.
pub fn keep_open(
    listener: TcpListener,
    door: Door,
    lost: Arc<dyn Fn(usize) -> bool + Send + Sync>,
    comers: Sender<Comer>,
) -> std::io::Result<()> {
    listener.set_nonblocking(false)?;
    let door = Arc::new(door);
    std::thread::Builder::new()
        .name("rejoin-door".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(stream) = conn else { continue };
                let Ok(peer) = stream.peer_addr() else {
                    continue;
                };
                let (door, lost, comers) = (door.clone(), lost.clone(), comers.clone());
                let _ = std::thread::Builder::new()
                    .name("rejoin-hello".into())
                    .spawn(move || {
                        let (stream, peer, hello) = read_hello(stream, peer, super::HELLO_TIMEOUT);
                        if let Some(c) = admit(stream, peer, hello, &door, lost.as_ref()) {
                            tracing::info!(rank = c.rank, %peer, "rank {} asks to rejoin", c.rank);
                            let _ = comers.send(c);
                        }
                    });
            }
        })
        .map(drop)
}

/// The hello's rank where it may come back; else None, the sender told why.
fn admit(
    mut stream: TcpStream,
    peer: SocketAddr,
    hello: std::io::Result<Bringup>,
    door: &Door,
    lost: &dyn Fn(usize) -> bool,
) -> Option<Comer> {
    let Ok(Bringup::Hello {
        rank,
        world,
        host,
        seat,
        fingerprint,
        token,
    }) = hello
    else {
        tracing::warn!(%peer, "rendezvous after startup: no hello; closing");
        return None;
    };
    let why = if !crate::flags::same_secret(&token, &door.token) {
        Some("wrong or missing group token (--group-token)".to_string())
    } else if world != door.world || rank == 0 || rank >= door.world {
        Some(format!(
            "rank {rank} of {world} is no seat of this group of {}",
            door.world
        ))
    } else if let Some((field, ours, theirs)) = first_difference(&door.fingerprint, &fingerprint) {
        Some(format!(
            "config mismatch in '{field}': rank {rank} has {theirs}, rank 0 has {ours}"
        ))
    } else if door.roster.spans_nodes() {
        Some("a rank rejoins a group on one node only, for now".to_string())
    } else if !lost(rank) {
        Some(format!(
            "rank {rank} is in the group: only a lost rank may rejoin"
        ))
    } else if seat.node != door.roster.node(rank)
        || (door.roster.same_node(rank, 0) && host != door.host)
    {
        Some(format!(
            "rank {rank} ran on node {:?}: it comes back there (this one is {:?} on {host})",
            door.roster.node(rank),
            seat.node
        ))
    } else {
        None
    };
    if let Some(reason) = why {
        tracing::warn!(%peer, rank, "refused a rank asking to rejoin: {reason}");
        let _ = send(&mut stream, &Bringup::Reject { reason });
        return None;
    }
    // The bring-up's waits are bounded by its deadline, not by a read timeout.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(600)));
    Some(Comer { rank, stream, seat })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat() -> RankNode {
        RankNode {
            node: "n".into(),
            data: String::new(),
            pid: 0,
        }
    }

    /// A hello of rank 1 read at `door` (`lost`: whether the group is without it), and what
    /// its sender heard back.
    fn knock(door: &Door, lost: bool) -> (Option<Comer>, Option<Bringup>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut them = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (us, peer) = l.accept().unwrap();
        let hello = Bringup::Hello {
            rank: 1,
            world: 2,
            host: "h".into(),
            seat: seat(),
            fingerprint: Vec::new(),
            token: String::new(),
        };
        let comer = admit(us, peer, Ok(hello), door, &|r| lost && r == 1);
        them.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        (comer, super::super::recv(&mut them).ok())
    }

    /// A rank the group runs with is told at once why it may not come back; the same hello
    /// from a lost rank is let in, and hears nothing before the executor welcomes it.
    #[test]
    fn only_a_lost_rank_comes_back_and_a_live_one_hears_why() {
        let door = Door {
            world: 2,
            fingerprint: Vec::new(),
            token: String::new(),
            roster: Roster(vec![seat(), seat()]),
            host: "h".into(),
        };
        let (comer, heard) = knock(&door, false);
        assert!(comer.is_none());
        match heard {
            Some(Bringup::Reject { reason }) => {
                assert!(reason.contains("only a lost rank"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let (comer, heard) = knock(&door, true);
        assert_eq!(comer.map(|c| c.rank), Some(1));
        assert!(heard.is_none(), "{heard:?}");
    }
}
