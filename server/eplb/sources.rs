//! Where each slot a placement rewrites on a rank takes its weights from (`ops`): a slot of its
//! layer on the same rank that holds the expert when the copy runs (a device copy: no read of
//! the model source, no upload, and bit for bit what that slot was given), else the weights
//! staged from the model source. A rank's slots take their parts in `parts::plan`'s order; in
//! a part, a slot is read before it is written, and a cycle of slots that take each other's
//! experts (a swap) goes through one spare slot. On one rank every expert is local, so a
//! placement stages nothing; over ranks, only the experts a rank did not hold are staged. The
//! balancer's placements keep an expert in its slot where its rank keeps it (`policy::keep`),
//! so what they rewrite is mostly another rank's expert: this serves placement files that move
//! experts within a rank, and second replicas (docs/benchmarks.md, "Slots copied from slots of
//! the same rank").

use super::parts::Plan;
use super::SlotMap;

/// One write of a part, slots as indices on the rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The slot takes its weights as staged from the model source.
    Load(usize),
    /// Slot `to` takes slot `from`'s weights.
    Copy { from: usize, to: usize },
    /// The spare slot takes this slot's weights: the first of a cycle of copies.
    Save(usize),
    /// The slot takes the spare slot's weights: the last of that cycle.
    Restore(usize),
}

impl Op {
    /// The slot it writes (none: the spare).
    pub fn writes(self) -> Option<usize> {
        match self {
            Op::Load(s) | Op::Copy { to: s, .. } | Op::Restore(s) => Some(s),
            Op::Save(_) => None,
        }
    }
}

/// Per layer, per part of `plan` (from `cur` to `next`): the writes that land `rank`'s slots
/// of that part, in the order they run. A rank out of either placement stages every slot.
pub fn ops(cur: &SlotMap, next: &SlotMap, plan: &Plan, rank: usize) -> Vec<Vec<Vec<Op>>> {
    let mine = cur.slots_of(rank);
    let local = cur.live(rank) && next.live(rank);
    (plan.layers.iter().enumerate())
        .map(|(l, parts)| {
            let mut held = cur.layer(l).phy2log()[mine.clone()].to_vec();
            let want = &next.layer(l).phy2log()[mine.clone()];
            (parts.iter())
                .map(|part| {
                    let w: Vec<usize> = (part.iter().filter(|s| mine.contains(s)))
                        .map(|s| s - mine.start)
                        .collect();
                    let ops = match local {
                        true => part_ops(&held, want, &w),
                        false => w.iter().map(|&s| Op::Load(s)).collect(),
                    };
                    w.iter().for_each(|&s| held[s] = want[s]);
                    ops
                })
                .collect()
        })
        .collect()
}

/// Where a written slot reads from.
#[derive(Clone, Copy)]
enum Src {
    Load,
    /// A slot this part does not write.
    Kept(usize),
    /// A slot this part writes later: it is read first.
    Written(usize),
}

/// The writes of the slots `w` (each once) from `held` to `want`: a slot the part does not
/// write where one holds the expert, else one it writes (read before its own write), else
/// the staged weights. Slots read before their own write form chains (each written once the
/// writes that read it are done) and cycles (through the spare slot).
fn part_ops(held: &[u32], want: &[u32], w: &[usize]) -> Vec<Op> {
    let mut writing = vec![false; held.len()];
    w.iter().for_each(|&s| writing[s] = true);
    let holder = |d: usize, written: bool| {
        (0..held.len()).find(|&s| s != d && writing[s] == written && held[s] == want[d])
    };
    let src: Vec<Src> = (w.iter())
        .map(|&d| match (holder(d, false), holder(d, true)) {
            (Some(s), _) => Src::Kept(s),
            (None, Some(s)) => Src::Written(s),
            (None, None) => Src::Load,
        })
        .collect();
    // Per slot: its place in `w`, and how many of the part's writes read it first.
    let mut at = vec![usize::MAX; held.len()];
    w.iter().enumerate().for_each(|(k, &s)| at[s] = k);
    let mut readers = vec![0usize; held.len()];
    for s in &src {
        if let Src::Written(s) = *s {
            readers[s] += 1;
        }
    }
    let mut ops = Vec::with_capacity(w.len() + 2);
    let mut done = vec![false; w.len()];
    let mut ready: std::collections::VecDeque<usize> =
        (w.iter().copied()).filter(|&s| readers[s] == 0).collect();
    loop {
        while let Some(d) = ready.pop_front() {
            done[at[d]] = true;
            ops.push(match src[at[d]] {
                Src::Load => Op::Load(d),
                Src::Kept(s) => Op::Copy { from: s, to: d },
                Src::Written(s) => {
                    readers[s] -= 1;
                    if readers[s] == 0 {
                        ready.push_back(s);
                    }
                    Op::Copy { from: s, to: d }
                }
            });
        }
        // What is left is read by one write left each and reads one: cycles.
        let Some(k) = done.iter().position(|d| !d) else {
            return ops;
        };
        let first = w[k];
        ops.push(Op::Save(first));
        let mut d = first;
        loop {
            done[at[d]] = true;
            let Src::Written(s) = src[at[d]] else {
                unreachable!("a slot left in a cycle reads a slot of the part");
            };
            if s == first {
                ops.push(Op::Restore(d));
                break;
            }
            ops.push(Op::Copy { from: s, to: d });
            d = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eplb::parts::{midway, plan};

    /// Runs `ops` over the slots' experts and checks each part against `midway` (what the
    /// table routes to once it lands), each Load's expert against every slot of the rank as
    /// the part began (staged only where none held it), and each part's slots written once.
    /// Returns the Loads and the cycles (Saves).
    fn run(cur: &SlotMap, next: &SlotMap, p: &Plan, rank: usize) -> (usize, usize) {
        let mine = cur.slots_of(rank);
        let all = ops(cur, next, p, rank);
        let (mut loads, mut saves) = (0, 0);
        for (l, parts) in all.iter().enumerate() {
            let want = &next.layer(l).phy2log()[mine.clone()];
            let mut held = cur.layer(l).phy2log()[mine.clone()].to_vec();
            let mut spare = None;
            assert_eq!(parts.len(), p.layers[l].len(), "layer {l}: a list a part");
            for (k, part) in parts.iter().enumerate() {
                let began = held.clone();
                let mut written: Vec<usize> = part.iter().filter_map(|o| o.writes()).collect();
                written.sort_unstable();
                let mut planned: Vec<usize> = (p.layers[l][k].iter())
                    .filter(|s| mine.contains(s))
                    .map(|s| s - mine.start)
                    .collect();
                planned.sort_unstable();
                assert_eq!(written, planned, "layer {l} part {k}: {part:?}");
                for &o in part {
                    match o {
                        Op::Load(s) => {
                            loads += 1;
                            if cur.live(rank) && next.live(rank) {
                                assert!(
                                    !began.contains(&want[s]),
                                    "layer {l} part {k}: slot {s} staged expert {} the rank held",
                                    want[s]
                                );
                            }
                            held[s] = want[s];
                        }
                        Op::Copy { from, to } => {
                            assert_ne!(from, to);
                            held[to] = held[from];
                        }
                        Op::Save(s) => {
                            saves += 1;
                            spare = Some(held[s]);
                        }
                        Op::Restore(s) => held[s] = spare.take().expect("saved first"),
                    }
                }
                let table = midway(cur, next, p, l, k);
                assert_eq!(
                    held,
                    &table.phy2log()[mine.clone()],
                    "layer {l} part {k} on rank {rank}: {part:?}"
                );
            }
        }
        (loads, saves)
    }

    /// `eplb-gpu.sh moves`' placements at 16 experts and `w` ranks: each rank its block and a
    /// share of two replicas, then the next rank's block reversed.
    fn bench(w: usize) -> (SlotMap, SlotMap) {
        let per = 16 / w;
        let extra = |r: usize| [5u32, 13][r * 2 / w..(r + 1) * 2 / w].to_vec();
        let block = |r: usize| (r * per) as u32..((r + 1) * per) as u32;
        let a = (0..w).flat_map(|r| block(r).chain(extra(r))).collect();
        let b = (0..w)
            .flat_map(|r| block((r + 1) % w).rev().chain(extra(r)))
            .collect();
        (
            SlotMap::from_tables(16, w, vec![a]).unwrap(),
            SlotMap::from_tables(16, w, vec![b]).unwrap(),
        )
    }

    #[test]
    fn on_one_rank_a_reversed_block_stages_nothing_and_swaps_through_the_spare() {
        let (a, b) = bench(1);
        for cap in [None, Some(1), Some(3)] {
            let p = plan(&a, &b, cap);
            // 16 slots reversed: 8 swaps, 6 through the spare; the replicas of 5 and 13 give
            // those two experts, so their swaps are chains.
            assert_eq!(run(&a, &b, &p, 0), (0, 6), "cap {cap:?}");
            assert_eq!(
                run(&b, &a, &plan(&b, &a, cap), 0),
                (0, 6),
                "back, cap {cap:?}"
            );
        }
        // A swap: slot 0 saved, slot 15's weights into 0, the saved ones into 15.
        let first = &ops(&a, &b, &plan(&a, &b, Some(1)), 0)[0][0];
        assert_eq!(
            first,
            &vec![Op::Save(0), Op::Copy { from: 15, to: 0 }, Op::Restore(15)]
        );
    }

    #[test]
    fn over_two_ranks_a_block_from_the_other_rank_is_staged() {
        let (a, b) = bench(2);
        for cap in [None, Some(1)] {
            let p = plan(&a, &b, cap);
            for r in 0..2 {
                assert_eq!(run(&a, &b, &p, r), (8, 0), "rank {r}, cap {cap:?}");
            }
        }
    }

    #[test]
    fn a_replica_is_copied_from_a_kept_slot_and_a_shift_chains_without_the_spare() {
        // One rank of 5 slots, 4 experts: the replica of 0 (slot 4) becomes one of 3, copied
        // from slot 3, which the part does not write.
        let a = SlotMap::from_tables(4, 1, vec![vec![0, 1, 2, 3, 0]]).unwrap();
        let b = SlotMap::from_tables(4, 1, vec![vec![0, 1, 2, 3, 3]]).unwrap();
        let p = plan(&a, &b, None);
        assert_eq!(
            ops(&a, &b, &p, 0),
            vec![vec![vec![Op::Copy { from: 3, to: 4 }]]]
        );
        assert_eq!(run(&a, &b, &p, 0), (0, 0));
        // Every slot takes its right neighbour's expert, and the last one slot 0's: slot 4
        // (the replica of 0) keeps the chain open, so no cycle and no spare.
        let c = SlotMap::from_tables(4, 1, vec![vec![1, 2, 3, 0, 0]]).unwrap();
        let p = plan(&a, &c, None);
        let o = &ops(&a, &c, &p, 0)[0][0];
        assert_eq!(
            o,
            &vec![
                Op::Copy { from: 1, to: 0 },
                Op::Copy { from: 2, to: 1 },
                Op::Copy { from: 3, to: 2 },
                Op::Copy { from: 4, to: 3 },
            ]
        );
        assert_eq!(run(&a, &c, &p, 0), (0, 0));
    }

    #[test]
    fn random_placements_land_right_and_stage_only_what_the_rank_lacks() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        let table = |rnd: &mut dyn FnMut(usize) -> usize, extra: usize| {
            let mut t: Vec<u32> = (0..12).chain((0..extra).map(|_| rnd(12) as u32)).collect();
            for i in (1..t.len()).rev() {
                t.swap(i, rnd(i + 1));
            }
            t
        };
        let (mut loads, mut copies) = (0, 0);
        for case in 0..300 {
            let w = [1, 2, 3, 4][case % 4];
            let extra = w * [0, 1, 3][case % 3];
            let a =
                SlotMap::from_tables(12, w, vec![table(&mut rnd, extra), table(&mut rnd, extra)])
                    .unwrap();
            let b =
                SlotMap::from_tables(12, w, vec![table(&mut rnd, extra), table(&mut rnd, extra)])
                    .unwrap();
            let b = match (case % 7, w) {
                (0, 3 | 4) => b.clone().with_lost(vec![1]).unwrap_or(b),
                _ => b,
            };
            for cap in [None, Some(1), Some(2), Some(5)] {
                let p = plan(&a, &b, cap);
                for r in (0..w).filter(|&r| b.live(r)) {
                    let (n, _) = run(&a, &b, &p, r);
                    let written: usize = (p.layers.iter().flatten().flatten())
                        .filter(|s| a.slots_of(r).contains(s))
                        .count();
                    loads += n;
                    copies += written - n;
                }
            }
        }
        // Both kinds ran: the check above is not vacuous.
        assert!(
            loads > 1000 && copies > 1000,
            "{loads} loads, {copies} copies"
        );
    }
}
