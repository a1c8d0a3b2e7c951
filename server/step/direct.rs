//! Rows in a client's own memory (Triton's shared-memory extensions): a region of a POSIX
//! object, or a client's CUDA memory that this process's own GPU rank reads and writes device
//! to device.
//!
//! The ring is the way between processes; direct runs are not: a packer records, per cell, which
//! of the rows it would have written are in a client's device memory instead, and the GPU rank
//! of the same process copies them from there into its step buffers (and its output rows back)
//! on its copy streams. Rows in a POSIX object, and device rows that another process's rank
//! loads, are read straight into the ring and written straight from it by the packer and the
//! delivery (`sched::rows`). The table is process-local and never crosses to another rank.

use std::ops::Range;
use std::sync::Mutex;

use crate::request::ClientSpan;

/// Rows `rows` of a cell whose input comes from, or whose output goes to, a client's device
/// memory (the span holds exactly those rows, in the step's input or output dtype).
#[derive(Clone)]
pub struct DirectRun {
    pub rows: Range<usize>,
    pub input: Option<ClientSpan>,
    pub output: Option<ClientSpan>,
}

/// Each cell's direct runs, in row order, set by the packer before the step is submitted and
/// read by the GPU rank when it loads the cell.
pub struct DirectRows(Mutex<Vec<Vec<DirectRun>>>);

impl DirectRows {
    pub fn new(cells: usize) -> Self {
        Self(Mutex::new(vec![Vec::new(); cells]))
    }

    fn cells(&self) -> std::sync::MutexGuard<'_, Vec<Vec<DirectRun>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces `cell`'s runs (empty: every row goes through the ring).
    pub fn set(&self, cell: usize, runs: Vec<DirectRun>) {
        self.cells()[cell] = runs;
    }

    /// `cell`'s runs that lie within `rows`.
    pub fn within(&self, cell: usize, rows: &Range<usize>) -> Vec<DirectRun> {
        self.cells()[cell]
            .iter()
            .filter(|r| r.rows.start >= rows.start && r.rows.end <= rows.end)
            .cloned()
            .collect()
    }
}

/// How `rows` split into the pieces that come from (or go to) the ring and the ones in device
/// memory: `(rows, Some(span))` for a device run, `(rows, None)` for a ring run, in order and
/// covering `rows`. `pick` chooses the run's side (input or output).
pub fn pieces(
    rows: Range<usize>,
    runs: &[DirectRun],
    pick: fn(&DirectRun) -> Option<&ClientSpan>,
) -> Vec<(Range<usize>, Option<&ClientSpan>)> {
    let mut out = Vec::new();
    let mut at = rows.start;
    for r in runs {
        let Some(span) = pick(r) else { continue };
        if r.rows.start > at {
            out.push((at..r.rows.start, None));
        }
        out.push((r.rows.clone(), Some(span)));
        at = r.rows.end;
    }
    if at < rows.end {
        out.push((at..rows.end, None));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ClientMemory;
    use std::sync::Arc;

    struct Fake;
    impl ClientMemory for Fake {
        fn device_address(&self) -> Option<u64> {
            Some(0x1000)
        }
        fn read(&self, _: u64, _: &mut [u8]) -> Result<(), String> {
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8]) -> Result<(), String> {
            Ok(())
        }
    }

    fn span(offset: u64, len: usize) -> ClientSpan {
        ClientSpan {
            mem: Arc::new(Fake),
            offset,
            len,
        }
    }

    #[test]
    fn pieces_cover_the_rows_in_order() {
        let runs = vec![
            DirectRun {
                rows: 2..4,
                input: Some(span(0, 8)),
                output: None,
            },
            DirectRun {
                rows: 6..7,
                input: None,
                output: Some(span(8, 4)),
            },
            DirectRun {
                rows: 7..9,
                input: Some(span(16, 8)),
                output: Some(span(32, 8)),
            },
        ];
        let shape = |p: Vec<(Range<usize>, Option<&ClientSpan>)>| {
            p.into_iter()
                .map(|(r, s)| (r, s.and_then(|s| s.device_address())))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            shape(pieces(0..10, &runs, |r| r.input.as_ref())),
            vec![
                (0..2, None),
                (2..4, Some(0x1000)),
                (4..7, None),
                (7..9, Some(0x1010)),
                (9..10, None)
            ]
        );
        assert_eq!(
            shape(pieces(6..9, &runs[1..], |r| r.output.as_ref())),
            vec![(6..7, Some(0x1008)), (7..9, Some(0x1020))]
        );
        assert_eq!(
            shape(pieces(0..3, &[], |r| r.input.as_ref())),
            vec![(0..3, None)]
        );
    }

    #[test]
    fn a_slot_gives_only_the_runs_inside_the_rows_asked() {
        let d = DirectRows::new(2);
        let run = |rows: Range<usize>| DirectRun {
            rows,
            input: Some(span(0, 1)),
            output: None,
        };
        d.set(1, vec![run(0..2), run(4..6)]);
        let rows = |v: Vec<DirectRun>| v.into_iter().map(|r| r.rows).collect::<Vec<_>>();
        assert_eq!(rows(d.within(1, &(0..4))), vec![0..2]);
        assert_eq!(rows(d.within(1, &(0..8))), vec![0..2, 4..6]);
        assert!(d.within(0, &(0..8)).is_empty());
        d.set(1, Vec::new());
        assert!(d.within(1, &(0..8)).is_empty());
    }
}
