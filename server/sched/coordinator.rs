//! `--ingress all`, on the leader: every rank batches its own clients' requests into offers of at
//! most one home slice (its batcher, as the leader's), and this actor turns the ranks' offers into
//! group steps. Each rank's offers are taken in order; a step takes the key (layer, dtypes,
//! routing) of the oldest offer at the head of any rank, and every rank whose head has that key
//! joins with it, the others with zero rows. So no rank's requests wait behind another's flood:
//! a head only gets older until it is the oldest. Like the batcher, a step of full offers may
//! queue behind a running one; any other waits for an empty pipeline, and fills meanwhile.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use super::batcher::ready_for_step;
use super::job::Step;
use crate::lifecycle::Abort;
use crate::metric_names;
use crate::request::Failure;
use crate::step::StepKey;

/// One rank's offer (`IngressReport::Offer`): `tokens` rows of `key`, packed there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    pub key: StepKey,
    pub tokens: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct CoordConfig {
    pub world: usize,
    /// Most rows of one rank's offer (its home slice).
    pub stride: usize,
    /// Steps in flight at most (the ring's cells).
    pub depth: usize,
}

struct Pending {
    offer: Offer,
    /// Arrival order: the oldest head picks the next step's key.
    seq: u64,
    /// The leader's own offers carry their requests.
    own: Option<Step>,
}

/// The offers of every rank, in arrival order per rank.
struct Heads {
    ranks: Vec<VecDeque<Pending>>,
    seq: u64,
}

impl Heads {
    fn push(&mut self, rank: usize, offer: Offer, own: Option<Step>) {
        self.seq += 1;
        self.ranks[rank].push_back(Pending {
            offer,
            seq: self.seq,
            own,
        });
    }

    /// The next step's key and whether it is full (every head that joins it is a whole slice).
    fn next(&self, stride: usize) -> Option<(StepKey, bool)> {
        let oldest = self
            .ranks
            .iter()
            .filter_map(VecDeque::front)
            .min_by_key(|p| p.seq)?;
        let key = oldest.offer.key;
        let full = self
            .ranks
            .iter()
            .filter_map(VecDeque::front)
            .filter(|p| p.offer.key == key)
            .all(|p| p.offer.tokens >= stride);
        Some((key, full))
    }

    /// Takes every head of `key` into one step; returns it and whether the leader's own offer
    /// was in it.
    fn take(&mut self, key: StepKey) -> (Step, bool) {
        let mut homes = vec![0u32; self.ranks.len()];
        let mut segments = Vec::new();
        let mut own_taken = false;
        for (rank, q) in self.ranks.iter_mut().enumerate() {
            if q.front().is_some_and(|p| p.offer.key == key) {
                let p = q.pop_front().expect("a head");
                homes[rank] = p.offer.tokens as u32;
                if let Some(s) = p.own {
                    segments = s.segments;
                    own_taken = true;
                }
            }
        }
        (Step::of(key, segments, homes), own_taken)
    }

    fn is_empty(&self) -> bool {
        self.ranks.iter().all(VecDeque::is_empty)
    }
}

/// Runs until `stop` (the group has drained) or until the executor goes away or the group
/// breaks; the leader's own offers still waiting then fail UNAVAILABLE (the ranks fail theirs
/// when told the group stopped). `own` is the leader's batcher; `own_permits` its pipeline,
/// whose permit comes back when a step takes its offer. `peers` brings the other ranks' offers;
/// `in_flight` holds one permit per ring cell, as for the leader's batcher.
#[allow(clippy::too_many_arguments)]
pub async fn run_coordinator(
    cfg: CoordConfig,
    mut own: mpsc::Receiver<Step>,
    own_permits: Arc<Semaphore>,
    mut peers: mpsc::UnboundedReceiver<(usize, Offer)>,
    steps: mpsc::Sender<Step>,
    in_flight: Arc<Semaphore>,
    stop: CancellationToken,
    broken: Arc<Abort>,
) {
    let mut heads = Heads {
        ranks: (0..cfg.world).map(|_| VecDeque::new()).collect(),
        seq: 0,
    };
    let mut own_open = true;
    loop {
        let next = heads.next(cfg.stride);
        let need = match next {
            Some((_, true)) => 1,
            _ => cfg.depth,
        };
        // Offers that have arrived are taken before a step is formed, so it holds them all.
        tokio::select! {
            biased;
            step = own.recv(), if own_open => match step {
                Some(step) => {
                    let offer = Offer { key: step.key(), tokens: step.tokens() };
                    heads.push(0, offer, Some(step));
                }
                None => own_open = false,
            },
            Some((rank, offer)) = peers.recv() => heads.push(rank, offer, None),
            permit = ready_for_step(&in_flight, need, &steps, metric_names::STEPS_IN_FLIGHT), if next.is_some() => match permit {
                Some(permit) => {
                    let (step, own_taken) = heads.take(next.expect("a key").0);
                    if own_taken {
                        own_permits.add_permits(1);
                        metrics::gauge!(metric_names::OFFERS_PENDING).decrement(1.0);
                    }
                    permit.send(step);
                }
                None => break,
            },
            _ = stop.cancelled() => break,
            _ = broken.broken() => break,
        }
    }
    if heads.is_empty() {
        return;
    }
    let why = broken
        .reason()
        .unwrap_or_else(|| "the step executor stopped".into());
    let status = Failure::unavailable("broken", format!("EP group broken: {why}"));
    for q in heads.ranks {
        for p in q {
            if let Some(s) = p.own {
                s.fail(&status);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    fn key(layer: u32) -> StepKey {
        StepKey {
            layer,
            client_routing: false,
            input: Dtype::Bf16,
            output: Dtype::Bf16,
        }
    }

    fn offer(layer: u32, tokens: usize) -> Offer {
        Offer {
            key: key(layer),
            tokens,
        }
    }

    struct Run {
        peers: mpsc::UnboundedSender<(usize, Offer)>,
        steps: mpsc::Receiver<Step>,
        in_flight: Arc<Semaphore>,
        stop: CancellationToken,
        _own: mpsc::Sender<Step>,
    }

    fn start(world: usize, stride: usize, depth: usize) -> Run {
        let (own_tx, own_rx) = mpsc::channel(4);
        let (peers_tx, peers_rx) = mpsc::unbounded_channel();
        let (steps_tx, steps_rx) = mpsc::channel(1);
        let in_flight = Arc::new(Semaphore::new(depth));
        let stop = CancellationToken::new();
        tokio::spawn(run_coordinator(
            CoordConfig {
                world,
                stride,
                depth,
            },
            own_rx,
            Arc::new(Semaphore::new(depth)),
            peers_rx,
            steps_tx,
            in_flight.clone(),
            stop.clone(),
            Arc::new(Abort::default()),
        ));
        Run {
            peers: peers_tx,
            steps: steps_rx,
            in_flight,
            stop,
            _own: own_tx,
        }
    }

    /// Hands a step's cell back, as the executor does once it is delivered.
    fn delivered(r: &Run) {
        r.in_flight.add_permits(1);
    }

    #[tokio::test(start_paused = true)]
    async fn ranks_with_the_same_key_share_a_step_and_others_join_with_zero() {
        let mut r = start(4, 8, 2);
        r.peers.send((1, offer(0, 8))).unwrap();
        r.peers.send((3, offer(0, 5))).unwrap();
        r.peers.send((2, offer(1, 8))).unwrap();
        tokio::task::yield_now().await;
        let s = r.steps.recv().await.unwrap();
        assert_eq!((s.layer, s.homes.clone()), (0, vec![0, 8, 0, 5]));
        assert_eq!(s.group_tokens(), 13);
        delivered(&r);
        let s = r.steps.recv().await.unwrap();
        assert_eq!((s.layer, s.homes.clone()), (1, vec![0, 0, 8, 0]));
        r.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_at_one_rank_does_not_starve_a_trickle_at_another() {
        // Rank 1 always has a full offer of layer 0 waiting; rank 2 offers one of layer 1.
        let mut r = start(3, 4, 2);
        for _ in 0..3 {
            r.peers.send((1, offer(0, 4))).unwrap();
        }
        tokio::task::yield_now().await;
        r.peers.send((2, offer(1, 1))).unwrap();
        let mut layers = Vec::new();
        for _ in 0..4 {
            let s = r.steps.recv().await.unwrap();
            layers.push(s.layer);
            r.peers.send((1, offer(0, 4))).unwrap();
            delivered(&r);
        }
        let trickle = layers.iter().position(|&l| l == 1);
        assert!(
            trickle.is_some_and(|i| i <= 3),
            "the trickle waited behind {layers:?}"
        );
        r.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_partial_step_waits_for_an_empty_pipeline_a_full_one_does_not() {
        let mut r = start(2, 4, 2);
        r.peers.send((1, offer(0, 4))).unwrap();
        let first = r.steps.recv().await.unwrap();
        assert_eq!(first.homes, vec![0, 4]);
        // One step in flight: a full offer goes at once, a partial one waits.
        r.peers.send((1, offer(0, 4))).unwrap();
        let second = r.steps.recv().await.unwrap();
        assert_eq!(second.homes, vec![0, 4]);
        delivered(&r);
        r.peers.send((0, offer(0, 1))).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        assert!(
            r.steps.try_recv().is_err(),
            "a partial step behind a running one"
        );
        delivered(&r);
        let third = r.steps.recv().await.unwrap();
        assert_eq!(third.homes, vec![1, 0]);
        r.stop.cancel();
    }
}
