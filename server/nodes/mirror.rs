//! Shared-memory writes to a rank on another node. The sender queues `write`s (bytes at an
//! offset of one of the receiver's mappings) and `raise`s (a flag set to a step's sequence
//! number, which flushes); the receiver applies each frame to its own mapping in arrival order,
//! so a flag is raised there only after the bytes it publishes, exactly as in shared memory.
//!
//! Frame: 24 bytes (kind u8, target u8, 6 zero bytes, offset u64 LE, length or sequence u64 LE),
//! then `length` bytes for a write. The receiver checks every offset against its mapping before
//! it touches it; a frame out of bounds or of an unknown kind ends the connection with an error.

use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

use crate::metric_names;
use crate::sys::shm::{bytes_of, Pod, Shm};

/// Which of the receiver's mappings a frame writes into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Target {
    /// Its cpu backend's exchange segment.
    Segment = 0,
    /// Its node's step ring (rank 0's, or a node leader's).
    Ring = 1,
}

const WRITE: u8 = 1;
const RAISE: u8 = 2;
const HEADER: usize = 24;
/// Queued bytes before a write goes out without waiting for the next `raise`.
const BUFFER: usize = 1 << 20;

fn header(kind: u8, target: Target, off: usize, n: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind;
    h[1] = target as u8;
    h[8..16].copy_from_slice(&(off as u64).to_le_bytes());
    h[16..24].copy_from_slice(&n.to_le_bytes());
    h
}

/// This rank's sending end to one rank of another node; shared by the threads that write to it.
pub struct DataLink {
    peer: usize,
    out: Mutex<Out>,
    sent: metrics::Counter,
}

struct Out {
    w: BufWriter<TcpStream>,
    /// The first failure: later writes are dropped and every `raise` reports it.
    broken: Option<String>,
    /// Bytes queued since the counter was last moved.
    queued: u64,
}

impl DataLink {
    /// `timeout` bounds each send (a stopped peer stops reading; the step fails, not hangs);
    /// `rank` is this rank, the label of the bytes it sends across nodes.
    pub fn new(
        peer: usize,
        stream: TcpStream,
        timeout: Duration,
        rank: usize,
    ) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Self {
            peer,
            out: Mutex::new(Out {
                w: BufWriter::with_capacity(BUFFER, stream),
                broken: None,
                queued: 0,
            }),
            sent: metrics::counter!(metric_names::CROSS_NODE_BYTES_TOTAL, "rank" => rank.to_string()),
        })
    }

    fn send(&self, head: [u8; HEADER], body: &[u8], flush: bool) -> Result<(), String> {
        let mut o = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if o.broken.is_none() {
            let mut go = || -> std::io::Result<()> {
                o.w.write_all(&head)?;
                o.w.write_all(body)?;
                if flush {
                    o.w.flush()?;
                }
                Ok(())
            };
            if let Err(e) = go() {
                o.broken = Some(format!("data connection to rank {}: {e}", self.peer));
            }
            o.queued += (HEADER + body.len()) as u64;
            if flush {
                self.sent.increment(std::mem::take(&mut o.queued));
            }
        }
        o.broken.clone().map_or(Ok(()), Err)
    }

    /// Queues a copy of `src` to byte `off` of the peer's `target`. A failure is kept and told
    /// by the next `raise` (the writes of one phase come from several threads; the phase's
    /// raise is where it can fail).
    pub fn write<T: Pod>(&self, target: Target, off: usize, src: &[T]) {
        let body = bytes_of(src);
        let _ = self.send(header(WRITE, target, off, body.len() as u64), body, false);
    }

    /// Sets the peer's flag at `off` of `target` to `seq`, after every write queued before it.
    pub fn raise(&self, target: Target, off: usize, seq: u64) -> Result<(), String> {
        self.send(header(RAISE, target, off, seq), &[], true)
    }
}

/// What a rank's receivers write into: its own mappings of its segment and node ring.
#[derive(Default)]
pub struct Targets {
    pub segment: Option<Shm>,
    pub ring: Option<Shm>,
}

impl Targets {
    fn get(&self, target: u8) -> Option<&Shm> {
        match target {
            0 => self.segment.as_ref(),
            1 => self.ring.as_ref(),
            _ => None,
        }
    }
}

/// Applies `peer`'s frames to `targets` until the connection closes between frames (Ok) or
/// breaks, or a frame is out of bounds (Err, naming the frame), or the group went on without
/// `peer` (`fenced`: its frames are dropped, and the connection closed).
pub fn apply(
    stream: TcpStream,
    peer: usize,
    targets: &Targets,
    fenced: &dyn Fn() -> bool,
) -> std::io::Result<()> {
    let bad = |msg: String| std::io::Error::new(ErrorKind::InvalidData, msg);
    let mut r = BufReader::with_capacity(BUFFER, stream);
    loop {
        let mut h = [0u8; HEADER];
        // A clean end is a close between frames.
        match r.read(&mut h[..1])? {
            0 => return Ok(()),
            _ => r.read_exact(&mut h[1..])?,
        }
        if fenced() {
            tracing::warn!(peer, "a frame from rank {peer}, which the group went on without: dropped, connection closed");
            return Ok(());
        }
        let word = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let (off, n) = (word(8), word(16));
        let shm = targets.get(h[1]).ok_or_else(|| {
            bad(format!(
                "rank {peer} wrote to target {}, which this rank does not hold",
                h[1]
            ))
        })?;
        let within = |len: u64, align: u64| {
            off % align == 0 && off.checked_add(len).is_some_and(|e| e <= shm.len() as u64)
        };
        match h[0] {
            WRITE if within(n, 1) => shm.fill(off as usize, n as usize, |b| r.read_exact(b))?,
            RAISE if within(8, 8) => crate::sys::shm::raise(shm.flag(off as usize), n),
            kind => {
                return Err(bad(format!(
                    "rank {peer} sent frame kind {kind} at offset {off} (+{n}) of target {}: out of bounds or unknown",
                    h[1]
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Arc;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    #[test]
    fn writes_land_before_their_flag_and_bad_frames_are_refused() {
        let dir = std::env::temp_dir().join(format!("epserve-mirror-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let seg = Shm::create(&dir.join("seg"), 4096).unwrap();
        let mine = Shm::open(&dir.join("seg"), 4096).unwrap();
        let (tx, rx) = pair();
        let link = DataLink::new(1, tx, Duration::from_secs(5), 0).unwrap();
        let targets = Arc::new(Targets {
            segment: Some(mine),
            ring: None,
        });
        let t = {
            let targets = targets.clone();
            std::thread::spawn(move || apply(rx, 0, &targets, &|| false))
        };
        link.write(Target::Segment, 64, &[1.5f32, -2.0]);
        link.raise(Target::Segment, 0, 7).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        crate::sys::shm::wait_seq(seg.flag(0), 7, deadline, &Default::default()).unwrap();
        let mut got = [0f32; 2];
        seg.read(64, &mut got);
        assert_eq!(got, [1.5, -2.0]);
        // Past the end of the segment: the receiver refuses it and drops the connection.
        link.write(Target::Segment, 4090, &[0u32; 4]);
        let _ = link.raise(Target::Segment, 8, 8);
        let e = t.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("out of bounds"), "{e}");
        assert_eq!(seg.flag(8).load(std::sync::atomic::Ordering::Acquire), 0);
        // A target the receiver does not hold.
        let (tx, rx) = pair();
        let link = DataLink::new(1, tx, Duration::from_secs(5), 0).unwrap();
        link.raise(Target::Ring, 0, 1).unwrap();
        let e = apply(rx, 0, &Targets::default(), &|| false).unwrap_err();
        assert!(e.to_string().contains("does not hold"), "{e}");
        // From a rank the group went on without: dropped, and the connection closed.
        let (tx, rx) = pair();
        let link = DataLink::new(1, tx, Duration::from_secs(5), 0).unwrap();
        link.write(Target::Segment, 64, &[9.0f32, 9.0]);
        link.raise(Target::Segment, 0, 9).unwrap();
        apply(rx, 0, &targets, &|| true).unwrap();
        seg.read(64, &mut got);
        assert_eq!(got, [1.5, -2.0]);
        assert_eq!(seg.flag(0).load(std::sync::atomic::Ordering::Acquire), 7);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
