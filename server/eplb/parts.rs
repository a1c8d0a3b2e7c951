//! A placement cut into parts that land one after another, the same parts on every rank
//! (`plan`). After each part the table routes every logical expert to slots that hold it
//! (`midway`), so a layer whose placement is partly landed runs on it, and its next step waits
//! for its last part's copies only, not for the layer's. A part takes the slots whose old
//! expert would otherwise be left with no slot (a swap of two experts' only slots lands in one
//! part). Why parts: a layer's copies (604 MB a rank of Qwen3-30B-A3B) run at 340 GB/s on one
//! H200 (device copies) for 1.8 ms, and beside a step they share its memory bandwidth: a
//! 2048-token step's experts ran 1.12x beside 302 MB of copies, 1.05x beside 75 MB and 1.03x
//! beside 19 MB (`scripts/bench/copy-beside.py`, docs/benchmarks.md "Load balance").

use super::{LayerSlots, SlotMap};

/// Per layer, the slots (over the group) of each part, in the order they land. A layer whose
/// slots do not change has one empty part (its table rows are still written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub layers: Vec<Vec<Vec<usize>>>,
}

/// The parts that take `cur` to `next`, at most `cap` slots of one rank in a part (None: a
/// layer in one part) but for the slots a part must take with them; every rank computes the
/// same plan. Slots on ranks out of the group (in `next`) are not copied and take no rows.
pub fn plan(cur: &SlotMap, next: &SlotMap, cap: Option<usize>) -> Plan {
    let layers = (0..next.layers().len())
        .map(|l| layer_parts(cur, next, l, cap))
        .collect();
    Plan { layers }
}

fn layer_parts(cur: &SlotMap, next: &SlotMap, l: usize, cap: Option<usize>) -> Vec<Vec<usize>> {
    let (a, b) = (cur.layer(l).phy2log(), next.layer(l).phy2log());
    let (per, world) = (next.per_rank(), next.world);
    let live = |s: usize| next.live(s / per);
    let changed = |s: usize| live(s) && a[s] != b[s];
    // Seeds in turn over the ranks (index on the rank, then rank), so parts even out.
    let mut seeds: Vec<usize> = (0..b.len()).filter(|&s| changed(s)).collect();
    let Some(cap) = cap.filter(|_| !seeds.is_empty()) else {
        return vec![seeds];
    };
    seeds.sort_by_key(|&s| (s % per, s / per));
    let cap = cap.max(1);
    // Live slots holding each expert now; a slot's content is `a` until it lands, then `b`.
    let mut holds = vec![0usize; next.experts];
    (0..a.len())
        .filter(|&s| live(s))
        .for_each(|s| holds[a[s] as usize] += 1);
    let mut landed = vec![false; b.len()];
    let (mut parts, mut part, mut taken) = (Vec::new(), Vec::new(), vec![0usize; world]);
    for seed in seeds {
        if landed[seed] {
            continue;
        }
        if taken[seed / per] >= cap {
            parts.push(std::mem::take(&mut part));
            taken.iter_mut().for_each(|n| *n = 0);
        }
        let mut s = seed;
        loop {
            landed[s] = true;
            holds[a[s] as usize] -= 1;
            holds[b[s] as usize] += 1;
            taken[s / per] += 1;
            part.push(s);
            // An expert left with no slot takes one of its new slots into this part.
            let Some(g) = (0..holds.len()).find(|&g| holds[g] == 0) else {
                break;
            };
            s = (0..b.len())
                .find(|&s| b[s] as usize == g && changed(s) && !landed[s])
                .expect("a valid placement holds every expert in a live slot");
        }
    }
    parts.push(part);
    parts
}

/// Layer `l` with `plan`'s parts up to `upto` (included) landed: the slots they rewrite hold
/// `next`'s experts, the others still `cur`'s; ranks out of the group as `next` has them.
pub fn midway(cur: &SlotMap, next: &SlotMap, plan: &Plan, l: usize, upto: usize) -> LayerSlots {
    let mut t = cur.layer(l).phy2log().to_vec();
    let b = next.layer(l).phy2log();
    let per = next.per_rank();
    for s in (0..t.len()).filter(|&s| !next.live(s / per)) {
        t[s] = b[s];
    }
    for &s in plan.layers[l][..=upto].iter().flatten() {
        t[s] = b[s];
    }
    LayerSlots::new(t, next.experts, |s| !next.live(s / per))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 ranks of 4 slots, 6 experts: rank 0 holds 0..3 and 0, rank 1 holds 3..6 and 3.
    fn cur() -> SlotMap {
        SlotMap::from_tables(6, 2, vec![vec![0, 1, 2, 0, 3, 4, 5, 3]]).unwrap()
    }

    /// The blocks swapped over the ranks and reversed: every slot changes, experts 0..3 and
    /// 3..6 trade their only slots.
    fn swapped() -> SlotMap {
        SlotMap::from_tables(6, 2, vec![vec![5, 4, 3, 5, 2, 1, 0, 2]]).unwrap()
    }

    /// Every part's midway keeps every expert in a live slot, parts cover the changed slots
    /// once, and after the last the layer is `next`'s.
    fn check(cur: &SlotMap, next: &SlotMap, p: &Plan) {
        for (l, parts) in p.layers.iter().enumerate() {
            let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
            all.sort_unstable();
            let want: Vec<usize> = (0..next.slots())
                .filter(|&s| cur.layer(l).phy2log()[s] != next.layer(l).phy2log()[s])
                .filter(|&s| next.live(next.rank_of(s)))
                .collect();
            assert_eq!(all, want, "layer {l}: parts {parts:?}");
            for k in 0..parts.len() {
                let m = midway(cur, next, p, l, k);
                for g in 0..next.experts {
                    assert!(!m.replicas(g).is_empty(), "layer {l} part {k}: expert {g}");
                }
            }
            let last = midway(cur, next, p, l, parts.len() - 1);
            assert_eq!(last.phy2log(), next.layer(l).phy2log());
            let near = vec![true; next.world];
            let w = 1 + next.redundant();
            assert_eq!(
                next.layer_table(&last, &near, w),
                next.replica_table(&near, w)[l]
            );
        }
    }

    #[test]
    fn no_cap_lands_a_layer_in_one_part() {
        let p = plan(&cur(), &swapped(), None);
        assert_eq!(p.layers, vec![vec![(0..8).collect::<Vec<_>>()]]);
        check(&cur(), &swapped(), &p);
    }

    #[test]
    fn a_swap_of_only_slots_lands_together_and_parts_keep_every_expert_a_slot() {
        let (a, b) = (cur(), swapped());
        let p = plan(&a, &b, Some(1));
        check(&a, &b, &p);
        // Slot 0 (expert 0 -> 5) leaves expert 0 its replica in slot 3; slot 4 (3 -> 2)
        // leaves 3 its replica in slot 7: one slot of each rank.
        assert_eq!(p.layers[0][0], vec![0, 4]);
        // Slot 1 (1 -> 4) leaves expert 1 no slot: its new slot 5 (4 -> 1) comes along.
        assert_eq!(p.layers[0][1], vec![1, 5]);
        assert!(p.layers[0].len() > 2);
        // Larger parts: fewer, still valid.
        let q = plan(&a, &b, Some(3));
        check(&a, &b, &q);
        assert!(q.layers[0].len() < p.layers[0].len());
    }

    /// `eplb-gpu.sh moves`' two placements (at 16 experts): each rank its block and a replica,
    /// then the other rank's block reversed. Every expert's only slot trades places with
    /// another's over the ranks: parts of a slot a rank take one pair each.
    #[test]
    fn the_benchs_block_swap_lands_a_pair_a_part() {
        let a: Vec<u32> = (0..8).chain([5]).chain(8..16).chain([13]).collect();
        let b: Vec<u32> = (8..16)
            .rev()
            .chain([5])
            .chain((0..8).rev())
            .chain([13])
            .collect();
        let (a, b) = (
            SlotMap::from_tables(16, 2, vec![a]).unwrap(),
            SlotMap::from_tables(16, 2, vec![b]).unwrap(),
        );
        let p = plan(&a, &b, Some(1));
        check(&a, &b, &p);
        assert_eq!(p.layers[0].len(), 8, "{:?}", p.layers);
        for part in &p.layers[0] {
            assert_eq!(part.iter().filter(|&&s| s < 9).count(), 1, "{part:?}");
            assert_eq!(part.len(), 2, "{part:?}");
        }
    }

    #[test]
    fn a_layer_that_does_not_change_has_one_empty_part() {
        let p = plan(&cur(), &cur(), Some(1));
        assert_eq!(p.layers, vec![vec![Vec::<usize>::new()]]);
        check(&cur(), &cur(), &p);
    }

    #[test]
    fn random_placements_land_in_valid_parts() {
        // Deterministic pseudo-random placements: 16 experts, 4 redundant over 4 ranks.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        let table = |rnd: &mut dyn FnMut(usize) -> usize| {
            let mut t: Vec<u32> = (0..16).chain((0..4).map(|_| rnd(16) as u32)).collect();
            for i in (1..t.len()).rev() {
                t.swap(i, rnd(i + 1));
            }
            t
        };
        for case in 0..200 {
            let a = SlotMap::from_tables(16, 4, vec![table(&mut rnd), table(&mut rnd)]).unwrap();
            let b = SlotMap::from_tables(16, 4, vec![table(&mut rnd), table(&mut rnd)]).unwrap();
            let b = match case % 5 {
                0 => b.clone().with_lost(vec![2]).unwrap_or(b),
                _ => b,
            };
            for cap in [None, Some(1), Some(2), Some(5)] {
                check(&a, &b, &plan(&a, &b, cap));
            }
        }
    }
}
