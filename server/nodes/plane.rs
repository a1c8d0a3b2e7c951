//! The data connections between nodes, made once at startup: every rank connects to every rank
//! of another node (its `DataLink` there) and accepts their connections (a thread each, applying
//! their frames to its own mappings). A connection opens with a hello naming the rank, the
//! group and the group token (a control-channel frame, `group::wire`); one that names anything
//! else is closed, and accepting goes on until every expected rank is in or the startup deadline
//! passes, whose error names the missing ranks and their nodes. Hellos are read each on a thread
//! of its own within `HELLO_TIMEOUT`: read one at a time, 5 s each, three stray connections a
//! port kept a 4-rank, 2-node group from forming (#56). The listener binds the address this rank
//! reaches the leader from unless --data-listen names another.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use super::mirror::{apply, DataLink, Targets};
use super::Roster;
use crate::lifecycle::Abort;
use crate::transport::frame::{recv, send};

/// How long an accepted connection has to say hello (ours say it as they connect).
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Accepted connections whose hello is still awaited; more are closed at once.
const MAX_PENDING: usize = 64;

/// This rank's data listener, bound before the rendezvous so its port goes into the hello.
pub struct DataListener(TcpListener);

impl DataListener {
    /// Binds `addr`, else (no --data-listen) the address this host reaches `rendezvous` from,
    /// any port: where peers reach this rank, and nowhere else.
    pub fn bind(addr: Option<SocketAddr>, rendezvous: &str) -> anyhow::Result<Self> {
        let addr = match addr {
            Some(a) => a,
            None => SocketAddr::new(route_to(rendezvous)?, 0),
        };
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

/// This host's address on its route to `rendezvous` (HOST:PORT): a UDP socket connected there
/// (which sends nothing) is given it.
fn route_to(rendezvous: &str) -> anyhow::Result<std::net::IpAddr> {
    let to = rendezvous
        .to_socket_addrs()
        .with_context(|| format!("rendezvous address '{rendezvous}' does not resolve"))?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| anyhow::anyhow!("rendezvous address '{rendezvous}' has no IPv4 address"))?;
    let udp = std::net::UdpSocket::bind("0.0.0.0:0")?;
    udp.connect(to)
        .with_context(|| format!("no route to the rendezvous address {to}"))?;
    Ok(udp.local_addr()?.ip())
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
                let (said, hellos) = std::sync::mpsc::channel::<(TcpStream, anyhow::Result<Hello>)>();
                let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                while !waiting.is_empty() {
                    let mut idle = true;
                    match listener.0.accept() {
                        Ok((s, peer)) => {
                            idle = false;
                            use std::sync::atomic::Ordering::AcqRel;
                            if pending.fetch_add(1, AcqRel) >= MAX_PENDING {
                                pending.fetch_sub(1, AcqRel);
                                tracing::warn!(%peer, "data listener: too many connections without a hello; closing");
                            } else {
                                let (said, pending) = (said.clone(), pending.clone());
                                std::thread::Builder::new()
                                    .name("data-hello".into())
                                    .spawn(move || {
                                        let mut s = s;
                                        let hello = s
                                            .set_nonblocking(false)
                                            .map_err(Into::into)
                                            .and_then(|_| read_hello(&mut s));
                                        pending.fetch_sub(1, AcqRel);
                                        let _ = said.send((s, hello));
                                    })?;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e).context("accepting data connections"),
                    }
                    while let Ok((s, hello)) = hellos.try_recv() {
                        idle = false;
                        let peer = match hello {
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
                            .spawn(move || match apply(s, peer, &targets, &|| abort.is_fenced(peer)) {
                                Ok(()) => tracing::debug!(peer, "data connection closed"),
                                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                                    abort.trigger(format!("{e}"))
                                }
                                Err(e) => tracing::warn!(peer, "data connection lost: {e}"),
                            })?;
                    }
                    if idle {
                        if Instant::now() >= deadline && !waiting.is_empty() {
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
                    }
                }
                Ok(())
            })?;
        Ok(spawned)
    }
}
