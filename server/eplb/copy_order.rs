//! Which of an applied placement's copies a rank enqueues beside its next step (`CopyOrder`),
//! for a backend that lands a placement layer by layer while steps run (the GPU's `Mover`). A
//! layer's copies go behind its last step and its next step waits for them, so they are put
//! beside another layer's step, the layer run last first (its next step is the furthest off).
//! By default a whole layer goes beside one step; `--eplb-step-copies SIZE` splits a layer into
//! parts of at most SIZE bytes, one part a step. On 2x H200 under load (256 slots a rank, 1.2
//! GB a layer), 5 of 54 steps beside whole layers' copies were over 1.1x (max 1.24), and 5 of
//! 69 beside 300 MiB parts (max 1.13); on one H200 a layer's step that came before its last
//! part waited 1 ms for the rest (1.63x). Parts gained nothing over 1.1x and can make a step
//! wait, so a whole layer stays the default (docs/benchmarks.md "Load balance", session 53).

use std::collections::VecDeque;

/// Steps a layer runs on its old slots, when it is the only one left to land, before it lands
/// in front of its own step (which then waits for the copies).
const ALONE: usize = 8;

/// How much of a placement's copies may start beside one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCopies(pub Option<u64>);

/// `layer` (a whole layer a step) or a size (`256MiB`).
pub fn step_copies(s: &str) -> Result<StepCopies, String> {
    match s {
        "layer" => Ok(StepCopies(None)),
        s => crate::flags::size_in(s, 1, u64::MAX)
            .map(|b| StepCopies(Some(b)))
            .map_err(|e| format!("{e}; or write layer (a whole layer a step)")),
    }
}

/// Copies to enqueue: slots of `layer` (indices in the staged list), then, where `last`, its
/// table rows (its next step waits for them).
#[derive(Debug, PartialEq, Eq)]
pub struct Part {
    pub layer: usize,
    pub slots: Vec<usize>,
    pub last: bool,
}

/// The copies of one applied placement still to enqueue on this rank. Every rank runs the same
/// steps and so lands the same parts at the same steps.
pub struct CopyOrder {
    /// Per layer: its staged slots not yet enqueued (index, bytes), in order; whether its table
    /// rows are (a layer may have no slot to copy and still new rows).
    todo: Vec<VecDeque<(usize, u64)>>,
    left: Vec<bool>,
    part: Option<u64>,
    /// The layer some of whose slots are enqueued and not all: its next step waits for all.
    partial: Option<usize>,
    /// Steps run while only their own layer was left.
    alone: usize,
}

impl CopyOrder {
    /// `layers` layers to land; `slots` the staged slots' (layer, bytes) in staged order.
    pub fn new(
        layers: usize,
        slots: impl IntoIterator<Item = (usize, u64)>,
        StepCopies(part): StepCopies,
    ) -> Self {
        let mut todo = vec![VecDeque::new(); layers];
        for (i, (l, bytes)) in slots.into_iter().enumerate() {
            todo[l].push_back((i, bytes));
        }
        Self {
            todo,
            left: vec![true; layers],
            part,
            partial: None,
            alone: 0,
        }
    }

    /// Whether every layer's copies and rows are enqueued.
    pub fn done(&self) -> bool {
        !self.left.iter().any(|&x| x)
    }

    /// Whether copies are split into parts (and each part should wait for the step before).
    pub fn parted(&self) -> bool {
        self.part.is_some()
    }

    /// What goes beside a step of `layer` about to be enqueued, after one of `last`. A layer
    /// partly enqueued has its rest enqueued in front of its own step; else one part of another
    /// layer (the partly enqueued one, then `last`, then the lowest); this layer itself only
    /// when no other is left and it has run `ALONE` steps since.
    pub fn beside(&mut self, layer: usize, last: Option<usize>) -> Option<Part> {
        if self.partial == Some(layer) {
            return Some(self.take(layer, true));
        }
        let other = |x: usize| x != layer && self.left[x];
        let pick = (self.partial.filter(|&x| other(x)))
            .or(last.filter(|&x| other(x)))
            .or_else(|| (0..self.left.len()).find(|&x| other(x)));
        match pick {
            Some(x) => Some(self.take(x, false)),
            None if self.left.get(layer) == Some(&true) => {
                self.alone += 1;
                (self.alone > ALONE).then(|| self.take(layer, true))
            }
            None => None,
        }
    }

    /// The rest of the lowest layer left, whole (a placement landing all at once).
    pub fn next_whole(&mut self) -> Option<Part> {
        let l = self.left.iter().position(|&x| x)?;
        Some(self.take(l, true))
    }

    /// `layer`'s next part (all of it where `whole` or no part size is set): at most `part`
    /// bytes, at least one slot.
    fn take(&mut self, layer: usize, whole: bool) -> Part {
        let cap = self.part.filter(|_| !whole).unwrap_or(u64::MAX);
        let q = &mut self.todo[layer];
        let (mut slots, mut bytes) = (Vec::new(), 0u64);
        while let Some(&(i, b)) = q.front() {
            if !slots.is_empty() && bytes.saturating_add(b) > cap {
                break;
            }
            bytes = bytes.saturating_add(b);
            slots.push(i);
            q.pop_front();
        }
        let last = q.is_empty();
        self.left[layer] = !last;
        self.partial = (!last).then_some(layer);
        Part { layer, slots, last }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 layers of 4 slots of 10 bytes each, staged layer by layer.
    fn order(part: Option<u64>) -> CopyOrder {
        let slots = (0..3).flat_map(|l| (0..4).map(move |_| (l, 10)));
        CopyOrder::new(3, slots, StepCopies(part))
    }

    #[test]
    fn a_whole_layer_goes_beside_another_layers_step_the_one_run_last_first() {
        let mut p = order(None);
        let a = p.beside(0, Some(2)).unwrap();
        assert_eq!((a.layer, a.slots, a.last), (2, vec![8, 9, 10, 11], true));
        // Layer 0's step is next: not beside it; the lowest other layer left instead.
        let b = p.beside(0, Some(0)).unwrap();
        assert_eq!((b.layer, b.last), (1, true));
        // Only layer 0 is left: its own steps run on its old slots ALONE times, then it lands.
        for _ in 0..ALONE {
            assert_eq!(p.beside(0, Some(0)), None);
        }
        let c = p.beside(0, Some(0)).unwrap();
        assert_eq!((c.layer, c.slots, c.last), (0, vec![0, 1, 2, 3], true));
        assert!(p.done());
        assert_eq!(p.beside(1, Some(0)), None);
    }

    #[test]
    fn parts_hold_at_most_the_size_and_a_layer_goes_on_until_it_has_landed() {
        let mut p = order(Some(25));
        assert!(p.parted());
        let a = p.beside(0, Some(1)).unwrap();
        assert_eq!((a.layer, a.slots, a.last), (1, vec![4, 5], false));
        // The partly landed layer goes on first, whatever ran last.
        let b = p.beside(2, Some(2)).unwrap();
        assert_eq!((b.layer, b.slots, b.last), (1, vec![6, 7], true));
        let c = p.beside(0, Some(2)).unwrap();
        assert_eq!((c.layer, c.slots, c.last), (2, vec![8, 9], false));
        // A step of the partly landed layer: its rest in front of it, whole.
        let d = p.beside(2, Some(0)).unwrap();
        assert_eq!((d.layer, d.slots, d.last), (2, vec![10, 11], true));
        assert!(!p.done());
        let e = p.next_whole().unwrap();
        assert_eq!((e.layer, e.slots, e.last), (0, vec![0, 1, 2, 3], true));
        assert!(p.done());
        assert_eq!(p.next_whole(), None);
    }

    #[test]
    fn a_part_smaller_than_a_slot_still_takes_one_and_a_layer_without_slots_still_lands_its_rows() {
        let slots = [(1, 10), (1, 10)];
        let mut p = CopyOrder::new(2, slots, StepCopies(Some(1)));
        let a = p.beside(0, Some(1)).unwrap();
        assert_eq!((a.layer, a.slots, a.last), (1, vec![0], false));
        let b = p.beside(0, None).unwrap();
        assert_eq!((b.layer, b.slots, b.last), (1, vec![1], true));
        // Layer 0 moved no slot here; its rows still land, beside a step of layer 1.
        let c = p.beside(1, Some(0)).unwrap();
        assert_eq!((c.layer, c.slots, c.last), (0, vec![], true));
        assert!(p.done());
    }

    #[test]
    fn the_flag_reads_layer_or_a_size() {
        assert_eq!(step_copies("layer"), Ok(StepCopies(None)));
        assert_eq!(step_copies("256MiB"), Ok(StepCopies(Some(256 << 20))));
        assert!(step_copies("0").is_err());
        assert!(step_copies("lots").unwrap_err().contains("layer"));
    }
}
