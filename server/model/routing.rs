//! Top-k routing on one row of router logits, with Hugging Face semantics.

use super::spec::Routing;

/// Indices of the `k` largest values, largest first; ties go to the lower index (as torch.topk on
/// CPU does for distinct values; exact ties do not occur on real data).
fn top_k_indices(values: &[f32], k: usize, out: &mut Vec<usize>) {
    out.clear();
    out.extend(0..values.len());
    out.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    out.truncate(k);
}

/// Scratch reused across rows so routing allocates nothing per token.
#[derive(Default)]
pub struct Router {
    scores: Vec<f32>,
    choice: Vec<f32>,
    order: Vec<usize>,
    groups: Vec<f32>,
    keep: Vec<bool>,
}

impl Router {
    /// Routes one token: `logits` `[E]` → `ids`/`weights` `[k]`.
    pub fn route(
        &mut self,
        routing: &Routing,
        logits: &[f32],
        bias: Option<&[f32]>,
        ids: &mut [i32],
        weights: &mut [f32],
    ) {
        let k = ids.len();
        match *routing {
            Routing::SoftmaxTopK { renormalize } => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                self.scores.clear();
                self.scores.extend(logits.iter().map(|&l| (l - max).exp()));
                let sum: f32 = self.scores.iter().sum();
                self.scores.iter_mut().for_each(|s| *s /= sum);
                top_k_indices(&self.scores, k, &mut self.order);
                for (j, &e) in self.order.iter().enumerate() {
                    ids[j] = e as i32;
                    weights[j] = self.scores[e];
                }
                if renormalize {
                    let s: f32 = weights.iter().sum();
                    weights.iter_mut().for_each(|w| *w /= s);
                }
            }
            Routing::SigmoidGroupTopK {
                n_group,
                topk_group,
                renormalize,
                scaling,
            } => {
                let e = logits.len();
                let per_group = e / n_group;
                self.scores.clear();
                self.scores
                    .extend(logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())));
                self.choice.clear();
                self.choice.extend(
                    self.scores
                        .iter()
                        .enumerate()
                        .map(|(i, &s)| s + bias.map_or(0.0, |b| b[i])),
                );
                // Group score: the sum of the group's two best choice scores.
                self.groups.clear();
                for g in self.choice.chunks(per_group) {
                    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                    for &v in g {
                        if v > a {
                            b = a;
                            a = v;
                        } else if v > b {
                            b = v;
                        }
                    }
                    self.groups.push(a + b);
                }
                top_k_indices(&self.groups, topk_group, &mut self.order);
                // Experts outside the chosen groups score 0.0, as in Hugging Face's masked_fill.
                self.keep.clear();
                self.keep.resize(n_group, false);
                self.order.iter().for_each(|&g| self.keep[g] = true);
                for (i, c) in self.choice.iter_mut().enumerate() {
                    if !self.keep[i / per_group] {
                        *c = 0.0;
                    }
                }
                top_k_indices(&self.choice, k, &mut self.order);
                for (j, &x) in self.order.iter().enumerate() {
                    ids[j] = x as i32;
                    weights[j] = self.scores[x];
                }
                if renormalize {
                    let s: f32 = weights.iter().sum::<f32>() + 1e-20;
                    weights.iter_mut().for_each(|w| *w /= s);
                }
                weights.iter_mut().for_each(|w| *w *= scaling);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_topk_renormalised() {
        let mut r = Router::default();
        let logits = [0.1f32, 2.0, -1.0, 1.5];
        let (mut ids, mut w) = ([0i32; 2], [0f32; 2]);
        r.route(
            &Routing::SoftmaxTopK { renormalize: true },
            &logits,
            None,
            &mut ids,
            &mut w,
        );
        assert_eq!(ids, [1, 3]);
        let e = (0.5f32).exp();
        assert!((w[0] - e / (1.0 + e)).abs() < 1e-6, "{w:?}");
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn group_limited_picks_only_from_best_groups() {
        let mut r = Router::default();
        // Groups of 2: g0 = {0,1}, g1 = {2,3}, g2 = {4,5}. Expert 5 is the single best, but g2's
        // pair sum is the worst, so only g0 and g1 are eligible with topk_group = 2.
        let logits = [1.0f32, 1.0, 0.5, 0.5, 3.0, -3.0];
        let (mut ids, mut w) = ([0i32; 2], [0f32; 2]);
        let routing = Routing::SigmoidGroupTopK {
            n_group: 3,
            topk_group: 2,
            renormalize: false,
            scaling: 2.0,
        };
        r.route(&routing, &logits, None, &mut ids, &mut w);
        assert_eq!(ids, [0, 1]);
        let s = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((w[0] - 2.0 * s).abs() < 1e-6);
    }
}
