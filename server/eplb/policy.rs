//! DeepSeek's EPLB policy (deepseek-ai/EPLB, `eplb.py`) in Rust, one layer at a time: replicate
//! the heaviest experts (greedy on load per replica), then pack slots onto ranks in balance
//! (heaviest first onto the lightest rank with room). Hierarchical when the expert groups divide
//! over the nodes (groups packed onto nodes first, so a token's group-limited experts stay on
//! few nodes), else global. Deterministic: ties go to the lowest index.
//!
//! `keep` then renames the result's ranks and slot positions to rewrite as few slots as it can:
//! a rank's slot set is what balances, not its number or order.

/// Greedy balanced packing of `weight` into `packs` packs of equal item count: returns each
/// item's pack and its position in the pack.
fn balanced_packing(weight: &[f64], packs: usize) -> (Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let per = n / packs;
    if per == 1 {
        return ((0..n).collect(), vec![0; n]);
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| weight[b].total_cmp(&weight[a]).then(a.cmp(&b)));
    let (mut load, mut items) = (vec![0.0f64; packs], vec![0usize; packs]);
    let (mut pack, mut rank) = (vec![0; n], vec![0; n]);
    for g in order {
        let p = (0..packs)
            .filter(|&p| items[p] < per)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .expect("a pack with room");
        pack[g] = p;
        rank[g] = items[p];
        load[p] += weight[g];
        items[p] += 1;
    }
    (pack, rank)
}

/// `phy` slots for the experts of `weight`: the first `weight.len()` hold one each; every extra
/// goes to the expert with the most load per replica. Returns (slot → expert, replicas per
/// expert).
fn replicate(weight: &[f64], phy: usize) -> (Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let mut phy2log: Vec<usize> = (0..n).collect();
    let mut count = vec![1usize; n];
    for _ in n..phy {
        let g = (0..n)
            .max_by(|&a, &b| {
                (weight[a] / count[a] as f64)
                    .total_cmp(&(weight[b] / count[b] as f64))
                    .then(b.cmp(&a))
            })
            .expect("experts");
        phy2log.push(g);
        count[g] += 1;
    }
    (phy2log, count)
}

/// The inverse of a permutation.
fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

/// `rebalance_experts_hierarchical` for one layer: `groups` expert groups, `nodes` nodes,
/// `gpus` ranks, `phy` slots. Returns slot → logical expert, slots in rank order.
fn hierarchical(
    weight: &[f64],
    phy: usize,
    groups: usize,
    nodes: usize,
    gpus: usize,
) -> Vec<usize> {
    let e = weight.len();
    let group_size = e / groups;
    let groups_per_node = groups / nodes;
    let per_gpu = phy / gpus;
    // 1: groups onto nodes.
    let per_group: Vec<f64> = weight.chunks(group_size).map(|c| c.iter().sum()).collect();
    let (gpack, grank) = balanced_packing(&per_group, nodes);
    let log2mlog: Vec<usize> = (0..e)
        .map(|g| {
            let grp = g / group_size;
            (gpack[grp] * groups_per_node + grank[grp]) * group_size + g % group_size
        })
        .collect();
    let mlog2log = inverse(&log2mlog);
    // 2: replicas within each node.
    let per_node = e / nodes;
    let phy_per_node = phy / nodes;
    let mut pphy2log = Vec::with_capacity(phy);
    for node in 0..nodes {
        let w: Vec<f64> = (0..per_node)
            .map(|m| weight[mlog2log[node * per_node + m]])
            .collect();
        let (phy2mlog, count) = replicate(&w, phy_per_node);
        // 3: the node's slots onto its ranks.
        let per_phy: Vec<f64> = phy2mlog.iter().map(|&m| w[m] / count[m] as f64).collect();
        let (pack, rank) = balanced_packing(&per_phy, gpus / nodes);
        let phy2pphy: Vec<usize> = (0..phy_per_node)
            .map(|p| pack[p] * per_gpu + rank[p])
            .collect();
        let pphy2phy = inverse(&phy2pphy);
        pphy2log.extend(
            pphy2phy
                .iter()
                .map(|&p| mlog2log[node * per_node + phy2mlog[p]]),
        );
    }
    pphy2log
}

/// DeepSeek's `rebalance_experts` for one layer's logical loads: hierarchical when `groups`
/// divides over `nodes`, else global (one group, one node).
pub fn rebalance(
    weight: &[f64],
    phy: usize,
    groups: usize,
    nodes: usize,
    world: usize,
) -> Vec<usize> {
    match groups % nodes == 0 && weight.len() % groups == 0 && world % nodes == 0 {
        true => hierarchical(weight, phy, groups, nodes, world),
        false => hierarchical(weight, phy, 1, 1, world),
    }
}

/// Each rank's load under `phy2log` (slots in rank order, `world` ranks), an expert's load
/// split evenly over its replicas, as routing spreads it.
pub fn rank_loads(weight: &[f64], phy2log: &[usize], world: usize) -> Vec<f64> {
    let mut count = vec![0usize; weight.len()];
    phy2log.iter().for_each(|&g| count[g] += 1);
    let per = phy2log.len() / world;
    phy2log
        .chunks(per)
        .map(|slots| slots.iter().map(|&g| weight[g] / count[g] as f64).sum())
        .collect()
}

/// Max over mean of `loads` (1 when there is no load).
pub fn imbalance(loads: &[f64]) -> f64 {
    let total: f64 = loads.iter().sum();
    if total <= 0.0 {
        return 1.0;
    }
    let max = loads.iter().copied().fold(0.0, f64::max);
    max * loads.len() as f64 / total
}

/// `next` with its ranks and each rank's slot order renamed to keep as many of `old`'s slots as
/// it can: ranks matched greedily by experts in common, then within a rank every expert already
/// in a slot keeps that slot. The multiset of experts per rank, hence the balance, is `next`'s.
pub fn keep(old: &[usize], next: &[usize], world: usize) -> Vec<usize> {
    let per = next.len() / world;
    let sets: Vec<&[usize]> = next.chunks(per).collect();
    let common = |r: usize, set: &[usize]| -> usize {
        let mut have: Vec<usize> = old[r * per..(r + 1) * per].to_vec();
        set.iter()
            .filter(|g| match have.iter().position(|h| h == *g) {
                Some(i) => {
                    have.swap_remove(i);
                    true
                }
                None => false,
            })
            .count()
    };
    // Pairs by experts in common, most first; ties by rank then set, so it is deterministic.
    let mut pairs: Vec<(usize, usize, usize)> = (0..world)
        .flat_map(|r| (0..world).map(move |s| (r, s)))
        .map(|(r, s)| (common(r, sets[s]), r, s))
        .collect();
    pairs.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let (mut rank_set, mut used) = (vec![usize::MAX; world], vec![false; world]);
    for (_, r, s) in pairs {
        if rank_set[r] == usize::MAX && !used[s] {
            rank_set[r] = s;
            used[s] = true;
        }
    }
    let mut out = Vec::with_capacity(next.len());
    for (r, &s) in rank_set.iter().enumerate() {
        let mut left: Vec<usize> = sets[s].to_vec();
        let slots = &old[r * per..(r + 1) * per];
        let mut placed: Vec<Option<usize>> = slots
            .iter()
            .map(|g| {
                let i = left.iter().position(|x| x == g)?;
                Some(left.remove(i))
            })
            .collect();
        let mut rest = left.into_iter();
        for p in placed.iter_mut().filter(|p| p.is_none()) {
            *p = rest.next();
        }
        out.extend(placed.into_iter().map(|p| p.expect("one expert per slot")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(phy2log: &[usize], e: usize) -> Vec<usize> {
        let mut c = vec![0; e];
        phy2log.iter().for_each(|&g| c[g] += 1);
        c
    }

    /// Hand-made loads over 16 experts, 4 ranks, 4 redundant slots.
    #[test]
    fn hot_experts_are_replicated_and_ranks_balance_within_the_packing_bound() {
        let mut w = vec![10.0; 16];
        w[0] = 400.0;
        w[1] = 150.0;
        for (groups, nodes) in [(1, 1), (4, 2), (4, 1), (3, 2)] {
            let p = rebalance(&w, 20, groups, nodes, 4);
            assert_eq!(p.len(), 20);
            let c = counts(&p, 16);
            assert!(
                c.iter().all(|&n| n >= 1),
                "every expert keeps a slot: {c:?}"
            );
            assert!(c[0] >= 3, "the hottest expert is replicated most: {c:?}");
            let loads = rank_loads(&w, &p, 4);
            let mean = w.iter().sum::<f64>() / 4.0;
            let biggest = (0..16).map(|g| w[g] / c[g] as f64).fold(0.0, f64::max);
            let max = loads.iter().copied().fold(0.0, f64::max);
            assert!(max <= mean + biggest + 1e-9, "{groups}/{nodes}: {loads:?}");
        }
        // Contiguous blocks and an extra slot each: rank 0 holds both hot experts.
        let start = [
            0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 12, 13, 14, 15, 0,
        ];
        let before = imbalance(&rank_loads(&w, &start, 4));
        let after = imbalance(&rank_loads(&w, &rebalance(&w, 20, 1, 1, 4), 4));
        // 4 replicas of 100 and 2 of 75 among 5 slots a rank: 100 + 75 + 3 x 10 is the best.
        assert!(
            before > 1.7 && (after - 205.0 / 172.5).abs() < 1e-9,
            "{before} -> {after}"
        );
        // A rank's block of hot experts spreads evenly: each rank gets 2 halves and 3 cold ones.
        let mut block = vec![10.0; 16];
        block[..4].fill(100.0);
        let p = rebalance(&block, 20, 1, 1, 4);
        assert!((imbalance(&rank_loads(&block, &p, 4)) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn hierarchical_keeps_each_node_to_whole_groups() {
        // 4 groups of 4 experts, 2 nodes of 2 ranks: each node's slots hold 2 whole groups.
        let w: Vec<f64> = (0..16).map(|g| (g * 7 % 11) as f64 + 1.0).collect();
        let p = rebalance(&w, 20, 4, 2, 4);
        for node in p.chunks(10) {
            let mut groups: Vec<usize> = node.iter().map(|g| g / 4).collect();
            groups.sort();
            groups.dedup();
            assert_eq!(groups.len(), 2, "{node:?}");
        }
    }

    #[test]
    fn it_is_deterministic_and_balanced_load_stays_even() {
        let w = vec![5.0; 16];
        assert_eq!(rebalance(&w, 16, 1, 1, 4), rebalance(&w, 16, 1, 1, 4));
        let p = rebalance(&w, 16, 1, 1, 4);
        assert!((imbalance(&rank_loads(&w, &p, 4)) - 1.0).abs() < 1e-12);
        assert_eq!(imbalance(&[0.0, 0.0]), 1.0);
    }

    #[test]
    fn keep_moves_only_what_balance_needs() {
        let old: Vec<usize> = (0..16).chain(0..4).collect();
        // The same sets, ranks and slot order shuffled: nothing moves.
        let same: Vec<usize> = old[15..20]
            .iter()
            .rev()
            .chain(old[5..10].iter())
            .chain(old[0..5].iter().rev())
            .chain(old[10..15].iter())
            .copied()
            .collect();
        assert_eq!(keep(&old, &same, 4), old);
        // One swap between ranks rewrites exactly two slots, and keeps the balance.
        let mut next = old.clone();
        next.swap(1, 6);
        let shuffled: Vec<usize> = next[5..10]
            .iter()
            .chain(&next[0..5])
            .chain(&next[10..])
            .copied()
            .collect();
        let k = keep(&old, &shuffled, 4);
        assert_eq!(k.iter().zip(&old).filter(|(a, b)| a != b).count(), 2);
        let w: Vec<f64> = (0..16).map(|g| g as f64).collect();
        let (mut a, mut b) = (rank_loads(&w, &k, 4), rank_loads(&w, &next, 4));
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        assert_eq!(a, b);
    }
}
