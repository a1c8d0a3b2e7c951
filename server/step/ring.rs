//! The step ring: host shared memory owned by the leader, mapped by every rank of the host. The
//! leader writes a step's input into a cell; each rank reads its home slice and writes its combined
//! slice back, then raises its output flag for the step. Hidden rows travel in the step's wire
//! dtypes (`StepDesc::input`, `StepDesc::output`); a cell has room for f32, the widest.
//!
//! A group that spans nodes has a ring per node: rank 0's, and one each other node's lowest
//! rank creates. The leader's `publish_input` sends another node's ranks their home rows (leader
//! ingress) and the cell's input flag over the data connection to that node's leader; a rank of
//! another node sends its output rows (leader ingress) and its output flag to rank 0's ring.
//! Under `--ingress all` rows never leave their node: only the flags cross.

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use std::sync::{Arc, OnceLock};

use super::desc::{StepDesc, StepError};
use super::direct::DirectRows;
use crate::dtype::Dtype;
use crate::lifecycle::Abort;
use crate::nodes::mirror::{DataLink, Target};
use crate::sys::shm::{raise, wait_seq, Shm, WaitError};

const LINE: usize = 64;

#[derive(Clone, Copy, Debug)]
pub struct RingShape {
    pub cells: usize,
    pub world: usize,
    /// Rows of a cell: `world` home slices of `home_stride()` rows.
    pub max_tokens: usize,
    pub hidden: usize,
    pub top_k: usize,
}

impl RingShape {
    /// The ring of `world` ranks with at most `max_home` home rows each.
    pub fn new(cells: usize, world: usize, max_home: usize, hidden: usize, top_k: usize) -> Self {
        Self {
            cells,
            world,
            max_tokens: world * max_home,
            hidden,
            top_k,
        }
    }
    /// Rank r's own rows start at `r * home_stride()` (`--ingress all`).
    pub fn home_stride(&self) -> usize {
        self.max_tokens / self.world.max(1)
    }
    fn flags_bytes(&self) -> usize {
        self.cells * (1 + self.world) * LINE
    }
    fn cell_bytes(&self) -> usize {
        let rows = self.max_tokens;
        (rows * self.hidden * 2 + rows * self.top_k * 2) * 4
    }
    pub fn bytes(&self) -> usize {
        self.flags_bytes() + self.cells * self.cell_bytes().next_multiple_of(LINE)
    }
    fn cell_base(&self, cell: usize) -> usize {
        self.flags_bytes() + cell * self.cell_bytes().next_multiple_of(LINE)
    }
    fn hidden_off(&self, cell: usize, row: usize, d: Dtype) -> usize {
        self.cell_base(cell) + row * self.hidden * d.bytes()
    }
    fn ids_off(&self, cell: usize, row: usize) -> usize {
        self.cell_base(cell) + (self.max_tokens * self.hidden + row * self.top_k) * 4
    }
    fn weights_off(&self, cell: usize, row: usize) -> usize {
        self.cell_base(cell) + (self.max_tokens * (self.hidden + self.top_k) + row * self.top_k) * 4
    }
    fn out_off(&self, cell: usize, row: usize, d: Dtype) -> usize {
        self.cell_base(cell)
            + self.max_tokens * (self.hidden + 2 * self.top_k) * 4
            + row * self.hidden * d.bytes()
    }
    fn in_flag(&self, cell: usize) -> usize {
        cell * (1 + self.world) * LINE
    }
    fn out_flag(&self, cell: usize, rank: usize) -> usize {
        self.in_flag(cell) + (1 + rank) * LINE
    }
}

pub struct Ring {
    pub shape: RingShape,
    shm: Shm,
    /// This process's rows that skip the ring (its own, never another rank's).
    pub direct: DirectRows,
    /// The rings of other nodes, once the data connections are made (none on one node).
    remote: OnceLock<Remote>,
}

/// Where this ring's steps cross nodes.
pub enum Remote {
    /// Rank 0: each other node's leader, and that node's ranks.
    Leader(Vec<(Arc<DataLink>, Vec<usize>)>),
    /// A rank of another node than rank 0's: its link to rank 0.
    Away(Arc<DataLink>),
}

/// A rank's output rows of one step, as `publish_output` announces them.
#[derive(Clone, Debug)]
pub struct Output {
    pub cell: usize,
    pub rank: usize,
    pub rows: Range<usize>,
    pub dtype: Dtype,
    pub seq: u64,
    /// Leader ingress: the leader answers from these rows, so a rank of another node sends
    /// them to rank 0's ring; under `--ingress all` the rank answers them itself.
    pub to_leader: bool,
}

impl Output {
    pub fn of(desc: &StepDesc, rank: usize, rows: Range<usize>) -> Self {
        Self {
            cell: desc.cell as usize,
            rank,
            rows,
            dtype: desc.output,
            seq: desc.step,
            to_leader: desc.leader_packed(),
        }
    }
}

impl Ring {
    pub fn create(path: &Path, shape: RingShape) -> std::io::Result<Self> {
        Ok(Self {
            shm: Shm::create(path, shape.bytes())?,
            direct: DirectRows::new(shape.cells),
            shape,
            remote: OnceLock::new(),
        })
    }
    pub fn open(path: &Path, shape: RingShape) -> std::io::Result<Self> {
        Ok(Self {
            shm: Shm::open(path, shape.bytes())?,
            direct: DirectRows::new(shape.cells),
            shape,
            remote: OnceLock::new(),
        })
    }
    pub fn unlink(&self) {
        self.shm.unlink()
    }
    /// Once, at startup: the links this ring's steps cross nodes by.
    pub fn connect(&self, remote: Remote) {
        if self.remote.set(remote).is_err() {
            tracing::warn!("the step ring was connected to other nodes twice; kept the first");
        }
    }
    pub fn buffer(&self) -> (&'static str, usize, usize) {
        ("step_ring", self.shm.addr(), self.shm.len())
    }

    /// Leader: input rows from `row` on, in `d`. Disjoint rows may be written from several
    /// threads at once.
    pub fn write_hidden(&self, cell: usize, row: usize, d: Dtype, data: &[u8]) {
        self.shm.write(self.shape.hidden_off(cell, row, d), data);
    }
    /// Leader: lends `f` the input rows `rows` in `d`, to fill in place.
    pub fn fill_hidden<R>(
        &self,
        cell: usize,
        rows: Range<usize>,
        d: Dtype,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        let (off, bytes) = self.place(cell, rows, d, RingShape::hidden_off);
        self.shm.fill(off, bytes, f)
    }
    /// Leader: lends `f` the output rows `rows` in `d`, to read in place.
    pub fn view_output<R>(
        &self,
        cell: usize,
        rows: Range<usize>,
        d: Dtype,
        f: impl FnOnce(&[u8]) -> R,
    ) -> R {
        let (off, bytes) = self.place(cell, rows, d, RingShape::out_off);
        self.shm.view(off, bytes, f)
    }
    pub fn write_routing(&self, cell: usize, row: usize, ids: &[i32], weights: &[f32]) {
        self.shm.write(self.shape.ids_off(cell, row), ids);
        self.shm.write(self.shape.weights_off(cell, row), weights);
    }
    /// Leader: publishes the cell as holding `desc`'s input, here and on every other node
    /// (leader ingress: with that node's ranks' home rows). Err: a data connection failed.
    pub fn publish_input(&self, desc: &StepDesc) -> Result<(), String> {
        let (cell, seq) = (desc.cell as usize, desc.step);
        raise(self.shm.flag(self.shape.in_flag(cell)), seq);
        let Some(Remote::Leader(nodes)) = self.remote.get() else {
            return Ok(());
        };
        let (world, stride) = (self.shape.world, self.shape.home_stride());
        for (link, ranks) in nodes {
            // A node the group went on without hears nothing more.
            if ranks.iter().all(|&r| desc.is_lost(r)) {
                continue;
            }
            // Under --ingress all a rank's rows never leave its node: only the flag goes.
            let shipped: &[usize] = if desc.leader_packed() { ranks } else { &[] };
            for &r in shipped {
                let rows = desc.home(world, r, stride);
                if rows.is_empty() {
                    continue;
                }
                let (off, bytes) =
                    self.place(cell, rows.clone(), desc.input, RingShape::hidden_off);
                self.shm
                    .view(off, bytes, |b| link.write(Target::Ring, off, b));
                if desc.client_routing {
                    let n = rows.len() * self.shape.top_k * 4;
                    for off in [
                        self.shape.ids_off(cell, rows.start),
                        self.shape.weights_off(cell, rows.start),
                    ] {
                        self.shm.view(off, n, |b| link.write(Target::Ring, off, b));
                    }
                }
            }
            link.raise(Target::Ring, self.shape.in_flag(cell), seq)?;
        }
        Ok(())
    }

    /// Rank: waits for the cell to hold step `seq`'s input. On rank 0's node it does before
    /// the step's descriptor is sent; on another node it arrives on its own connection.
    pub fn wait_input(
        &self,
        cell: usize,
        seq: u64,
        deadline: Instant,
        abort: &Abort,
    ) -> Result<(), StepError> {
        assert!(cell < self.shape.cells, "ring cell {cell}");
        let flag = self.shm.flag(self.shape.in_flag(cell));
        let waited = wait_seq(flag, seq, deadline, abort).and_then(|()| {
            match flag.load(std::sync::atomic::Ordering::Acquire) {
                s if s == seq => Ok(()),
                s => Err(WaitError::Aborted(format!(
                    "ring cell {cell} holds step {s}, not step {seq}"
                ))),
            }
        });
        waited.map_err(|source| StepError::Wait {
            step: seq,
            what: "the step's input",
            rank: 0,
            source,
        })
    }
    pub fn read_hidden(&self, cell: usize, rows: Range<usize>, d: Dtype, dst: &mut [u8]) {
        self.check_rows(&rows, d, dst.len());
        self.shm
            .read(self.shape.hidden_off(cell, rows.start, d), dst);
    }
    /// Rank: (address in this process, bytes) of input rows `rows` in `d`, for a device copy
    /// straight from the ring.
    pub fn hidden_span(&self, cell: usize, rows: Range<usize>, d: Dtype) -> (usize, usize) {
        self.span(cell, rows, d, RingShape::hidden_off)
    }
    /// Rank: (address, bytes) of output rows `rows` in `d`, for a device copy into the ring.
    pub fn output_span(&self, cell: usize, rows: Range<usize>, d: Dtype) -> (usize, usize) {
        self.span(cell, rows, d, RingShape::out_off)
    }
    fn span(
        &self,
        cell: usize,
        rows: Range<usize>,
        d: Dtype,
        off: fn(&RingShape, usize, usize, Dtype) -> usize,
    ) -> (usize, usize) {
        let (at, bytes) = self.place(cell, rows, d, off);
        (self.shm.addr() + at, bytes)
    }
    /// The offset in the segment and the byte count of rows `rows` in `d` of cell `cell`, at
    /// `off`'s part of the cell, checked.
    fn place(
        &self,
        cell: usize,
        rows: Range<usize>,
        d: Dtype,
        off: fn(&RingShape, usize, usize, Dtype) -> usize,
    ) -> (usize, usize) {
        let bytes = rows.len() * self.shape.hidden * d.bytes();
        self.check_rows(&rows, d, bytes);
        assert!(cell < self.shape.cells, "ring cell {cell}");
        (off(&self.shape, cell, rows.start, d), bytes)
    }
    fn check_rows(&self, rows: &Range<usize>, d: Dtype, bytes: usize) {
        assert!(
            rows.start <= rows.end
                && rows.end <= self.shape.max_tokens
                && bytes == rows.len() * self.shape.hidden * d.bytes(),
            "ring rows {rows:?} of {d:?}: {bytes} bytes"
        );
    }
    pub fn read_routing(&self, cell: usize, rows: Range<usize>, ids: &mut [i32], w: &mut [f32]) {
        self.shm.read(self.shape.ids_off(cell, rows.start), ids);
        self.shm.read(self.shape.weights_off(cell, rows.start), w);
    }
    /// Rank: its output rows, then its flag.
    pub fn write_output(&self, out: &Output, data: &[u8]) -> Result<(), String> {
        self.check_rows(&out.rows, out.dtype, data.len());
        self.shm.write(
            self.shape.out_off(out.cell, out.rows.start, out.dtype),
            data,
        );
        self.publish_output(out)
    }
    /// Rank: its output rows are in place (written by `write_output` or a device copy). From
    /// another node than rank 0's they go to rank 0's ring too (leader ingress), then the flag.
    /// Err: the data connection failed.
    pub fn publish_output(&self, out: &Output) -> Result<(), String> {
        let flag = self.shape.out_flag(out.cell, out.rank);
        raise(self.shm.flag(flag), out.seq);
        let Some(Remote::Away(link)) = self.remote.get() else {
            return Ok(());
        };
        if out.to_leader && !out.rows.is_empty() {
            let (off, bytes) =
                self.place(out.cell, out.rows.clone(), out.dtype, RingShape::out_off);
            self.shm
                .view(off, bytes, |b| link.write(Target::Ring, off, b));
        }
        link.raise(Target::Ring, flag, out.seq)
    }

    /// Leader: waits for the output of step `seq` of every rank but `lost`; the error names the
    /// first missing rank.
    pub fn wait_outputs(
        &self,
        cell: usize,
        (seq, lost): (u64, &[u32]),
        deadline: Instant,
        abort: &Abort,
    ) -> Result<(), (usize, WaitError)> {
        for rank in (0..self.shape.world).filter(|&r| !lost.contains(&(r as u32))) {
            wait_seq(
                self.shm.flag(self.shape.out_flag(cell, rank)),
                seq,
                deadline,
                abort,
            )
            .map_err(|e| (rank, e))?;
        }
        Ok(())
    }
    /// Leader, without waiting: the ranks whose output of step `seq` is not yet in place.
    pub fn missing_outputs<'a>(
        &'a self,
        cell: usize,
        (seq, lost): (u64, &'a [u32]),
    ) -> impl Iterator<Item = usize> + 'a {
        (0..self.shape.world).filter(move |&rank| {
            !lost.contains(&(rank as u32))
                && self
                    .shm
                    .flag(self.shape.out_flag(cell, rank))
                    .load(std::sync::atomic::Ordering::Acquire)
                    < seq
        })
    }
    /// Leader: output rows from `row` on, in `d`. Disjoint rows may be read from several threads.
    pub fn read_output(&self, cell: usize, row: usize, d: Dtype, dst: &mut [u8]) {
        self.shm.read(self.shape.out_off(cell, row, d), dst);
    }
}
