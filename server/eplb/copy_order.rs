//! Which of an applied placement's copies a rank enqueues beside its next step (`CopyOrder`),
//! for a backend that lands a placement while steps run (the GPU's `Mover`). A part's copies go
//! behind its layer's last step and that layer's next step waits for them, so they are put
//! beside another layer's step, the layer run last first (its next step is the furthest off).
//! `--eplb-step-copies SIZE` (default 32 MiB) lands a layer in parts of about SIZE a rank
//! (`parts::plan`), one part a step, each with the table's rows for what has landed; `layer`, a
//! whole layer beside one step. On 2x H200 under load (256 slots a rank, 1.2 GB a layer), 0 of
//! 389 steps beside 32 MiB parts were over 1.1x their median (max 1.09), against 2 of 27 beside
//! whole layers (max 1.24) in the same call. Parts of 300 MiB that kept a layer's old rows until
//! its last part (session 53) made a layer's step that came first wait for the rest (1.63x on
//! one H200); with rows a part, a step waits for one part at most (docs/benchmarks.md "Load
//! balance", session 54).

use std::collections::VecDeque;

/// Steps a layer runs on its old slots, when it is the only one left to land, before it lands
/// in front of its own step (which then waits for the copies).
const ALONE: usize = 8;

/// How much of a placement's copies may start beside one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCopies(pub Option<u64>);

impl StepCopies {
    /// A part's slots on one rank, at `slot` bytes a slot (at least one); None: a whole layer.
    pub fn slots(self, slot: u64) -> Option<usize> {
        self.0.map(|b| (b / slot.max(1)).max(1) as usize)
    }
}

/// `layer` (a whole layer a step) or a size (`256MiB`).
pub fn step_copies(s: &str) -> Result<StepCopies, String> {
    match s {
        "layer" => Ok(StepCopies(None)),
        s => crate::flags::size_in(s, 1, u64::MAX)
            .map(|b| StepCopies(Some(b)))
            .map_err(|e| format!("{e}; or write layer (a whole layer a step)")),
    }
}

/// Copies to enqueue: the writes of `layer`'s slots (`T`: the backend's, `sources::Op` as it
/// runs them), then its table rows as they stand once they land (`version`: the layer's parts
/// landed so, `parts::midway`); its next step waits for them. `last`: the layer's last part.
#[derive(Debug, PartialEq, Eq)]
pub struct Part<T> {
    pub layer: usize,
    pub slots: Vec<T>,
    pub version: usize,
    pub last: bool,
}

/// The copies of one applied placement still to enqueue on this rank. Every rank runs the same
/// steps and has the same parts (`parts::plan`), and so lands the same parts at the same steps.
pub struct CopyOrder<T> {
    /// Per layer: its parts not yet enqueued, in order; how many it has.
    todo: Vec<VecDeque<Vec<T>>>,
    count: Vec<usize>,
    parted: bool,
    /// The layer some of whose parts are enqueued and not all: its parts go on first.
    partial: Option<usize>,
    /// Steps run while only their own layer was left.
    alone: usize,
}

impl<T> CopyOrder<T> {
    /// Per layer, its parts' writes (at least one part, maybe empty: its rows still land);
    /// `parted`: a part a step (`--eplb-step-copies SIZE`), each after the step before.
    pub fn new(parts: Vec<Vec<Vec<T>>>, parted: bool) -> Self {
        let count = parts.iter().map(Vec::len).collect();
        Self {
            todo: parts.into_iter().map(VecDeque::from).collect(),
            count,
            parted,
            partial: None,
            alone: 0,
        }
    }

    /// Whether every layer's copies and rows are enqueued.
    pub fn done(&self) -> bool {
        self.todo.iter().all(VecDeque::is_empty)
    }

    /// Whether copies are split into parts (and each part should wait for the step before).
    pub fn parted(&self) -> bool {
        self.parted
    }

    /// What goes beside a step of `layer` about to be enqueued, after one of `last`: one part
    /// of another layer (the partly landed one, then `last`, then the lowest); of this layer
    /// itself only when no other is left and it has run `ALONE` steps since, then in front of
    /// its own step (which waits for it).
    pub fn beside(&mut self, layer: usize, last: Option<usize>) -> Option<Part<T>> {
        let other = |x: usize| x != layer && !self.todo[x].is_empty();
        let pick = (self.partial.filter(|&x| other(x)))
            .or(last.filter(|&x| other(x)))
            .or_else(|| (0..self.todo.len()).find(|&x| other(x)));
        match pick {
            Some(x) => self.take(x),
            None if self.todo.get(layer).is_some_and(|t| !t.is_empty()) => {
                self.alone += 1;
                (self.alone > ALONE).then(|| self.take(layer)).flatten()
            }
            None => None,
        }
    }

    /// The next part of the lowest layer left (a placement landing all at once).
    pub fn next_part(&mut self) -> Option<Part<T>> {
        let l = self.todo.iter().position(|t| !t.is_empty())?;
        self.take(l)
    }

    fn take(&mut self, layer: usize) -> Option<Part<T>> {
        let slots = self.todo[layer].pop_front()?;
        let left = self.todo[layer].len();
        self.partial = (left > 0).then_some(layer);
        Some(Part {
            layer,
            slots,
            version: self.count[layer] - left - 1,
            last: left == 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 layers of 4 slots, staged layer by layer: whole layers, or parts of two slots.
    fn order(parted: bool) -> CopyOrder<usize> {
        let parts = (0..3)
            .map(|l| match parted {
                false => vec![(4 * l..4 * l + 4).collect()],
                true => vec![vec![4 * l, 4 * l + 1], vec![4 * l + 2, 4 * l + 3]],
            })
            .collect();
        CopyOrder::new(parts, parted)
    }

    fn seen(p: Part<usize>) -> (usize, Vec<usize>, usize, bool) {
        (p.layer, p.slots, p.version, p.last)
    }

    #[test]
    fn a_whole_layer_goes_beside_another_layers_step_the_one_run_last_first() {
        let mut p = order(false);
        assert!(!p.parted());
        let a = p.beside(0, Some(2)).unwrap();
        assert_eq!(seen(a), (2, vec![8, 9, 10, 11], 0, true));
        // Layer 0's step is next: not beside it; the lowest other layer left instead.
        let b = p.beside(0, Some(0)).unwrap();
        assert_eq!((b.layer, b.last), (1, true));
        // Only layer 0 is left: its own steps run on its old slots ALONE times, then it lands.
        for _ in 0..ALONE {
            assert_eq!(p.beside(0, Some(0)), None);
        }
        let c = p.beside(0, Some(0)).unwrap();
        assert_eq!(seen(c), (0, vec![0, 1, 2, 3], 0, true));
        assert!(p.done());
        assert_eq!(p.beside(1, Some(0)), None);
    }

    #[test]
    fn parts_go_one_a_step_the_partly_landed_layer_first_never_in_front_of_its_own_step() {
        let mut p = order(true);
        assert!(p.parted());
        let a = p.beside(0, Some(1)).unwrap();
        assert_eq!(seen(a), (1, vec![4, 5], 0, false));
        // The partly landed layer goes on first, whatever ran last.
        let b = p.beside(2, Some(2)).unwrap();
        assert_eq!(seen(b), (1, vec![6, 7], 1, true));
        let c = p.beside(0, Some(2)).unwrap();
        assert_eq!(seen(c), (2, vec![8, 9], 0, false));
        // A step of the partly landed layer runs on what has landed; another layer's part
        // goes beside it.
        let d = p.beside(2, Some(0)).unwrap();
        assert_eq!(seen(d), (0, vec![0, 1], 0, false));
        assert!(!p.done());
        // Landing all at once: the lowest layer's parts, one at a time, each its version.
        let e = p.next_part().unwrap();
        assert_eq!(seen(e), (0, vec![2, 3], 1, true));
        let f = p.next_part().unwrap();
        assert_eq!(seen(f), (2, vec![10, 11], 1, true));
        assert!(p.done());
        assert_eq!(p.next_part(), None);
    }

    #[test]
    fn a_layer_without_slots_here_still_lands_its_rows() {
        let mut p = CopyOrder::new(vec![vec![vec![]], vec![vec![0], vec![1]]], true);
        let a = p.beside(0, Some(1)).unwrap();
        assert_eq!(seen(a), (1, vec![0], 0, false));
        let b = p.beside(0, None).unwrap();
        assert_eq!(seen(b), (1, vec![1], 1, true));
        // Layer 0 moved no slot here; its rows still land, beside a step of layer 1.
        let c = p.beside(1, Some(0)).unwrap();
        assert_eq!(seen(c), (0, vec![], 0, true));
        assert!(p.done());
    }

    #[test]
    fn the_flag_reads_layer_or_a_size_and_a_part_holds_a_slot_at_least() {
        assert_eq!(step_copies("layer"), Ok(StepCopies(None)));
        assert_eq!(step_copies("256MiB"), Ok(StepCopies(Some(256 << 20))));
        assert!(step_copies("0").is_err());
        assert!(step_copies("lots").unwrap_err().contains("layer"));
        assert_eq!(StepCopies(None).slots(10), None);
        assert_eq!(StepCopies(Some(25)).slots(10), Some(2));
        assert_eq!(StepCopies(Some(1)).slots(10), Some(1));
    }
}
