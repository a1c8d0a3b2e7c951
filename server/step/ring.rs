//! The step ring: host shared memory owned by the router, mapped by every rank of the host. The
//! router writes a step's input into a slot; each rank reads its home slice and writes its combined
//! slice back, then raises its output flag for the step.

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use crate::shm::{wait_seq, Abort, Shm, WaitError};

const LINE: usize = 64;

#[derive(Clone, Copy, Debug)]
pub struct RingShape {
    pub slots: usize,
    pub world: usize,
    pub max_tokens: usize,
    pub hidden: usize,
    pub top_k: usize,
}

impl RingShape {
    fn flags_bytes(&self) -> usize {
        self.slots * (1 + self.world) * LINE
    }
    fn slot_bytes(&self) -> usize {
        let rows = self.max_tokens;
        (rows * self.hidden * 2 + rows * self.top_k * 2) * 4
    }
    pub fn bytes(&self) -> usize {
        self.flags_bytes() + self.slots * self.slot_bytes().next_multiple_of(LINE)
    }
    fn slot_base(&self, slot: usize) -> usize {
        self.flags_bytes() + slot * self.slot_bytes().next_multiple_of(LINE)
    }
    fn hidden_off(&self, slot: usize, row: usize) -> usize {
        self.slot_base(slot) + row * self.hidden * 4
    }
    fn ids_off(&self, slot: usize, row: usize) -> usize {
        self.slot_base(slot) + (self.max_tokens * self.hidden + row * self.top_k) * 4
    }
    fn weights_off(&self, slot: usize, row: usize) -> usize {
        self.slot_base(slot) + (self.max_tokens * (self.hidden + self.top_k) + row * self.top_k) * 4
    }
    fn out_off(&self, slot: usize, row: usize) -> usize {
        self.slot_base(slot)
            + (self.max_tokens * (self.hidden + 2 * self.top_k) + row * self.hidden) * 4
    }
    fn in_flag(&self, slot: usize) -> usize {
        slot * (1 + self.world) * LINE
    }
    fn out_flag(&self, slot: usize, rank: usize) -> usize {
        self.in_flag(slot) + (1 + rank) * LINE
    }
}

pub struct Ring {
    pub shape: RingShape,
    shm: Shm,
}

impl Ring {
    pub fn create(path: &Path, shape: RingShape) -> std::io::Result<Self> {
        Ok(Self {
            shm: Shm::create(path, shape.bytes())?,
            shape,
        })
    }
    pub fn open(path: &Path, shape: RingShape) -> std::io::Result<Self> {
        Ok(Self {
            shm: Shm::open(path, shape.bytes())?,
            shape,
        })
    }
    pub fn unlink(&self) {
        self.shm.unlink()
    }
    pub fn buffer(&self) -> (&'static str, usize, usize) {
        ("step_ring", self.shm.addr(), self.shm.len())
    }

    /// Router: rows `[row, row + n)` of a step's input.
    pub fn write_hidden(&self, slot: usize, row: usize, data: &[f32]) {
        self.shm.write(self.shape.hidden_off(slot, row), data);
    }
    pub fn write_routing(&self, slot: usize, row: usize, ids: &[i32], weights: &[f32]) {
        self.shm.write(self.shape.ids_off(slot, row), ids);
        self.shm.write(self.shape.weights_off(slot, row), weights);
    }
    /// Router: publishes slot `slot` as holding step `seq`.
    pub fn publish_input(&self, slot: usize, seq: u64) {
        self.shm
            .flag(self.shape.in_flag(slot))
            .store(seq, std::sync::atomic::Ordering::Release);
    }

    /// Rank: checks that the slot holds this step's input (it was published before the descriptor
    /// was sent, so anything else is a protocol bug, not a wait).
    pub fn input_ready(&self, slot: usize, seq: u64) -> bool {
        self.shm
            .flag(self.shape.in_flag(slot))
            .load(std::sync::atomic::Ordering::Acquire)
            == seq
    }
    pub fn read_hidden(&self, slot: usize, rows: Range<usize>, dst: &mut [f32]) {
        self.shm.read(self.shape.hidden_off(slot, rows.start), dst);
    }
    pub fn read_routing(&self, slot: usize, rows: Range<usize>, ids: &mut [i32], w: &mut [f32]) {
        self.shm.read(self.shape.ids_off(slot, rows.start), ids);
        self.shm.read(self.shape.weights_off(slot, rows.start), w);
    }
    pub fn write_output(
        &self,
        slot: usize,
        rank: usize,
        rows: Range<usize>,
        data: &[f32],
        seq: u64,
    ) {
        self.shm.write(self.shape.out_off(slot, rows.start), data);
        self.shm
            .flag(self.shape.out_flag(slot, rank))
            .store(seq, std::sync::atomic::Ordering::Release);
    }

    /// Router: waits for every rank's output of step `seq`; the error names the first missing rank.
    pub fn wait_outputs(
        &self,
        slot: usize,
        seq: u64,
        deadline: Instant,
        abort: &Abort,
    ) -> Result<(), (usize, WaitError)> {
        for rank in 0..self.shape.world {
            wait_seq(
                self.shm.flag(self.shape.out_flag(slot, rank)),
                seq,
                deadline,
                abort,
            )
            .map_err(|e| (rank, e))?;
        }
        Ok(())
    }
    pub fn read_output(&self, slot: usize, row: usize, dst: &mut [f32]) {
        self.shm.read(self.shape.out_off(slot, row), dst);
    }
}
