//! Copies between requests and the step ring: a step's input rows in, its output rows out,
//! straight from and into the requests' own buffers, on several threads when a step is large.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::job::{Job, Step};
use crate::metric_names;
use crate::request::ClientSpan;
use crate::request::{Data, Failure};
use crate::step::direct::DirectRun;
use crate::step::ring::Ring;
use crate::transport::bufs::Bufs;

/// Below this many bytes a step's rows are copied on one thread: starting more costs more than
/// it saves.
const SPLIT_BYTES: usize = 4 << 20;
/// Rows are handed to the copy threads in pieces of about this size.
const PIECE_BYTES: usize = 1 << 20;

/// Threads that copy one large step's rows between the requests and the ring: memory bandwidth,
/// not one core's copy rate, bounds what a step of MB requests costs the leader.
pub(crate) fn copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// The answers' buffers of one rank: it keeps unused ones up to one cell's output rows in f32
/// (the most one step delivers), and at least 64 MiB (the default largest request), for answers
/// larger than a step.
pub(crate) fn out_bufs(ring: &Ring) -> Arc<Bufs> {
    Bufs::new(
        (ring.shape.max_tokens * ring.shape.hidden * 4).max(64 << 20),
        metric_names::OUTPUT_BUFFERS_REUSED_TOTAL,
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

/// The cell rows that this process's own GPU rank loads for `step` when the leader packs it
/// (rank 0's home: its clients' rows under `--ingress all`, else its even share).
pub(crate) fn leader_rows(step: &Step, world: usize) -> Range<usize> {
    match step.homes.first() {
        Some(&n) => 0..n as usize,
        None => crate::step::home_range(step.group_tokens(), world, 0),
    }
}

/// `a` split by `b`: the part inside `b`, then the parts of `a` before and after it.
fn split(a: Range<usize>, b: &Range<usize>) -> (Range<usize>, [Range<usize>; 2]) {
    let inside = a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start));
    let before = a.start..b.start.clamp(a.start, a.end);
    let after = b.end.clamp(a.start, a.end)..a.end;
    (inside, [before, after])
}

/// A piece of a request's rows between the ring (cell rows `rows`) and a client's memory.
struct Piece<'a> {
    rows: Range<usize>,
    span: ClientSpan,
    /// The request, its index in the step, and its row of the ring's first.
    job: &'a Arc<Job>,
    seg: usize,
    job_row: usize,
}

/// A request's rows `rows` of the cell (its segment starts at cell row `row`, at its own row
/// `first`) in pieces of at most `per` rows of `row_bytes`, as parts of `span`.
#[allow(clippy::too_many_arguments)]
fn cut<'a>(
    out: &mut Vec<Piece<'a>>,
    rows: Range<usize>,
    (row, first): (usize, usize),
    per: usize,
    row_bytes: usize,
    span: &ClientSpan,
    job: &'a Arc<Job>,
    seg: usize,
) {
    for start in rows.clone().step_by(per) {
        let end = (start + per).min(rows.end);
        let job_row = start - row + first;
        out.push(Piece {
            rows: start..end,
            span: span.part(job_row * row_bytes, (end - start) * row_bytes),
            job,
            seg,
            job_row,
        });
    }
}

/// Writes a step's input rows into `cell` from row `base` on, straight from where the requests
/// have them: their bytes, or a client's memory read straight into the ring (a POSIX object's
/// rows checked for non-finite values there: a request with one fails INVALID_ARGUMENT and its
/// rows are zeroed). Rows in a client's device memory that this process's GPU rank loads
/// (`own`) stay there, a direct run of the cell; so do the output rows it will write for a
/// request whose output goes to device memory.
pub(crate) fn pack(
    ring: &Ring,
    step: &Step,
    cell: usize,
    base: usize,
    threads: usize,
    own: Range<usize>,
) {
    let t = Instant::now();
    let (h, k, d) = (ring.shape.hidden, ring.shape.top_k, step.input);
    let row_bytes = h * d.bytes();
    let out_bytes = h * step.output.bytes();
    let per = (PIECE_BYTES / row_bytes).max(1);
    let mut pieces: Vec<(usize, &[u8])> = Vec::new();
    let mut reads: Vec<Piece> = Vec::new();
    let mut runs = Vec::new();
    let mut row = base;
    for (i, seg) in step.segments.iter().enumerate() {
        let (a, b) = (seg.rows.start, seg.rows.end);
        let input = &seg.job.input;
        // Cell rows `r` are the job's rows `r - row + a`.
        let at = row..row + seg.rows.len();
        let (mine, others) = split(at.clone(), &own);
        let mut run = DirectRun {
            rows: mine.clone(),
            input: None,
            output: None,
        };
        match &input.hidden.data {
            Data::Host(data) => {
                let data = &data[a * row_bytes..b * row_bytes];
                for (i, piece) in data.chunks(per * row_bytes).enumerate() {
                    pieces.push((row + i * per, piece));
                }
            }
            Data::Client(span) => {
                let read = match span.device_address() {
                    Some(_) if !mine.is_empty() => {
                        let off = (mine.start - row + a) * row_bytes;
                        run.input = Some(span.part(off, mine.len() * row_bytes));
                        others.to_vec()
                    }
                    _ => vec![at.clone()],
                };
                for r in read.into_iter().filter(|r| !r.is_empty()) {
                    cut(&mut reads, r, (row, a), per, row_bytes, span, &seg.job, i);
                }
            }
        }
        if let Some(to) = &input.output_to {
            if to.device_address().is_some() && !mine.is_empty() {
                let off = (mine.start - row + a) * out_bytes;
                run.output = Some(to.part(off, mine.len() * out_bytes));
            }
        }
        if run.input.is_some() || run.output.is_some() {
            runs.push((i, run));
        }
        if let Some((ids, w)) = &input.routing {
            ring.write_routing(cell, row, &ids[a * k..b * k], &w[a * k..b * k]);
        }
        row += seg.rows.len();
    }
    copy_all(threads, (row - base) * row_bytes, pieces, |(r, src)| {
        ring.write_hidden(cell, r, d, src)
    });
    // Straight from the clients' memory into the ring; what fails, by request.
    let failed = Mutex::new(Vec::new());
    let bytes = reads.iter().map(|p| p.span.len).sum();
    copy_all(threads, bytes, reads, |p| {
        let checked = p.span.device_address().is_some();
        let r = ring.fill_hidden(cell, p.rows.clone(), d, |dst| {
            p.span
                .read(dst)
                .map_err(|e| format!("hidden_states: reading the client's shared memory: {e}"))?;
            match crate::dtype::first_non_finite(d, dst).filter(|_| !checked) {
                Some(i) => Err(format!(
                    "hidden_states: non-finite value at row {}, column {}",
                    p.job_row + i / h,
                    i % h
                )),
                None => Ok(()),
            }
        });
        if let Err(why) = r {
            failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((p.seg, p.job_row, why, p.job));
        }
    });
    let mut failed = failed.into_inner().unwrap_or_else(|e| e.into_inner());
    // The first failure of each request, by its rows; its rows in the ring zeroed and its direct
    // runs dropped, so that no rank computes on what was refused or writes to its memory.
    failed.sort_by_key(|f| (f.0, f.1));
    failed.dedup_by_key(|f| f.0);
    runs.retain(|(i, _)| failed.iter().all(|f| f.0 != *i));
    ring.direct
        .set(cell, runs.into_iter().map(|(_, r)| r).collect());
    for (seg, _, why, job) in failed {
        let start = base
            + step.segments[..seg]
                .iter()
                .map(|s| s.rows.len())
                .sum::<usize>();
        let rows = start..start + step.segments[seg].rows.len();
        ring.fill_hidden(cell, rows, d, |dst| dst.fill(0));
        crate::rejections::count_rejection("invalid_argument");
        job.fail(Failure::invalid(why));
    }
    let took = t.elapsed();
    for seg in &step.segments {
        seg.job.packed(took);
    }
    metrics::histogram!(metric_names::STEP_PACK_SECONDS).record(took.as_secs_f64());
}

/// Hands a finished step's output rows in `cell`, from row `base` on, to its requests, in their
/// output dtype: into buffers from `bufs`, or, for a request whose output goes to a client's
/// memory, straight from the ring into it (but for the rows this process's GPU rank wrote there
/// itself, `own`, in device memory), answering with no bytes. Clears the cell's direct runs.
pub(crate) fn deliver(
    ring: &Ring,
    step: &Step,
    cell: usize,
    base: usize,
    threads: usize,
    bufs: &Arc<Bufs>,
    own: Range<usize>,
) {
    let t = Instant::now();
    let d = step.output;
    let row_bytes = ring.shape.hidden * d.bytes();
    let per = (PIECE_BYTES / row_bytes).max(1);
    // A request has one segment per step: its buffer is filled outside its lock, then put back.
    let mut outs: Vec<Option<Vec<u8>>> = step
        .segments
        .iter()
        .map(|s| match s.job.input.output_to {
            Some(_) => None,
            None => Some(s.job.take_out(row_bytes, bufs)),
        })
        .collect();
    let mut pieces: Vec<(usize, &mut [u8])> = Vec::new();
    let mut writes: Vec<Piece> = Vec::new();
    let mut row = base;
    for (i, (seg, out)) in step.segments.iter().zip(outs.iter_mut()).enumerate() {
        let at = row..row + seg.rows.len();
        match (out, &seg.job.input.output_to) {
            (Some(out), _) => {
                let dst = &mut out[seg.rows.start * row_bytes..seg.rows.end * row_bytes];
                for (i, piece) in dst.chunks_mut(per * row_bytes).enumerate() {
                    pieces.push((row + i * per, piece));
                }
            }
            // Refused at packing, or its client gone: nothing more goes to its memory.
            (None, Some(_)) if seg.job.abandoned() => {}
            (None, Some(to)) => {
                let (_, others) = split(at.clone(), &own);
                let write = match to.device_address() {
                    Some(_) => others.to_vec(),
                    None => vec![at],
                };
                for r in write.into_iter().filter(|r| !r.is_empty()) {
                    let first = seg.rows.start;
                    cut(
                        &mut writes,
                        r,
                        (row, first),
                        per,
                        row_bytes,
                        to,
                        &seg.job,
                        i,
                    );
                }
            }
            (None, None) => unreachable!("a buffer is taken for every host output"),
        }
        row += seg.rows.len();
    }
    copy_all(threads, (row - base) * row_bytes, pieces, |(r, dst)| {
        ring.read_output(cell, r, d, dst)
    });
    let bytes = writes.iter().map(|p| p.span.len).sum();
    copy_all(threads, bytes, writes, |p| {
        if let Err(e) = ring.view_output(cell, p.rows.clone(), d, |src| p.span.write(src)) {
            p.job.fail(Failure::invalid(format!(
                "output: writing to the client's shared memory: {e}"
            )));
        }
    });
    ring.direct.set(cell, Vec::new());
    let took = t.elapsed();
    for (seg, out) in step.segments.iter().zip(outs) {
        seg.job.put_out(out, seg.rows.len(), took, bufs);
    }
    metrics::histogram!(metric_names::STEP_DELIVER_SECONDS).record(took.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::request::ClientMemory;
    use crate::request::{JobInput, Rows};
    use crate::sched::{Job, Segment};
    use crate::step::ring::{Output, RingShape};

    /// Host bytes standing in for a client's memory: a GPU's when `device`.
    struct Fake(Mutex<Vec<u8>>, bool);

    impl ClientMemory for Fake {
        fn device_address(&self) -> Option<u64> {
            self.1.then_some(0)
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
            let m = self.0.lock().unwrap();
            out.copy_from_slice(&m[offset as usize..offset as usize + out.len()]);
            Ok(())
        }
        fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
            let mut m = self.0.lock().unwrap();
            m[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    const H: usize = 3;

    fn row(v: f32) -> Vec<u8> {
        crate::dtype::encode(&[v; H], Dtype::F32)
    }

    fn rows(vs: impl IntoIterator<Item = f32>) -> Vec<u8> {
        vs.into_iter().flat_map(row).collect()
    }

    fn job(
        tokens: usize,
        hidden: Data,
        output_to: Option<ClientSpan>,
    ) -> (
        Arc<Job>,
        tokio::sync::oneshot::Receiver<crate::request::Reply>,
    ) {
        let input = JobInput {
            id: String::new(),
            layer: 0,
            tokens,
            hidden: Rows {
                dtype: Dtype::F32,
                data: hidden,
            },
            output: Dtype::F32,
            routing: None,
            deadline: None,
            output_to,
        };
        Job::new(input, None)
    }

    /// Two ranks, the leader's own the first four rows: a request on the host is packed as
    /// ever; one in device memory leaves its own rows there (a direct run, input and output)
    /// and has the other rank's staged through the ring both ways, answering with no bytes.
    #[test]
    fn device_rows_go_direct_for_this_rank_and_through_the_ring_for_others() {
        let path = std::env::temp_dir().join(format!("epserve-rows-{}", std::process::id()));
        let ring = Ring::create(&path, RingShape::new(1, 2, 4, H, 1)).unwrap();
        ring.unlink();
        let (n, row_bytes) = (4, H * 4);
        let mem: Arc<dyn ClientMemory> = Arc::new(Fake(
            Mutex::new(
                [
                    rows([0.0; 2]),
                    rows((1..=n).map(|t| t as f32)),
                    rows([-1.0; 2 * 4]),
                ]
                .concat(),
            ),
            true,
        ));
        let dev_in = ClientSpan {
            mem: mem.clone(),
            offset: (2 * row_bytes) as u64,
            len: n * row_bytes,
        };
        let dev_out = ClientSpan {
            mem: mem.clone(),
            offset: ((2 + n) * row_bytes) as u64,
            len: n * row_bytes,
        };
        let (host, mut host_rx) = job(3, Data::Host(rows([10.0, 11.0, 12.0]).into()), None);
        let (device, mut device_rx) = job(n, Data::Client(dev_in), Some(dev_out));
        let step = Step {
            segments: vec![
                Segment {
                    job: host.clone(),
                    rows: 0..3,
                },
                Segment {
                    job: device.clone(),
                    rows: 0..n,
                },
            ],
            ..Step::empty()
        };
        let own = leader_rows(&step, 2);
        assert_eq!(own, 0..4);
        pack(&ring, &step, 0, 0, 1, own.clone());
        let mut got = vec![0u8; 7 * row_bytes];
        ring.read_hidden(0, 0..7, Dtype::F32, &mut got);
        let rows_in = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(row_bytes)
                .map(|r| f32::from_le_bytes(r[..4].try_into().unwrap()))
                .collect()
        };
        // Row 3 (the device request's first, this rank's) is not in the ring.
        let seen = rows_in(&got);
        assert_eq!(&seen[..3], &[10.0, 11.0, 12.0]);
        assert_eq!(&seen[4..], &[2.0, 3.0, 4.0]);
        let runs = ring.direct.within(0, &(0..4));
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].rows, 3..4);
        let (i, o) = (
            runs[0].input.as_ref().unwrap(),
            runs[0].output.as_ref().unwrap(),
        );
        assert_eq!((i.offset, i.len), ((2 * row_bytes) as u64, row_bytes));
        assert_eq!((o.offset, o.len), (((2 + n) * row_bytes) as u64, row_bytes));
        // The ranks' outputs: 100 + row; this rank's device row it writes itself.
        let out = Output {
            cell: 0,
            rank: 0,
            rows: 0..7,
            dtype: Dtype::F32,
            seq: 1,
            to_leader: true,
        };
        ring.write_output(&out, &rows((0..7).map(|r| 100.0 + r as f32)))
            .unwrap();
        let bufs = Bufs::new(1 << 20, metric_names::OUTPUT_BUFFERS_REUSED_TOTAL);
        deliver(&ring, &step, 0, 0, 1, &bufs, own);
        assert!(ring.direct.within(0, &(0..8)).is_empty(), "cleared");
        let mut out = vec![0u8; n * row_bytes];
        mem.read(((2 + n) * row_bytes) as u64, &mut out).unwrap();
        assert_eq!(rows_in(&out), vec![-1.0, 104.0, 105.0, 106.0]);
        let answer = host_rx.try_recv().unwrap().unwrap();
        assert_eq!(rows_in(&answer), vec![100.0, 101.0, 102.0]);
        assert!(device_rx.try_recv().unwrap().unwrap().is_empty());
    }

    /// A POSIX object's rows are read straight into the ring, this rank's too, and checked
    /// there: a request with a non-finite value fails by row and column and its rows are
    /// zeroed; the others' answers are written straight from the ring into their objects.
    #[test]
    fn host_memory_rows_are_read_into_the_ring_and_checked_there() {
        let path = std::env::temp_dir().join(format!("epserve-rows-host-{}", std::process::id()));
        let ring = Ring::create(&path, RingShape::new(1, 1, 8, H, 1)).unwrap();
        ring.unlink();
        let row_bytes = H * 4;
        let mem =
            |data: Vec<u8>| -> Arc<dyn ClientMemory> { Arc::new(Fake(Mutex::new(data), false)) };
        let span = |mem: &Arc<dyn ClientMemory>, offset: usize, rows: usize| ClientSpan {
            mem: mem.clone(),
            offset: offset as u64,
            len: rows * row_bytes,
        };
        // Request 0: 3 good rows in, its output to the same object after them. Request 1: a NaN
        // in its second row's last column, its output to device memory.
        let good = mem([rows([1.0, 2.0, 3.0]), rows([0.0; 3])].concat());
        let mut bad_rows = rows([5.0, 6.0]);
        bad_rows[2 * row_bytes - 4..2 * row_bytes].copy_from_slice(&f32::NAN.to_le_bytes());
        let bad = mem(bad_rows);
        let out = Some(span(&good, 3 * row_bytes, 3));
        let (j0, mut rx0) = job(3, Data::Client(span(&good, 0, 3)), out);
        let sentinel = rows([-7.0; 2]);
        let device: Arc<dyn ClientMemory> = Arc::new(Fake(Mutex::new(sentinel.clone()), true));
        let (j1, mut rx1) = job(2, Data::Client(span(&bad, 0, 2)), Some(span(&device, 0, 2)));
        let step = Step {
            segments: vec![
                Segment {
                    job: j0,
                    rows: 0..3,
                },
                Segment {
                    job: j1,
                    rows: 0..2,
                },
            ],
            ..Step::empty()
        };
        pack(&ring, &step, 0, 0, 1, 0..5);
        // Request 1's output run is dropped with it: the GPU rank writes nothing there.
        assert!(ring.direct.within(0, &(0..8)).is_empty(), "no direct copy");
        let mut got = vec![0u8; 5 * row_bytes];
        ring.read_hidden(0, 0..5, Dtype::F32, &mut got);
        let firsts: Vec<f32> = got
            .chunks_exact(row_bytes)
            .map(|r| f32::from_le_bytes(r[..4].try_into().unwrap()))
            .collect();
        assert_eq!(
            firsts,
            vec![1.0, 2.0, 3.0, 0.0, 0.0],
            "the refused rows are zeroed"
        );
        let e = rx1.try_recv().unwrap().unwrap_err();
        assert!(
            e.to_string()
                .contains("non-finite value at row 1, column 2"),
            "{e}"
        );
        let outputs = rows((0..5).map(|r| 50.0 + r as f32));
        let out = Output {
            cell: 0,
            rank: 0,
            rows: 0..5,
            dtype: Dtype::F32,
            seq: 1,
            to_leader: true,
        };
        ring.write_output(&out, &outputs).unwrap();
        let bufs = Bufs::new(1 << 20, metric_names::OUTPUT_BUFFERS_REUSED_TOTAL);
        deliver(&ring, &step, 0, 0, 1, &bufs, 0..5);
        assert!(rx0.try_recv().unwrap().unwrap().is_empty());
        let mut out = vec![0u8; 3 * row_bytes];
        good.read(3 * row_bytes as u64, &mut out).unwrap();
        assert_eq!(out, rows([50.0, 51.0, 52.0]));
        let mut left = vec![0u8; 2 * row_bytes];
        device.read(0, &mut left).unwrap();
        assert_eq!(left, sentinel, "nothing written for the refused request");
    }

    #[test]
    fn split_gives_the_part_inside_and_the_parts_around() {
        assert_eq!(split(0..10, &(3..6)), (3..6, [0..3, 6..10]));
        assert_eq!(split(4..8, &(0..6)), (4..6, [4..4, 6..8]));
        assert_eq!(split(4..8, &(6..20)), (6..8, [4..6, 8..8]));
        let (inside, others) = split(0..4, &(6..9));
        assert!(inside.is_empty());
        assert_eq!(others, [0..4, 4..4]);
        let (inside, others) = split(7..9, &(0..3));
        assert!(inside.is_empty());
        assert_eq!(others, [7..7, 7..9]);
        assert_eq!(split(2..5, &(0..9)), (2..5, [2..2, 5..5]));
    }
}
