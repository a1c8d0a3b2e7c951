//! The data connections between nodes, made once at startup: every rank connects to every rank
//! of another node (its `DataLink` there) and accepts their connections (a thread each, applying
//! their frames to its own mappings). A connection opens with a hello naming the rank, the
//! group and the group token (a control-channel frame, `group::wire`); one that names anything
//! else is closed, and accepting goes on until every expected rank is in or the startup deadline
//! passes, whose error names the missing ranks and their nodes.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use super::mirror::{apply, DataLink, Targets};
use super::Roster;
use crate::lifecycle::Abort;
use crate::transport::frame::{recv, send};

/// How long an accepted connection has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// This rank's data listener, bound before the rendezvous so its port goes into the hello.
pub struct DataListener(TcpListener);

impl DataListener {
    pub fn bind(addr: SocketAddr) -> anyhow::Result<Self> {
        let l = TcpListener::bind(addr)
            .with_context(|| format!("binding the data listener {addr} (--data-listen)"))?;
        Ok(Self(l))
    }
    pub fn port(&self) -> anyhow::Result<u16> {
        Ok(self.0.local_addr()?.port())
    }
}

#[derive(Serialize, Deserialize)]
struct Hello {
    rank: usize,
    group: String,
    token: String,
}

/// The links of one rank, by rank: one to each rank of another node.
pub struct DataLinks(Vec<Option<Arc<DataLink>>>);

impl DataLinks {
    pub fn to(&self, rank: usize) -> Option<&Arc<DataLink>> {
        self.0.get(rank).and_then(Option::as_ref)
    }
}

/// Who this rank is in the mesh.
pub struct Mesh<'a> {
    pub roster: &'a Roster,
    pub rank: usize,
    pub group: &'a str,
    pub token: &'a str,
    /// Bounds each send on a link.
    pub step_timeout: Duration,
    pub deadline: Instant,
    /// Broken when a peer sends a frame this rank refuses.
    pub abort: Arc<Abort>,
}

/// The hello an accepted connection must send first, read within `HELLO_TIMEOUT`.
fn read_hello(s: &mut TcpStream) -> anyhow::Result<Hello> {
    s.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let hello = recv(s)?;
    s.set_read_timeout(None)?;
    Ok(hello)
}

impl Mesh<'_> {
    /// Connects to every rank of another node and accepts theirs, each accepted connection
    /// applied to `targets` on a thread of its own. Nothing to do on one node: the listener is
    /// closed.
    pub fn connect(&self, listener: DataListener, targets: Targets) -> anyhow::Result<DataLinks> {
        let world = self.roster.world();
        let away: Vec<usize> = self.roster.away_from(self.rank).collect();
        if away.is_empty() {
            return Ok(DataLinks(vec![None; world]));
        }
        let accepting = self.accept(listener, Arc::new(targets), away.clone())?;
        let mut links = vec![None; world];
        for &r in &away {
            let stream = self.dial(r)?;
            links[r] = Some(Arc::new(DataLink::new(
                r,
                stream,
                self.step_timeout,
                self.rank,
            )?));
        }
        accepting
            .join()
            .map_err(|_| anyhow::anyhow!("the data listener's thread panicked"))??;
        tracing::info!(
            peers = away.len(),
            "data connections to the other nodes made"
        );
        Ok(DataLinks(links))
    }

    fn dial(&self, r: usize) -> anyhow::Result<TcpStream> {
        let seat = &self.roster.0[r];
        let addrs: Vec<SocketAddr> = seat
            .data
            .to_socket_addrs()
            .with_context(|| format!("rank {r}'s data address {:?}", seat.data))?
            .collect();
        loop {
            if let Some(mut s) = addrs
                .iter()
                .find_map(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).ok())
            {
                send(
                    &mut s,
                    &Hello {
                        rank: self.rank,
                        group: self.group.to_string(),
                        token: self.token.to_string(),
                    },
                )?;
                return Ok(s);
            }
            if Instant::now() >= self.deadline {
                bail!(
                    "rank {r} (node {}) was not reachable at its data address {}",
                    seat.node,
                    seat.data
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Accepts `away`'s connections until each has said hello, on a thread of its own.
    fn accept(
        &self,
        listener: DataListener,
        targets: Arc<Targets>,
        away: Vec<usize>,
    ) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<()>>> {
        let (rank, group, token) = (self.rank, self.group.to_string(), self.token.to_string());
        let (deadline, abort, roster) = (self.deadline, self.abort.clone(), self.roster.clone());
        listener.0.set_nonblocking(true)?;
        let spawned = std::thread::Builder::new()
            .name("data-accept".into())
            .spawn(move || {
                let mut waiting = away;
                while !waiting.is_empty() {
                    let mut s = match listener.0.accept() {
                        Ok((s, _)) => s,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if Instant::now() >= deadline {
                                let missing: Vec<String> = waiting
                                    .iter()
                                    .map(|&r| format!("{r} (node {})", roster.node(r)))
                                    .collect();
                                bail!(
                                    "rank(s) {} did not open their data connections to rank {rank} in time",
                                    missing.join(", ")
                                );
                            }
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                        Err(e) => return Err(e).context("accepting data connections"),
                    };
                    s.set_nonblocking(false)?;
                    let peer = match read_hello(&mut s) {
                        Ok(h) if h.group == group
                            && crate::flags::same_secret(&h.token, &token)
                            && waiting.contains(&h.rank) =>
                        {
                            h.rank
                        }
                        Ok(h) => {
                            tracing::warn!(
                                rank = h.rank,
                                "data connection for another group, with a wrong token, or from a rank not expected; closing"
                            );
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!("data connection without a hello ({e:#}); closing");
                            continue;
                        }
                    };
                    waiting.retain(|&r| r != peer);
                    let (targets, abort) = (targets.clone(), abort.clone());
                    std::thread::Builder::new()
                        .name(format!("data-from-{peer}"))
                        .spawn(move || match apply(s, peer, &targets) {
                            Ok(()) => tracing::debug!(peer, "data connection closed"),
                            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                                abort.trigger(format!("{e}"))
                            }
                            Err(e) => tracing::warn!(peer, "data connection lost: {e}"),
                        })?;
                }
                Ok(())
            })?;
        Ok(spawned)
    }
}
