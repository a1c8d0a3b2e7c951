//! The EP group: rendezvous at the leader (rank 0), config fingerprint check, and the control
//! channel that carries step descriptors. Every wait has a deadline and names who is missing.

pub mod msg;
pub mod rejoin;

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use crate::transport::frame::{recv, send};
pub use msg::{Bringup, Fingerprint, IngressOrder, IngressReport, Order, Report};

use crate::nodes::{RankNode, Roster};

/// A rank's end of its control connection after startup, shared by its senders (the step loop,
/// the watchdog, the ingress tasks): each report goes out whole.
#[derive(Clone)]
pub struct Reporter(std::sync::Arc<std::sync::Mutex<TcpStream>>);

impl Reporter {
    pub fn new(stream: TcpStream) -> Self {
        Self(std::sync::Arc::new(std::sync::Mutex::new(stream)))
    }

    pub fn send(&self, msg: &Report) -> std::io::Result<()> {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        send(&mut *s, msg)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("{0}")]
    Rejected(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("protocol error: {0}")]
    Protocol(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> GroupError {
    let what = what.into();
    move |source| GroupError::Io { what, source }
}

/// Identifies the host: ranks sharing host memory must agree on it.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let name = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{name}/{}", boot.trim())
}

/// A short tag of `host_id()` (FNV-1a, 8 hex digits) that group ids carry, so that a sweep of
/// stale files judges by pid only the groups whose leader runs on its own host.
pub fn host_tag() -> String {
    let h = host_id().bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("{h:08x}")
}

/// The first field where two fingerprints differ: (field, ours, theirs).
pub fn first_difference(
    ours: &Fingerprint,
    theirs: &Fingerprint,
) -> Option<(String, String, String)> {
    let get = |fp: &Fingerprint, k: &str| {
        fp.iter()
            .find(|(f, _)| f == k)
            .map_or_else(|| "<missing>".to_string(), |(_, v)| v.clone())
    };
    let mut keys: Vec<&String> = ours.iter().map(|(k, _)| k).collect();
    keys.extend(
        theirs
            .iter()
            .map(|(k, _)| k)
            .filter(|k| !ours.iter().any(|(o, _)| o == *k)),
    );
    keys.into_iter().find_map(|k| {
        let (a, b) = (get(ours, k), get(theirs, k));
        (a != b).then(|| (k.clone(), a, b))
    })
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// How long a new rendezvous connection has to say hello before it is dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long past its rendezvous deadline a rank waits for the leader's word on it.
const VERDICT_GRACE: Duration = Duration::from_secs(1);
/// Connections whose hello is still awaited; more are closed at once (a flood cannot exhaust
/// threads).
const MAX_PENDING_HELLOS: usize = 64;

/// What the leader checks every joining rank against.
pub struct Expect<'a> {
    pub world: usize,
    pub fingerprint: &'a Fingerprint,
    pub host: &'a str,
    /// The leader's `--node-id`: ranks that name it must run on its host.
    pub node: &'a str,
    /// The leader's data listener's port.
    pub data_port: u16,
    /// --group-token ("" for none).
    pub token: &'a str,
}

/// An admitted rank: its control connection, where it runs, and its host.
struct Seated {
    stream: TcpStream,
    seat: RankNode,
    host: String,
}

/// The ranks that did join, by node ("node a ranks 0, 1; node b rank 2"): where the missing
/// ones were expected is where their node's other ranks are, or a node not heard from at all.
fn joined_by_node(leader_node: &str, slots: &[Option<Seated>]) -> String {
    let seats = std::iter::once(Some(leader_node))
        .chain(
            slots
                .iter()
                .map(|s| s.as_ref().map(|s| s.seat.node.as_str())),
        )
        .enumerate()
        .filter_map(|(rank, node)| Some((rank, node?)));
    let each: Vec<String> = crate::nodes::by_node(seats)
        .iter()
        .map(|(n, r)| {
            let word = if r.len() == 1 { "rank" } else { "ranks" };
            let r: Vec<String> = r.iter().map(usize::to_string).collect();
            format!("node {n} {word} {}", r.join(", "))
        })
        .collect();
    each.join("; ")
}

/// A connection's first message, read on a thread of its own.
type Hello = (TcpStream, SocketAddr, std::io::Result<Bringup>);

fn read_hello(mut stream: TcpStream, peer: SocketAddr, limit: Duration) -> Hello {
    let hello = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_read_timeout(Some(limit)))
        .and_then(|()| recv(&mut stream));
    (stream, peer, hello)
}

/// Leader side of the group: one control connection per other rank, index = rank - 1.
pub struct ControlLink {
    pub workers: Vec<TcpStream>,
    /// Every rank's node and data address, by rank.
    pub roster: Roster,
    /// Ranks out of the group (`--on-rank-loss continue`), by rank: nothing more is sent to
    /// them.
    pub out: Vec<bool>,
    /// The group goes on without a lost rank (`--on-rank-loss continue`).
    pub go_on: bool,
}

impl ControlLink {
    /// Accepts every rank, checks its fingerprint against ours, and welcomes the group. A
    /// connection that says nothing, sends garbage or presents the wrong token is logged and
    /// closed, and accepting goes on; a rank that joins with a different config fails the group,
    /// and every connected rank is told why before the error returns.
    pub fn accept(
        listener: &TcpListener,
        want: &Expect,
        group: &str,
        nccl_id: Option<Vec<u8>>,
        timeout: Duration,
        // Whether the group will go on without a lost rank, once the ranks' nodes are known.
        go_on: &dyn Fn(&Roster) -> Result<bool, String>,
    ) -> Result<Self, GroupError> {
        let world = want.world;
        let deadline = Instant::now() + timeout;
        let mut slots: Vec<Option<Seated>> = (1..world).map(|_| None).collect();
        listener
            .set_nonblocking(true)
            .map_err(io("rendezvous listener"))?;
        let (hello_tx, hello_rx) = std::sync::mpsc::channel::<Hello>();
        let pending = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let result = (|| {
            while slots.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        use std::sync::atomic::Ordering::AcqRel;
                        if pending.fetch_add(1, AcqRel) >= MAX_PENDING_HELLOS {
                            pending.fetch_sub(1, AcqRel);
                            tracing::warn!(%peer, "rendezvous: too many connections without a hello; closing");
                            continue;
                        }
                        let (tx, left) = (hello_tx.clone(), pending.clone());
                        let limit = HELLO_TIMEOUT.min(remaining(deadline));
                        let spawned = std::thread::Builder::new()
                            .name("rendezvous-hello".into())
                            .spawn(move || {
                                let _ = tx.send(read_hello(stream, peer, limit));
                                left.fetch_sub(1, AcqRel);
                            });
                        if let Err(e) = spawned {
                            pending.fetch_sub(1, AcqRel);
                            tracing::warn!(%peer, "rendezvous: cannot read its hello: {e}");
                        }
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(io("rendezvous accept")(e)),
                }
                match hello_rx.recv_timeout(Duration::from_millis(5)) {
                    Ok((stream, peer, hello)) => {
                        if let Some((rank, seated)) = admit(stream, peer, hello, want, &slots)? {
                            slots[rank - 1] = Some(seated);
                        }
                    }
                    Err(_) if Instant::now() >= deadline => {
                        let missing: Vec<String> = slots
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| s.is_none())
                            .map(|(i, _)| (i + 1).to_string())
                            .collect();
                        return Err(GroupError::Timeout(format!(
                            "rank(s) {} of world size {world} did not join the rendezvous within {timeout:?} (joined: {})",
                            missing.join(", "),
                            joined_by_node(want.node, &slots)
                        )));
                    }
                    Err(_) => {}
                }
            }
            Ok(())
        })();
        let (mut workers, mut seats): (Vec<TcpStream>, Vec<RankNode>) = slots
            .into_iter()
            .flatten()
            .map(|s| (s.stream, s.seat))
            .unzip();
        if let Err(e) = result {
            for w in &mut workers {
                let _ = send(
                    w,
                    &Bringup::Reject {
                        reason: e.to_string(),
                    },
                );
            }
            return Err(e);
        }
        // Peers reach the leader's data listener where they reached the leader.
        let ip = match workers.first() {
            Some(w) => w.local_addr().map_err(io("control socket"))?.ip(),
            None => std::net::Ipv4Addr::LOCALHOST.into(),
        };
        seats.insert(
            0,
            RankNode {
                node: want.node.to_string(),
                data: SocketAddr::new(ip, want.data_port).to_string(),
                pid: std::process::id(),
            },
        );
        let mut link = Self {
            out: vec![false; workers.len() + 1],
            workers,
            roster: Roster(seats.clone()),
            go_on: false,
        };
        link.go_on = match go_on(&link.roster) {
            Ok(g) => g,
            Err(why) => {
                link.reject_all(&format!("startup failed at rank 0: {why}"));
                return Err(GroupError::Rejected(why));
            }
        };
        link.broadcast(&Bringup::Welcome {
            group: group.to_string(),
            seats,
            nccl_id,
            go_on: link.go_on,
            rejoining: None,
        })?;
        Ok(link)
    }

    /// Sends `msg` to every rank, even past one that cannot be reached (a lost rank must not
    /// keep the others from hearing that the group stopped); the first failure is returned.
    pub fn broadcast<M: Serialize>(&mut self, msg: &M) -> Result<(), GroupError> {
        let mut first = Ok(());
        for (i, w) in self.workers.iter_mut().enumerate() {
            if self.out.get(i + 1).copied().unwrap_or(false) {
                continue;
            }
            let sent = send(w, msg).map_err(io(format!("sending to rank {}", i + 1)));
            if first.is_ok() {
                first = sent;
            }
        }
        first
    }

    /// Takes `rank` out of the group: nothing more is sent to it, and its connection is shut
    /// (a stopped rank that wakes finds it closed and exits).
    pub fn lose(&mut self, rank: usize) {
        if let Some(o) = self.out.get_mut(rank) {
            *o = true;
        }
        if let Some(w) = rank.checked_sub(1).and_then(|i| self.workers.get(i)) {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }

    /// `rank` is back (restarted, its bring-up done): orders go to it on `stream` again.
    pub fn readmit(&mut self, rank: usize, stream: TcpStream) -> Result<(), GroupError> {
        stream
            .set_read_timeout(None)
            .map_err(io("control socket"))?;
        if let (Some(w), Some(o)) = (
            rank.checked_sub(1).and_then(|i| self.workers.get_mut(i)),
            self.out.get_mut(rank),
        ) {
            *w = stream;
            *o = false;
        }
        Ok(())
    }

    /// Waits until every rank has sent `expect(rank)`.
    pub fn gather(
        &mut self,
        what: &str,
        deadline: Instant,
        expect: impl Fn(usize) -> Bringup,
    ) -> Result<(), GroupError> {
        for (i, w) in self.workers.iter_mut().enumerate() {
            let rank = i + 1;
            match recv_until(w, deadline, what, &format!("rank {rank}"))? {
                m if m == expect(rank) => {}
                Bringup::Failed { reason, .. } => {
                    return Err(GroupError::Rejected(format!(
                        "rank {rank} failed: {reason}"
                    )))
                }
                m => {
                    return Err(GroupError::Protocol(format!(
                        "rank {rank} sent {m:?}, expected {what}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// `--ingress all`: every rank's gRPC address (`Listening`), by rank, with `ours` first.
    pub fn gather_listening(
        &mut self,
        ours: String,
        deadline: Instant,
    ) -> Result<Vec<String>, GroupError> {
        let mut addrs = vec![ours];
        for (i, w) in self.workers.iter_mut().enumerate() {
            let rank = i + 1;
            let what = "its gRPC address";
            match recv_until(w, deadline, what, &format!("rank {rank}"))? {
                Report::Ingress(IngressReport::Listening { rank: r, addr }) if r == rank => {
                    addrs.push(addr)
                }
                Report::Failed { reason, .. } => {
                    return Err(GroupError::Rejected(format!(
                        "rank {rank} failed: {reason}"
                    )))
                }
                m => {
                    return Err(GroupError::Protocol(format!(
                        "rank {rank} sent {m:?}, expected its gRPC address"
                    )))
                }
            }
        }
        Ok(addrs)
    }

    /// Tells every rank that startup failed (best effort: the ranks time out otherwise).
    pub fn reject_all(&mut self, reason: &str) {
        for w in &mut self.workers {
            let _ = send(
                w,
                &Bringup::Reject {
                    reason: reason.to_string(),
                },
            );
        }
    }

    pub fn clear_timeouts(&self) -> Result<(), GroupError> {
        for w in &self.workers {
            w.set_read_timeout(None).map_err(io("control socket"))?;
        }
        Ok(())
    }
}

/// One connection's hello: Some((rank, stream)) for a rank of ours, None for a stray (logged and
/// closed), an error for a rank whose config differs (it is told why; the group fails).
fn admit(
    mut stream: TcpStream,
    peer: SocketAddr,
    hello: std::io::Result<Bringup>,
    want: &Expect,
    slots: &[Option<Seated>],
) -> Result<Option<(usize, Seated)>, GroupError> {
    let (rank, world, host, seat, theirs, token) = match hello {
        Ok(Bringup::Hello {
            rank,
            world,
            host,
            seat,
            fingerprint,
            token,
        }) => (rank, world, host, seat, fingerprint, token),
        Ok(other) => {
            tracing::warn!(%peer, "rendezvous: {} before hello; closing", other.name());
            return Ok(None);
        }
        Err(e) => {
            tracing::warn!(%peer, "rendezvous: no hello ({e}); closing");
            return Ok(None);
        }
    };
    if !crate::flags::same_secret(&token, want.token) {
        tracing::warn!(%peer, rank, "rendezvous: wrong or missing --group-token; closing");
        let _ = send(
            &mut stream,
            &Bringup::Reject {
                reason: "wrong or missing group token (--group-token)".into(),
            },
        );
        return Ok(None);
    }
    let w = want.world;
    // Without a token anyone who reaches the port can say hello: one that names no seat of this
    // group (another world size, a rank out of range) is a stray, refused and closed, rather
    // than a reason to fail the group. With a token, whoever holds it is one of ours.
    let seatless = if world != w {
        Some(format!(
            "config mismatch: rank {rank} has world_size={world}, rank 0 has {w}"
        ))
    } else if rank == 0 || rank >= w {
        Some(format!("rank {rank} is out of range for world size {w}"))
    } else {
        None
    };
    if let Some(reason) = seatless.as_ref().filter(|_| want.token.is_empty()) {
        tracing::warn!(%peer, "rendezvous: {reason}; closing (no --group-token: a stray)");
        let _ = send(
            &mut stream,
            &Bringup::Reject {
                reason: reason.clone(),
            },
        );
        return Ok(None);
    }
    let problem = if seatless.is_some() {
        seatless
    } else if slots[rank - 1].is_some() {
        Some(format!("rank {rank} joined twice"))
    } else if let Some((field, ours, theirs)) = first_difference(want.fingerprint, &theirs) {
        Some(format!(
            "config mismatch in '{field}': rank {rank} has {theirs}, rank 0 has {ours}"
        ))
    } else if let Some((other, their_host)) = node_host(want, slots, &seat.node, &host) {
        Some(format!(
            "rank {rank} says it is on node {:?} but runs on host {host}, and rank {other} of that node on {their_host}: ranks of one --node-id share its memory and must share a host",
            seat.node
        ))
    } else {
        None
    };
    if let Some(reason) = problem {
        let _ = send(
            &mut stream,
            &Bringup::Reject {
                reason: reason.clone(),
            },
        );
        return Err(GroupError::Rejected(reason));
    }
    stream
        .set_read_timeout(None)
        .map_err(io("rendezvous socket"))?;
    Ok(Some((rank, Seated { stream, seat, host })))
}

/// A rank already admitted (or the leader) on `node` whose host is not `host`: (its rank, its
/// host).
fn node_host<'a>(
    want: &'a Expect,
    slots: &'a [Option<Seated>],
    node: &str,
    host: &str,
) -> Option<(usize, &'a str)> {
    let leader = (want.node == node && want.host != host).then_some((0, want.host));
    leader.or_else(|| {
        slots.iter().enumerate().find_map(|(i, s)| {
            s.as_ref()
                .filter(|s| s.seat.node == node && s.host != host)
                .map(|s| (i + 1, s.host.as_str()))
        })
    })
}

/// A group id as the leader makes it (hex and dashes): it names files under --shm-dir.
pub fn valid_group_id(g: &str) -> bool {
    (1..=64).contains(&g.len()) && g.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// What a rank gets from the rendezvous.
pub struct Joined {
    pub stream: TcpStream,
    pub group: String,
    pub nccl_id: Option<Vec<u8>>,
    /// Every rank's node and data address, by rank.
    pub roster: Roster,
    /// The group goes on without a lost rank (`Bringup::Welcome::go_on`).
    pub go_on: bool,
    /// This rank comes back into a running group without these ranks
    /// (`Bringup::Welcome::rejoining`).
    pub rejoining: Option<Vec<u32>>,
}

/// Who joins: its place, its node and data listener's port.
pub struct Joiner<'a> {
    pub place: crate::place::Place,
    pub node: &'a str,
    pub data_port: u16,
}

/// Rank side: connects to the leader (retrying until the deadline) and says hello.
pub fn join(
    addr: &str,
    me: &Joiner,
    fingerprint: &Fingerprint,
    token: &str,
    timeout: Duration,
) -> Result<Joined, GroupError> {
    let (rank, world) = (me.place.rank, me.place.world);
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map(|a| a.collect())
            .unwrap_or_default();
        if let Some(s) = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).ok())
        {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(GroupError::Timeout(format!(
                "rank {rank}: leader (rank 0) at {addr} was not reachable within {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    stream.set_nodelay(true).map_err(io("control socket"))?;
    // Peers on other nodes reach this rank's data listener where it reaches the leader from.
    let ip = stream.local_addr().map_err(io("control socket"))?.ip();
    send(
        &mut stream,
        &Bringup::Hello {
            rank,
            world,
            host: host_id(),
            seat: RankNode {
                node: me.node.to_string(),
                data: SocketAddr::new(ip, me.data_port).to_string(),
                pid: std::process::id(),
            },
            fingerprint: fingerprint.clone(),
            token: token.to_string(),
        },
    )
    .map_err(io("sending hello"))?;
    // The leader's own deadline began before this one; its verdict names who is missing, so it
    // gets a moment past ours to arrive (a busy machine once had this rank time out first).
    match expect(&mut stream, "welcome", deadline + VERDICT_GRACE)? {
        Bringup::Welcome { group, .. } if !valid_group_id(&group) => Err(GroupError::Protocol(
            format!("the leader sent group id {group:?}, which is not hex"),
        )),
        Bringup::Welcome { seats, .. } if seats.len() != world => {
            Err(GroupError::Protocol(format!(
                "the leader sent {} seats for a world of {world}",
                seats.len()
            )))
        }
        Bringup::Welcome {
            group,
            seats,
            nccl_id,
            go_on,
            rejoining,
        } => Ok(Joined {
            stream,
            group,
            nccl_id,
            roster: Roster(seats),
            go_on,
            rejoining,
        }),
        other => Err(GroupError::Protocol(format!(
            "expected welcome, got {other:?}"
        ))),
    }
}

/// Rank side: the leader's next message before `deadline`; a `Reject` becomes an error with its
/// reason.
pub fn expect(
    stream: &mut TcpStream,
    what: &str,
    deadline: Instant,
) -> Result<Bringup, GroupError> {
    match recv_until(stream, deadline, what, "the leader (rank 0)")? {
        Bringup::Reject { reason } => Err(GroupError::Rejected(reason)),
        m => Ok(m),
    }
}

/// The next message from `from` before `deadline`.
fn recv_until<M: DeserializeOwned>(
    stream: &mut TcpStream,
    deadline: Instant,
    what: &str,
    from: &str,
) -> Result<M, GroupError> {
    stream
        .set_read_timeout(Some(remaining(deadline)))
        .map_err(io("control socket"))?;
    recv(stream).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            GroupError::Timeout(format!("no {what} from {from} in time"))
        }
        _ => io(format!("waiting for {what} from {from}"))(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broadcast_reaches_every_rank_past_one_it_cannot() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut far = Vec::new();
        let mut workers = Vec::new();
        for _ in 0..3 {
            far.push(TcpStream::connect(addr).unwrap());
            workers.push(listener.accept().unwrap().0);
        }
        // Rank 2's connection can no longer be written.
        workers[1].shutdown(std::net::Shutdown::Write).unwrap();
        let mut link = ControlLink {
            out: vec![false; workers.len() + 1],
            workers,
            roster: Roster(Vec::new()),
            go_on: false,
        };
        let e = link.broadcast(&Order::Shutdown).unwrap_err();
        assert!(e.to_string().contains("rank 2"), "{e}");
        for r in [0, 2] {
            far[r]
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            assert_eq!(
                recv::<Order>(&mut far[r]).unwrap(),
                Order::Shutdown,
                "rank {}",
                r + 1
            );
        }
    }

    #[test]
    fn ranks_naming_one_node_must_share_its_host() {
        let fingerprint = Vec::new();
        let want = Expect {
            world: 3,
            fingerprint: &fingerprint,
            host: "h0",
            node: "a",
            data_port: 1,
            token: "",
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _far = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let seated = Seated {
            stream: listener.accept().unwrap().0,
            seat: RankNode {
                node: "b".into(),
                data: String::new(),
                pid: 0,
            },
            host: "h1".into(),
        };
        let slots = vec![Some(seated), None];
        assert_eq!(node_host(&want, &slots, "a", "h0"), None);
        assert_eq!(node_host(&want, &slots, "a", "h9"), Some((0, "h0")));
        assert_eq!(node_host(&want, &slots, "b", "h1"), None);
        assert_eq!(node_host(&want, &slots, "b", "h0"), Some((1, "h1")));
        // Another node on a host already seen: simulated nodes share one host.
        assert_eq!(node_host(&want, &slots, "c", "h0"), None);
    }

    #[test]
    fn first_difference_names_the_field() {
        let a = vec![("x".into(), "1".into()), ("y".into(), "2".into())];
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b[1].1 = "3".into();
        assert_eq!(
            first_difference(&a, &b),
            Some(("y".into(), "2".into(), "3".into()))
        );
        b.push(("z".into(), "9".into()));
        b[1].1 = "2".into();
        assert_eq!(
            first_difference(&a, &b),
            Some(("z".into(), "<missing>".into(), "9".into()))
        );
    }
}
