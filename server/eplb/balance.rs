//! The leader's balancer: the routed rows of the last `--eplb-window` steps, per layer, and the
//! placement changes it proposes from them. A change goes through three states:
//! proposed (every rank told: `Order::Placement`), staged (every rank has the new slots' weights
//! beside the old ones: `Report::Staged`), applied (the leader stamps the epoch on the next step's
//! descriptor; every rank swaps at that step's start). So every rank switches at the same step
//! and no step waits for a weight.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::policy;
use super::table::SlotMap;
use crate::metric_names;

/// `--eplb-*`.
#[derive(Clone, Debug)]
pub struct EplbConfig {
    /// Between looks at the window (None: no online rebalance).
    pub interval: Option<Duration>,
    /// Steps (all layers together) the load is summed over.
    pub window: usize,
    /// A layer whose max/mean rank load is within this is left as it is.
    pub threshold: f64,
    /// The model's expert groups (group-limited routing; 1 otherwise) and the group's nodes,
    /// for the hierarchical policy.
    pub groups: usize,
    pub nodes: usize,
}

/// One layer's sums over the window.
#[derive(Clone, Default)]
struct Sums {
    experts: Vec<u64>,
    ranks: Vec<u64>,
}

/// The last `cap` steps' routed rows, and their sums per layer.
struct Window {
    cap: usize,
    steps: VecDeque<(usize, Vec<u32>, Vec<u32>)>,
    sums: Vec<Sums>,
}

impl Window {
    fn new(cap: usize, layers: usize, experts: usize, world: usize) -> Self {
        let sums = Sums {
            experts: vec![0; experts],
            ranks: vec![0; world],
        };
        Self {
            cap: cap.max(1),
            steps: VecDeque::with_capacity(cap.clamp(1, 4096)),
            sums: vec![sums; layers],
        }
    }

    fn push(&mut self, layer: usize, experts: Vec<u32>, ranks: Vec<u32>) {
        if self.steps.len() == self.cap {
            let (l, e, r) = self.steps.pop_front().expect("full");
            sub(&mut self.sums[l].experts, &e);
            sub(&mut self.sums[l].ranks, &r);
        }
        add(&mut self.sums[layer].experts, &experts);
        add(&mut self.sums[layer].ranks, &ranks);
        self.steps.push_back((layer, experts, ranks));
    }

    fn clear(&mut self) {
        self.steps.clear();
        for s in &mut self.sums {
            s.experts.fill(0);
            s.ranks.fill(0);
        }
    }
}

fn add(into: &mut [u64], v: &[u32]) {
    into.iter_mut()
        .zip(v)
        .for_each(|(a, &b)| *a += u64::from(b));
}

fn sub(into: &mut [u64], v: &[u32]) {
    into.iter_mut()
        .zip(v)
        .for_each(|(a, &b)| *a -= u64::from(b));
}

/// Rows per logical expert and per rank of one step, from its `[world, slots]` routing.
pub fn fold(map: &SlotMap, layer: usize, routed: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let slots = map.slots();
    let (mut experts, mut ranks) = (vec![0u32; map.experts], vec![0u32; map.world]);
    let phy2log = map.layer(layer).phy2log();
    for src in routed.chunks_exact(slots) {
        for (s, &n) in src.iter().enumerate() {
            experts[phy2log[s] as usize] += n;
            ranks[map.rank_of(s)] += n;
        }
    }
    (experts, ranks)
}

/// The rows of the ranks in the group.
fn live_rows(map: &SlotMap, ranks: &[u64]) -> Vec<u64> {
    (ranks.iter().enumerate())
        .filter(|&(r, _)| map.live(r))
        .map(|(_, &n)| n)
        .collect()
}

/// Max over mean of measured rank rows (1 with none).
fn ratio(ranks: &[u64]) -> f64 {
    let v: Vec<f64> = ranks.iter().map(|&n| n as f64).collect();
    policy::imbalance(&v)
}

/// The placement the window asks for, or None when every layer is within `threshold` (or a new
/// placement would not beat it by that much). Layers with no rows keep theirs.
/// Ranks out of the group (`SlotMap::lost`) take no part: the policy places the slots of the
/// ranks in it, and a lost rank's slots stay as they were.
pub fn decide(map: &SlotMap, loads: &[(Vec<u64>, Vec<u64>)], cfg: &EplbConfig) -> Option<SlotMap> {
    let per = map.per_rank();
    let ranks_in: Vec<usize> = (0..map.world).filter(|&r| map.live(r)).collect();
    let (world, slots) = (ranks_in.len(), ranks_in.len() * per);
    let mut changed = false;
    let tables: Vec<Vec<u32>> = (map.layers().iter().zip(loads))
        .map(|(layer, (experts, ranks))| {
            let all = layer.phy2log();
            let old: Vec<usize> = (ranks_in.iter())
                .flat_map(|&r| all[r * per..(r + 1) * per].iter().map(|&g| g as usize))
                .collect();
            let now = ratio(&ranks_in.iter().map(|&r| ranks[r]).collect::<Vec<_>>());
            if experts.iter().all(|&n| n == 0) || now <= cfg.threshold {
                return all.to_vec();
            }
            let w: Vec<f64> = experts.iter().map(|&n| n as f64).collect();
            let nodes = match world % cfg.nodes {
                0 => cfg.nodes,
                _ => 1,
            };
            let next = policy::rebalance(&w, slots, cfg.groups, nodes, world);
            let next = policy::keep(&old, &next, world);
            let then = policy::imbalance(&policy::rank_loads(&w, &next, world));
            if then * cfg.threshold >= now || next == old {
                return all.to_vec();
            }
            changed = true;
            let mut t = all.to_vec();
            for (i, &r) in ranks_in.iter().enumerate() {
                for j in 0..per {
                    t[r * per + j] = next[i * per + j] as u32;
                }
            }
            t
        })
        .collect();
    changed.then(|| {
        SlotMap::without(map.experts, map.world, tables, map.lost().to_vec())
            .expect("the policy keeps every expert")
    })
}

/// A placement on its way to the ranks.
struct Pending {
    epoch: u32,
    map: Arc<SlotMap>,
    staged: Vec<bool>,
    failed: Option<String>,
    bytes: u64,
    since: Instant,
    /// The leader's own backend was given it to stage.
    handed: bool,
}

struct State {
    map: Arc<SlotMap>,
    epoch: u32,
    window: Window,
    pending: Option<Pending>,
}

/// The leader's view of the placement and the load (shared by the step executor, the control
/// readers, the balancer thread and GetModelInfo).
pub struct Balance {
    pub cfg: EplbConfig,
    layer_ids: Vec<u32>,
    st: Mutex<State>,
    changed: Condvar,
    /// The newest epoch every rank has staged: the executor stamps it on the next step.
    ready: AtomicU32,
}

impl Balance {
    pub fn new(map: SlotMap, layer_ids: Vec<u32>, cfg: EplbConfig) -> Self {
        let window = Window::new(cfg.window, map.layers().len(), map.experts, map.world);
        let b = Self {
            cfg,
            layer_ids,
            st: Mutex::new(State {
                map: Arc::new(map),
                epoch: 0,
                window,
                pending: None,
            }),
            changed: Condvar::new(),
            ready: AtomicU32::new(0),
        };
        b.replica_gauges(&b.lock().map);
        // Exported from the start (at 0), so a dashboard or alert sees the series before a move.
        metrics::counter!(metric_names::EPLB_REBALANCES_TOTAL).increment(0);
        metrics::counter!(metric_names::EPLB_MOVED_BYTES_TOTAL).increment(0);
        b
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The placement steps run on now, and its epoch.
    pub fn current(&self) -> (u32, Arc<SlotMap>) {
        let st = self.lock();
        (st.epoch, st.map.clone())
    }

    /// The window's rows per logical expert and per rank, by layer.
    pub fn loads(&self) -> Vec<(Vec<u64>, Vec<u64>)> {
        let st = self.lock();
        (st.window.sums.iter())
            .map(|s| (s.experts.clone(), s.ranks.clone()))
            .collect()
    }

    fn replica_gauges(&self, map: &SlotMap) {
        for (l, &id) in self.layer_ids.iter().enumerate() {
            let most = map.replica_counts(l).into_iter().max().unwrap_or(1);
            metrics::gauge!(metric_names::EXPERT_REPLICAS, "layer" => id.to_string())
                .set(most as f64);
        }
    }

    /// A completed step's routing (`[world, slots]` rows) under placement `epoch`; a step of an
    /// older placement is no longer counted.
    pub fn record(&self, layer: usize, epoch: u32, routed: &[u32]) {
        if routed.iter().all(|&n| n == 0) {
            return;
        }
        let mut st = self.lock();
        if epoch != st.epoch || layer >= st.window.sums.len() {
            return;
        }
        let (experts, ranks) = fold(&st.map, layer, routed);
        st.window.push(layer, experts, ranks);
        let r = ratio(&live_rows(&st.map, &st.window.sums[layer].ranks));
        let id = self.layer_ids.get(layer).copied().unwrap_or(layer as u32);
        metrics::gauge!(metric_names::RANK_LOAD_RATIO, "layer" => id.to_string()).set(r);
    }

    /// The epoch to stamp on the next step. The first step stamped with a new epoch applies it
    /// here too: the leader counts load under the new placement from then on.
    pub fn stamp(&self) -> u32 {
        let ready = self.ready.load(Ordering::Acquire);
        let mut st = self.lock();
        if ready == st.epoch {
            return ready;
        }
        let Some(p) = st.pending.take_if(|p| p.epoch == ready) else {
            return st.epoch;
        };
        st.map = p.map.clone();
        st.epoch = p.epoch;
        st.window.clear();
        metrics::counter!(metric_names::EPLB_REBALANCES_TOTAL).increment(1);
        metrics::counter!(metric_names::EPLB_MOVED_BYTES_TOTAL).increment(p.bytes);
        let secs = p.since.elapsed().as_secs_f64();
        metrics::histogram!(metric_names::EPLB_REBALANCE_SECONDS).record(secs);
        self.replica_gauges(&p.map);
        tracing::info!(
            epoch = p.epoch,
            moved_bytes = p.bytes,
            seconds = secs,
            "placement applied"
        );
        drop(st);
        self.changed.notify_all();
        ready
    }

    /// The proposal the leader's own backend has not been given yet (once).
    pub fn take_own(&self) -> Option<(u32, Arc<SlotMap>)> {
        let mut st = self.lock();
        let p = st.pending.as_mut().filter(|p| !p.handed)?;
        p.handed = true;
        Some((p.epoch, p.map.clone()))
    }

    /// `rank` has the weights of `epoch` staged (`Ok(bytes loaded)`), or could not get them.
    pub fn staged(&self, rank: usize, epoch: u32, r: Result<u64, String>) {
        let mut st = self.lock();
        let Some(p) = st.pending.as_mut().filter(|p| p.epoch == epoch) else {
            return;
        };
        match r {
            Ok(bytes) if rank < p.staged.len() => {
                p.staged[rank] = true;
                p.bytes += bytes;
            }
            Ok(_) => p.failed = Some(format!("rank {rank} is not in the group")),
            Err(e) => p.failed = Some(format!("rank {rank}: {e}")),
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Proposes `next` to every rank (`tell`), waits (within `within`) until each has staged it,
    /// and readies it for the next step; then waits for that step. Err: not applied, and why
    /// (the ranks drop what they staged at the next proposal).
    pub fn propose(
        &self,
        next: SlotMap,
        tell: &dyn Fn(u32, &SlotMap) -> Result<(), String>,
        within: Duration,
    ) -> Result<u32, String> {
        let deadline = Instant::now() + within;
        let (epoch, map) = self.offer(next, false)?;
        if let Err(e) = tell(epoch, &map) {
            self.drop_pending(epoch);
            return Err(e);
        }
        let mut st = self.wait_staged(epoch, deadline)?;
        self.ready.store(epoch, Ordering::Release);
        // The next step (a heartbeat at the latest) applies it.
        while st.epoch < epoch {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("no step applied epoch {epoch} within {within:?}"));
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(epoch)
    }

    /// A recovery's placement (`--on-rank-loss continue`): `next`, without the lost ranks,
    /// takes the place of any placement on its way; every rank in the group is told (`tell`;
    /// the leader's own backend through `take_own`) and stages it within `within`. The next
    /// step stamped applies it. Err: a rank could not stage it.
    pub fn recover(
        &self,
        next: SlotMap,
        tell: &dyn Fn(u32, &SlotMap) -> Result<(), String>,
        own: &mut dyn FnMut(u32, Arc<SlotMap>),
        within: Duration,
    ) -> Result<u32, String> {
        let deadline = Instant::now() + within;
        let (epoch, map) = self.offer(next, true)?;
        tell(epoch, &map)?;
        if let Some((e, m)) = self.take_own() {
            own(e, m);
        }
        drop(self.wait_staged(epoch, deadline)?);
        self.ready.store(epoch, Ordering::Release);
        Ok(epoch)
    }

    /// Sets `next` as the placement on its way (a recovery's replaces another one).
    fn offer(&self, next: SlotMap, recovery: bool) -> Result<(u32, Arc<SlotMap>), String> {
        let mut st = self.lock();
        if st.pending.is_some() && !recovery {
            return Err("a placement is already on its way".into());
        }
        if next.lost() != st.map.lost() && !recovery {
            return Err("the group lost a rank since this placement was made".into());
        }
        if next.world != st.map.world || next.slots() != st.map.slots() {
            return Err(format!(
                "{} slots over {} ranks, the group has {} over {}",
                next.slots(),
                next.world,
                st.map.slots(),
                st.map.world
            ));
        }
        // Past any epoch offered before (a recovery may replace one that was never applied).
        let epoch = st.epoch.max(st.pending.as_ref().map_or(0, |p| p.epoch)) + 1;
        let map = Arc::new(next);
        st.pending = Some(Pending {
            epoch,
            map: map.clone(),
            staged: (0..map.world).map(|r| !map.live(r)).collect(),
            failed: None,
            bytes: 0,
            since: Instant::now(),
            handed: false,
        });
        drop(st);
        self.changed.notify_all();
        Ok((epoch, map))
    }

    fn drop_pending(&self, epoch: u32) {
        let mut st = self.lock();
        st.pending.take_if(|p| p.epoch == epoch);
    }

    /// Waits until every rank in the group has staged `epoch`. Err: one failed, it was
    /// replaced, or the deadline passed (it is dropped).
    fn wait_staged(
        &self,
        epoch: u32,
        deadline: Instant,
    ) -> Result<std::sync::MutexGuard<'_, State>, String> {
        let mut st = self.lock();
        loop {
            let Some(p) = st.pending.as_ref().filter(|p| p.epoch == epoch) else {
                return Err("a recovery from a lost rank took its place".into());
            };
            if let Some(f) = &p.failed {
                let f = f.clone();
                st.pending = None;
                return Err(f);
            }
            if p.staged.iter().all(|&s| s) {
                return Ok(st);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<String> = (p.staged.iter().enumerate())
                    .filter(|(_, &s)| !s)
                    .map(|(r, _)| r.to_string())
                    .collect();
                st.pending = None;
                return Err(format!(
                    "ranks {} did not stage it in time",
                    missing.join(", ")
                ));
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The placement, the window's load and what a look would choose now, as JSON (`/eplb`):
    /// `would_choose` is a placement file, or null when every layer is within the threshold.
    pub fn status(&self) -> serde_json::Value {
        let (epoch, map) = self.current();
        let loads = self.loads();
        let steps = self.lock().window.steps.len();
        let layers: Vec<serde_json::Value> = (self.layer_ids.iter().zip(map.layers()).zip(&loads))
            .map(|((&id, l), (experts, ranks))| {
                serde_json::json!({
                    "layer": id,
                    "phy2log": l.phy2log(),
                    "expert_rows": experts,
                    "rank_rows": ranks,
                    "rank_load_ratio": ratio(&live_rows(&map, ranks)),
                })
            })
            .collect();
        let next = decide(&map, &loads, &self.cfg).map(|m| m.to_file());
        serde_json::json!({
            "epoch": epoch,
            "slots_per_rank": map.per_rank(),
            "window_steps": steps,
            "threshold": self.cfg.threshold,
            "layers": layers,
            "would_choose": next,
        })
    }

    /// One look at the window: a proposal when it asks for one. Ok(None): nothing to move.
    pub fn look(
        &self,
        tell: &dyn Fn(u32, &SlotMap) -> Result<(), String>,
        within: Duration,
    ) -> Result<Option<u32>, String> {
        let (_, map) = self.current();
        match decide(&map, &self.loads(), &self.cfg) {
            Some(next) => self.propose(next, tell, within).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EplbConfig {
        EplbConfig {
            interval: None,
            window: 3,
            threshold: 1.05,
            groups: 1,
            nodes: 1,
        }
    }

    /// 8 experts over 2 ranks of 5 slots (2 redundant).
    fn map() -> SlotMap {
        SlotMap::contiguous(8, 2, 2, 1).unwrap()
    }

    /// `[world, slots]` rows, all from source 0.
    fn routed(map: &SlotMap, rows: &[(usize, u32)]) -> Vec<u32> {
        let mut r = vec![0; map.world * map.slots()];
        for &(slot, n) in rows {
            r[slot] += n;
        }
        r
    }

    #[test]
    fn the_window_keeps_the_last_steps_and_folds_replicas() {
        let m = map();
        let b = Balance::new(m.clone(), vec![3], cfg());
        // Slot 9 holds expert 0 again (on rank 1); slot 4 holds expert 4 (on rank 0).
        for _ in 0..5 {
            b.record(0, 0, &routed(&m, &[(0, 10), (9, 10), (4, 1)]));
        }
        let (experts, ranks) = &b.loads()[0];
        assert_eq!(experts[0], 60, "3 steps of 20 rows");
        assert_eq!(experts[4], 3);
        assert_eq!(
            ranks,
            &vec![33, 30],
            "slots 0 and 4 on rank 0, slot 9 on rank 1"
        );
        // A step of another epoch is not counted.
        b.record(0, 7, &routed(&m, &[(1, 100)]));
        assert_eq!(b.loads()[0].0[1], 0);
    }

    #[test]
    fn balanced_load_moves_nothing_and_skew_moves_the_hot_experts_apart() {
        let m = map();
        let even: Vec<u64> = vec![10; 8];
        assert!(decide(&m, &[(even, vec![50, 50])], &cfg()).is_none());
        let mut hot = vec![1u64; 8];
        hot[0] = 40;
        hot[1] = 40;
        // Contiguous: rank 0 has experts 0-3 and 8..: measured 100 against 30.
        let next = decide(&m, &[(hot.clone(), vec![100, 30])], &cfg()).expect("a move");
        let w: Vec<f64> = hot.iter().map(|&n| n as f64).collect();
        let p: Vec<usize> = next
            .layer(0)
            .phy2log()
            .iter()
            .map(|&g| g as usize)
            .collect();
        assert!(policy::imbalance(&policy::rank_loads(&w, &p, 2)) < 1.05);
    }

    #[test]
    fn a_proposal_applies_at_the_first_stamped_step_once_every_rank_staged() {
        let m = map();
        let b = Arc::new(Balance::new(m.clone(), vec![3], cfg()));
        let next = SlotMap::from_tables(8, 2, vec![vec![0, 1, 2, 3, 4, 5, 6, 7, 0, 1]]).unwrap();
        let b2 = b.clone();
        let proposer =
            std::thread::spawn(move || b2.propose(next, &|_, _| Ok(()), Duration::from_secs(10)));
        let (epoch, own) = loop {
            if let Some(t) = b.take_own() {
                break t;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(epoch, 1);
        assert!(b.take_own().is_none(), "handed once");
        b.staged(0, 1, Ok(100));
        assert_eq!(b.stamp(), 0, "rank 1 has not staged");
        b.staged(1, 1, Ok(50));
        while b.stamp() != 1 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(proposer.join().unwrap(), Ok(1));
        assert_eq!(b.current(), (1, own));
        // A rank that cannot stage fails the proposal; the placement stays.
        let b2 = b.clone();
        let again =
            std::thread::spawn(move || b2.propose(map(), &|_, _| Ok(()), Duration::from_secs(10)));
        while b.take_own().is_none() {
            std::thread::sleep(Duration::from_millis(1));
        }
        b.staged(1, 2, Err("disk".into()));
        assert_eq!(again.join().unwrap(), Err("rank 1: disk".into()));
        assert_eq!(b.stamp(), 1);
    }
}
