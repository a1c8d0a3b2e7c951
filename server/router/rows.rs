//! Copies between requests and the step ring: a step's input rows in, its output rows out,
//! straight from and into the requests' own buffers, on several threads when a step is large.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Step;
use crate::bufs::{Bufs, OUTPUT_BUFFERS_REUSED};
use crate::step::ring::Ring;

/// A step's input rows copied from its requests into the ring, on this rank.
pub const PACK_SECONDS: &str = "epserve_step_pack_seconds";
/// A finished step's output rows copied out of the ring to its requests, on this rank.
pub const DELIVER_SECONDS: &str = "epserve_step_deliver_seconds";

/// Below this many bytes a step's rows are copied on one thread: starting more costs more than
/// it saves.
const SPLIT_BYTES: usize = 4 << 20;
/// Rows are handed to the copy threads in pieces of about this size.
const PIECE_BYTES: usize = 1 << 20;

/// Threads that copy one large step's rows between the requests and the ring: memory bandwidth,
/// not one core's copy rate, bounds what a step of MB requests costs the router.
pub(crate) fn copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// The answers' buffers of one rank: it keeps unused ones up to one slot's output rows in f32
/// (the most one step delivers), and at least 64 MiB (the default largest request), for answers
/// larger than a step.
pub(crate) fn out_bufs(ring: &Ring) -> Arc<Bufs> {
    Bufs::new(
        (ring.shape.max_tokens * ring.shape.hidden * 4).max(64 << 20),
        OUTPUT_BUFFERS_REUSED,
    )
}

/// Runs `f` on every item, on up to `threads` threads when `bytes` is large.
fn copy_all<T: Send>(threads: usize, bytes: usize, items: Vec<T>, f: impl Fn(T) + Sync) {
    let threads = if bytes < SPLIT_BYTES {
        1
    } else {
        threads.min(items.len())
    };
    if threads <= 1 {
        items.into_iter().for_each(f);
        return;
    }
    let queue = Mutex::new(items.into_iter());
    let next = || queue.lock().unwrap_or_else(|e| e.into_inner()).next();
    let work = || {
        while let Some(item) = next() {
            f(item);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(work);
        }
        work();
    });
}

/// Writes a step's input rows into `slot` from row `base` on, straight from the requests' bytes.
pub(crate) fn pack(ring: &Ring, step: &Step, slot: usize, base: usize, threads: usize) {
    let t = Instant::now();
    let (h, k) = (ring.shape.hidden, ring.shape.top_k);
    let row_bytes = h * step.input.bytes();
    let per = (PIECE_BYTES / row_bytes).max(1);
    let mut pieces: Vec<(usize, &[u8])> = Vec::new();
    let mut row = base;
    for seg in &step.segments {
        let (a, b) = (seg.rows.start, seg.rows.end);
        let data = &seg.job.input.hidden.data[a * row_bytes..b * row_bytes];
        for (i, piece) in data.chunks(per * row_bytes).enumerate() {
            pieces.push((row + i * per, piece));
        }
        if let Some((ids, w)) = &seg.job.input.routing {
            ring.write_routing(slot, row, &ids[a * k..b * k], &w[a * k..b * k]);
        }
        row += seg.rows.len();
    }
    copy_all(threads, (row - base) * row_bytes, pieces, |(r, src)| {
        ring.write_hidden(slot, r, step.input, src)
    });
    let took = t.elapsed();
    for seg in &step.segments {
        seg.job.packed(took);
    }
    metrics::histogram!(PACK_SECONDS).record(took.as_secs_f64());
}

/// Hands a finished step's output rows in `slot`, from row `base` on, to its requests, in their
/// output dtype, in buffers from `bufs`.
pub(crate) fn deliver(
    ring: &Ring,
    step: &Step,
    slot: usize,
    base: usize,
    threads: usize,
    bufs: &Arc<Bufs>,
) {
    let t = Instant::now();
    let row_bytes = ring.shape.hidden * step.output.bytes();
    let per = (PIECE_BYTES / row_bytes).max(1);
    // A request has one segment per step: its buffer is filled outside its lock, then put back.
    let mut outs: Vec<Vec<u8>> = step
        .segments
        .iter()
        .map(|s| s.job.take_out(row_bytes, bufs))
        .collect();
    let mut pieces: Vec<(usize, &mut [u8])> = Vec::new();
    let mut row = base;
    for (seg, out) in step.segments.iter().zip(outs.iter_mut()) {
        let dst = &mut out[seg.rows.start * row_bytes..seg.rows.end * row_bytes];
        for (i, piece) in dst.chunks_mut(per * row_bytes).enumerate() {
            pieces.push((row + i * per, piece));
        }
        row += seg.rows.len();
    }
    copy_all(threads, (row - base) * row_bytes, pieces, |(r, dst)| {
        ring.read_output(slot, r, step.output, dst)
    });
    let took = t.elapsed();
    for (seg, out) in step.segments.iter().zip(outs) {
        seg.job.put_out(out, seg.rows.len(), took, bufs);
    }
    metrics::histogram!(DELIVER_SECONDS).record(took.as_secs_f64());
}
