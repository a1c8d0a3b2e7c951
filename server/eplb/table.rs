//! Physical expert slots: per MoE layer, the logical expert each slot holds (`phy2log`, as
//! DeepSeek's EPLB writes it). Slots are in rank order, the same count on every rank: slot `s`
//! lives on rank `s / per_rank`. With no redundant slots and no placement file, slot `s` holds
//! expert `s`: the contiguous blocks of before.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// One layer's slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSlots {
    phy2log: Vec<u32>,
    /// Every logical expert's slots, ascending.
    log2phy: Vec<Vec<u32>>,
}

impl LayerSlots {
    /// `out(slot)`: the slot is on a rank out of the group, and takes no rows.
    pub(super) fn new(phy2log: Vec<u32>, experts: usize, out: impl Fn(usize) -> bool) -> Self {
        let mut log2phy = vec![Vec::new(); experts];
        for (s, &g) in phy2log.iter().enumerate().filter(|&(s, _)| !out(s)) {
            log2phy[g as usize].push(s as u32);
        }
        Self { phy2log, log2phy }
    }
    pub fn phy2log(&self) -> &[u32] {
        &self.phy2log
    }
    /// The slots holding logical expert `g` on ranks in the group (at least one).
    pub fn replicas(&self, g: usize) -> &[u32] {
        &self.log2phy[g]
    }
}

/// Every layer's slots over `world` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMap {
    pub world: usize,
    pub experts: usize,
    layers: Vec<LayerSlots>,
    /// Ranks out of the group, ascending: their slots keep their experts in `phy2log` but
    /// take no rows (`--on-rank-loss continue`).
    lost: Vec<u32>,
}

/// A placement file: per MoE layer (in `moe_layers` order), the logical expert of every slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementFile {
    pub phy2log: Vec<Vec<u32>>,
}

impl SlotMap {
    /// `experts + redundant` slots per layer, before any load is seen. Where both divide by the
    /// ranks, rank `r` holds its contiguous block of `experts / world` (so 0 redundant is the
    /// placement of before) and then the first `redundant / world` experts of the next rank's
    /// block; else expert `s mod experts` is in slot `s`.
    pub fn contiguous(
        experts: usize,
        world: usize,
        redundant: usize,
        layers: usize,
    ) -> Result<Self, String> {
        let slots = experts + redundant;
        let phy2log: Vec<u32> = match world > 0 && experts % world == 0 && redundant % world == 0 {
            true => {
                let (block, extra) = (experts / world, redundant / world);
                (0..world)
                    .flat_map(|r| {
                        let own = r * block..(r + 1) * block;
                        let next = (0..extra).map(move |j| ((r + 1) * block + j) % experts);
                        own.chain(next)
                    })
                    .map(|g| g as u32)
                    .collect()
            }
            false => (0..slots).map(|s| (s % experts) as u32).collect(),
        };
        Self::from_tables(experts, world, vec![phy2log; layers])
    }

    /// From per-layer `phy2log` tables, checked: every table the same length, a multiple of
    /// `world`; every id an expert; every expert in at least one slot. The error names the layer
    /// (its position in `moe_layers`) and the expert.
    pub fn from_tables(
        experts: usize,
        world: usize,
        tables: Vec<Vec<u32>>,
    ) -> Result<Self, String> {
        Self::without(experts, world, tables, Vec::new())
    }

    /// As `from_tables`, with the ranks `lost` out of the group: every expert needs a slot on
    /// a rank in it.
    pub fn without(
        experts: usize,
        world: usize,
        tables: Vec<Vec<u32>>,
        mut lost: Vec<u32>,
    ) -> Result<Self, String> {
        lost.sort_unstable();
        lost.dedup();
        if let Some(r) = lost.iter().find(|&&r| r as usize >= world || r == 0) {
            return Err(format!("rank {r} cannot be out of a group of {world}"));
        }
        if world == 0 || experts == 0 {
            return Err(format!("{experts} experts over {world} ranks"));
        }
        let slots = tables.first().map_or(0, Vec::len);
        if slots < experts {
            return Err(format!(
                "{slots} slots per layer for {experts} experts: every expert needs a slot"
            ));
        }
        if slots % world != 0 {
            return Err(format!(
                "{slots} slots per layer do not split evenly over {world} ranks (slots per rank must be equal: experts + redundant experts must be divisible by the world size)"
            ));
        }
        let mut layers = Vec::with_capacity(tables.len());
        for (l, t) in tables.into_iter().enumerate() {
            if t.len() != slots {
                return Err(format!("layer {l}: {} slots, layer 0 has {slots}", t.len()));
            }
            if let Some((s, g)) = t.iter().enumerate().find(|(_, &g)| g as usize >= experts) {
                return Err(format!(
                    "layer {l}: slot {s} holds expert {g}, the model has {experts}"
                ));
            }
            let per = slots / world;
            let layer = LayerSlots::new(t, experts, |s| lost.contains(&((s / per) as u32)));
            if let Some(g) = layer.log2phy.iter().position(Vec::is_empty) {
                return Err(match lost.is_empty() {
                    true => format!("layer {l}: expert {g} has no slot"),
                    false => format!("layer {l}: expert {g} has no slot on a rank in the group"),
                });
            }
            layers.push(layer);
        }
        Ok(Self {
            world,
            experts,
            layers,
            lost,
        })
    }

    /// The same tables with `lost` out of the group.
    pub fn with_lost(self, lost: Vec<u32>) -> Result<Self, String> {
        let tables = self.layers.into_iter().map(|l| l.phy2log).collect();
        Self::without(self.experts, self.world, tables, lost)
    }

    /// Ranks out of the group, ascending.
    pub fn lost(&self) -> &[u32] {
        &self.lost
    }

    /// Whether `rank` is in the group.
    pub fn live(&self, rank: usize) -> bool {
        !self.lost.contains(&(rank as u32))
    }

    /// The placement without `more` ranks: every expert that had replicas only on ranks now
    /// out moves into a slot of a rank in the group whose expert has another replica there
    /// (a redundant one), taken from the most replicated experts first and spread over the
    /// ranks. Err: no such slot is left for some expert (the group cannot carry on).
    pub fn survive(&self, more: &[u32]) -> Result<SlotMap, String> {
        let mut lost = self.lost.clone();
        lost.extend_from_slice(more);
        lost.sort_unstable();
        lost.dedup();
        let (per, world) = (self.per_rank(), self.world);
        let live = |s: usize| !lost.contains(&((s / per) as u32));
        let mut tables = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let mut t = layer.phy2log.clone();
            let mut count = vec![0usize; self.experts];
            (0..t.len())
                .filter(|&s| live(s))
                .for_each(|s| count[t[s] as usize] += 1);
            let orphans: Vec<usize> = (0..self.experts).filter(|&g| count[g] == 0).collect();
            let mut taken = vec![0usize; world];
            for &g in &orphans {
                let slot = (0..t.len())
                    .filter(|&s| live(s) && count[t[s] as usize] > 1)
                    .max_by_key(|&s| (count[t[s] as usize], std::cmp::Reverse(taken[s / per])));
                let Some(s) = slot else {
                    return Err(format!(
                        "layer {l}: {} experts of the lost ranks have no other replica and \
                         the ranks left have no redundant slot for expert {g} \
                         (--redundant-experts gives them room)",
                        orphans.len()
                    ));
                };
                count[t[s] as usize] -= 1;
                t[s] = g as u32;
                count[g] += 1;
                taken[s / per] += 1;
            }
            tables.push(t);
        }
        Self::without(self.experts, world, tables, lost)
    }

    /// `--placement FILE` for a model of `layers` MoE layers.
    pub fn from_file(
        path: &std::path::Path,
        experts: usize,
        world: usize,
        layers: usize,
    ) -> Result<Self, String> {
        let what = |e: &dyn std::fmt::Display| format!("--placement {}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| what(&e))?;
        let file: PlacementFile = serde_json::from_str(&text).map_err(|e| what(&e))?;
        if file.phy2log.len() != layers {
            return Err(what(&format!(
                "{} layers given, the model has {layers} MoE layers",
                file.phy2log.len()
            )));
        }
        Self::from_tables(experts, world, file.phy2log).map_err(|e| what(&e))
    }

    pub fn to_file(&self) -> PlacementFile {
        PlacementFile {
            phy2log: self.layers.iter().map(|l| l.phy2log.clone()).collect(),
        }
    }

    /// Slots per layer.
    pub fn slots(&self) -> usize {
        self.layers.first().map_or(0, |l| l.phy2log.len())
    }

    pub fn per_rank(&self) -> usize {
        self.slots() / self.world
    }

    pub fn redundant(&self) -> usize {
        self.slots() - self.experts
    }

    pub fn layers(&self) -> &[LayerSlots] {
        &self.layers
    }

    pub fn layer(&self, l: usize) -> &LayerSlots {
        &self.layers[l]
    }

    pub fn slots_of(&self, rank: usize) -> Range<usize> {
        let n = self.per_rank();
        rank * n..(rank + 1) * n
    }

    pub fn rank_of(&self, slot: usize) -> usize {
        slot / self.per_rank()
    }

    /// The logical experts of `rank`'s slots, per layer, in slot order (what it loads).
    pub fn experts_of(&self, rank: usize) -> Vec<Vec<usize>> {
        let r = self.slots_of(rank);
        (self.layers.iter())
            .map(|l| l.phy2log[r.clone()].iter().map(|&g| g as usize).collect())
            .collect()
    }

    /// Whether every layer is the contiguous blocks of one slot per expert.
    pub fn is_contiguous(&self) -> bool {
        self.redundant() == 0
            && (self.layers.iter())
                .all(|l| l.phy2log.iter().enumerate().all(|(s, &g)| s == g as usize))
    }

    /// The slots of `rank` whose expert differs in `next`, per layer (what a move rewrites).
    pub fn changed(&self, next: &SlotMap, rank: usize) -> Vec<Vec<usize>> {
        (self.layers.iter().zip(&next.layers))
            .map(|(a, b)| {
                self.slots_of(rank)
                    .filter(|&s| a.phy2log[s] != b.phy2log[s])
                    .collect()
            })
            .collect()
    }

    /// Logical experts' replica counts, per layer.
    pub fn replica_counts(&self, l: usize) -> Vec<usize> {
        self.layers[l].log2phy.iter().map(Vec::len).collect()
    }
}

impl SlotMap {
    /// Per layer, the replica table a GPU rank's gating reads (`to_slots`): for each logical
    /// expert, its slots on the ranks `near` marks (this rank's node), else all of them, padded
    /// to `width` with the last (`[experts][width]`), and how many (`[experts]`). An entry's
    /// slot is `table[e][(token + rank) % count[e]]`: `pick` with the token's index as `nth`.
    pub fn replica_table(&self, near: &[bool], width: usize) -> Vec<(Vec<i32>, Vec<i32>)> {
        (self.layers.iter())
            .map(|l| self.layer_table(l, near, width))
            .collect()
    }

    /// `replica_table`'s rows for one layer's slots `l` over this map's ranks: at most `width`
    /// replicas an expert, the lowest (a placement landing in parts may hold more for a while:
    /// an expert's old slots not yet rewritten beside its new ones; `parts::midway`).
    pub fn layer_table(&self, l: &LayerSlots, near: &[bool], width: usize) -> (Vec<i32>, Vec<i32>) {
        let e = self.experts;
        let (mut rep, mut cnt) = (Vec::with_capacity(e * width), Vec::with_capacity(e));
        for g in 0..e {
            let all = l.replicas(g);
            let close: Vec<u32> = (all.iter().copied())
                .filter(|&s| near[self.rank_of(s as usize)])
                .collect();
            let use_ = if close.is_empty() { all } else { &close[..] };
            assert!(!use_.is_empty(), "expert {g} without a slot");
            let use_ = &use_[..use_.len().min(width)];
            cnt.push(use_.len() as i32);
            rep.extend((0..width).map(|i| use_[i.min(use_.len() - 1)] as i32));
        }
        (rep, cnt)
    }
}

/// Which replica of a logical expert takes a row. `nth` counts the source's rows for that expert
/// in this step, so each source spreads an expert's rows evenly over its replicas; the source's
/// rank offsets the start, so sources with one row each do not all pick the first replica.
/// `near` (a slot's rank is on the source's node) narrows the choice to this node's replicas
/// where there are any.
pub fn pick(replicas: &[u32], nth: usize, src: usize, near: impl Fn(u32) -> bool) -> u32 {
    if replicas.len() == 1 {
        return replicas[0];
    }
    let local = replicas.iter().filter(|&&s| near(s)).count();
    let i = nth + src;
    match local {
        0 => replicas[i % replicas.len()],
        n if n == replicas.len() => replicas[i % n],
        n => *replicas
            .iter()
            .filter(|&&s| near(s))
            .nth(i % n)
            .expect("i % n < n local replicas"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank its block and the next block's first two experts (8 redundant of 16 on 4):
    /// without rank 1, its two experts that rank 0 does not hold move into redundant slots of
    /// the ranks left, nothing else moves, and rank 1's slots take no rows.
    #[test]
    fn a_lost_ranks_experts_move_into_redundant_slots() {
        let map = SlotMap::contiguous(16, 4, 8, 2).unwrap();
        let next = map.survive(&[1]).unwrap();
        assert_eq!(next.lost(), [1]);
        for (l, (a, b)) in map.layers().iter().zip(next.layers()).enumerate() {
            for g in 0..16 {
                let r = b.replicas(g);
                assert!(!r.is_empty(), "layer {l}: expert {g} has no slot left");
                assert!(r.iter().all(|&s| next.rank_of(s as usize) != 1));
            }
            let moved: Vec<usize> = (0..a.phy2log().len())
                .filter(|&s| a.phy2log()[s] != b.phy2log()[s])
                .collect();
            assert_eq!(
                moved.len(),
                2,
                "layer {l}: {:?} -> {:?}",
                a.phy2log(),
                b.phy2log()
            );
            assert!(moved.iter().all(|&s| next.rank_of(s) != 1));
            // Rank 1's own slots keep their entries: only the table stops routing to them.
            assert_eq!(a.phy2log()[6..12], b.phy2log()[6..12]);
        }
        // The second node of two (ranks 2 and 3) with 16 redundant slots: ranks 0 and 1 hold all.
        let map = SlotMap::contiguous(16, 4, 16, 1).unwrap();
        let next = map.survive(&[2, 3]).unwrap();
        assert!((0..16).all(|g| !next.layer(0).replicas(g).is_empty()));
    }

    /// No room: the error names the layer and an expert; a rank out of range, or the leader,
    /// cannot be out of the group.
    #[test]
    fn a_loss_without_room_is_refused_by_layer_and_expert() {
        let map = SlotMap::contiguous(16, 4, 4, 1).unwrap();
        let e = map.survive(&[1]).unwrap_err();
        assert!(
            e.contains("layer 0:") && e.contains("no redundant slot for expert"),
            "{e}"
        );
        let map = SlotMap::contiguous(16, 4, 0, 1).unwrap();
        assert!(map.survive(&[2]).is_err());
        let t = map.to_file().phy2log;
        assert!(SlotMap::without(16, 4, t.clone(), vec![0]).is_err());
        assert!(SlotMap::without(16, 4, t.clone(), vec![4]).is_err());
        let e = SlotMap::without(16, 4, t, vec![3]).unwrap_err();
        assert!(e.contains("has no slot on a rank in the group"), "{e}");
    }

    #[test]
    fn the_replica_table_lists_near_replicas_and_pads_with_the_last() {
        // 4 experts, 2 ranks, 2 redundant: rank 0 holds 0 1 2, rank 1 holds 2 3 0.
        let m = SlotMap::contiguous(4, 2, 2, 1).unwrap();
        assert_eq!(m.layer(0).phy2log(), &[0, 1, 2, 2, 3, 0]);
        let (rep, cnt) = m.replica_table(&[true, true], 3).remove(0);
        assert_eq!(cnt, vec![2, 1, 2, 1]);
        assert_eq!(&rep[..3], &[0, 5, 5]);
        assert_eq!(&rep[3..6], &[1, 1, 1]);
        assert_eq!(&rep[6..9], &[2, 3, 3]);
        // Only rank 1 on this node: its replicas of 0 and 2, and rank 0's only copy of 1.
        let (rep, cnt) = m.replica_table(&[false, true], 3).remove(0);
        assert_eq!(cnt, vec![1, 1, 1, 1]);
        assert_eq!(&rep[..3], &[5, 5, 5]);
        assert_eq!(&rep[3..6], &[1, 1, 1]);
        assert_eq!(&rep[6..9], &[3, 3, 3]);
    }

    #[test]
    fn no_redundancy_is_todays_contiguous_blocks() {
        let m = SlotMap::contiguous(16, 4, 0, 2).unwrap();
        assert!(m.is_contiguous());
        assert_eq!(m.slots_of(2), 8..12);
        assert_eq!(m.experts_of(2)[1], vec![8, 9, 10, 11]);
        assert_eq!(m.rank_of(11), 2);
        // One extra slot a rank: its block, then the next block's first expert.
        let r = SlotMap::contiguous(16, 4, 4, 1).unwrap();
        assert!(!r.is_contiguous());
        assert_eq!(r.per_rank(), 5);
        assert_eq!(r.experts_of(1)[0], vec![4, 5, 6, 7, 8]);
        assert_eq!(r.experts_of(3)[0], vec![12, 13, 14, 15, 0]);
        assert_eq!(r.layer(0).replicas(0), &[0, 19]);
        assert_eq!(r.layer(0).replicas(5), &[6]);
        // Slots that do not split by block: expert s mod E in slot s.
        let odd = SlotMap::contiguous(6, 4, 2, 1).unwrap();
        assert_eq!(odd.layer(0).phy2log(), &[0, 1, 2, 3, 4, 5, 0, 1]);
    }

    #[test]
    fn bad_tables_name_the_layer_and_the_expert() {
        let e = SlotMap::contiguous(16, 4, 2, 1).unwrap_err();
        assert!(e.contains("18 slots") && e.contains("4 ranks"), "{e}");
        let mut t = vec![(0..8).collect::<Vec<u32>>(); 3];
        t[2][5] = 4; // expert 5 lost, expert 4 twice
        let e = SlotMap::from_tables(8, 2, t.clone()).unwrap_err();
        assert_eq!(e, "layer 2: expert 5 has no slot");
        t[2][5] = 9;
        let e = SlotMap::from_tables(8, 2, t.clone()).unwrap_err();
        assert_eq!(e, "layer 2: slot 5 holds expert 9, the model has 8");
        t[2] = (0..10).collect();
        let e = SlotMap::from_tables(8, 2, t).unwrap_err();
        assert_eq!(e, "layer 2: 10 slots, layer 0 has 8");
    }

    #[test]
    fn a_placement_file_round_trips_and_is_checked() {
        let d = std::env::temp_dir().join(format!("epserve-placement-{}", std::process::id()));
        let m = SlotMap::from_tables(4, 2, vec![vec![3, 0, 1, 2, 3, 0], vec![0, 1, 2, 3, 1, 1]])
            .unwrap();
        std::fs::write(&d, serde_json::to_string(&m.to_file()).unwrap()).unwrap();
        assert_eq!(SlotMap::from_file(&d, 4, 2, 2).unwrap(), m);
        let e = SlotMap::from_file(&d, 4, 2, 3).unwrap_err();
        assert!(e.contains("2 layers given, the model has 3"), "{e}");
        std::fs::write(&d, r#"{"phy2log": [[0, 1, 2, 2], [0, 1, 2, 3]]}"#).unwrap();
        let e = SlotMap::from_file(&d, 4, 2, 2).unwrap_err();
        assert!(e.ends_with("layer 0: expert 3 has no slot"), "{e}");
        std::fs::remove_file(&d).unwrap();
    }

    #[test]
    fn rows_spread_evenly_over_replicas_and_stay_near_when_they_can() {
        let reps = [1, 5, 9];
        let mut hits = [0usize; 12];
        for src in 0..4 {
            for nth in 0..30 {
                hits[pick(&reps, nth, src, |_| true) as usize] += 1;
            }
        }
        assert_eq!((hits[1], hits[5], hits[9]), (40, 40, 40));
        // Slots 0..6 are on the source's node: only 1 and 5 are picked.
        let near = |s: u32| s < 6;
        let mut hits = [0usize; 12];
        for nth in 0..10 {
            hits[pick(&reps, nth, 0, near) as usize] += 1;
        }
        assert_eq!((hits[1], hits[5], hits[9]), (5, 5, 0));
        assert_eq!(pick(&[7], 3, 2, |_| false), 7);
    }

    #[test]
    fn changed_lists_only_the_rewritten_slots_of_a_rank() {
        let a = SlotMap::from_tables(4, 2, vec![vec![0, 1, 2, 3, 0, 1]]).unwrap();
        let b = SlotMap::from_tables(4, 2, vec![vec![0, 3, 2, 1, 0, 2]]).unwrap();
        assert_eq!(a.changed(&b, 0), vec![vec![1]]);
        assert_eq!(a.changed(&b, 1), vec![vec![3, 5]]);
    }
}
