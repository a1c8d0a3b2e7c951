//! Skewed load you can reproduce (`epserve-loadtest --skew S`): expert popularity follows a Zipf
//! law of exponent `S` (0: uniform), the most popular first, so under contiguous placement the
//! hot experts sit in the first rank's block. Hidden states are pulled towards the router rows
//! of a token's drawn experts, so the model's own gate routes them there.

/// Expert popularity `p(i) ~ 1 / (i + 1)^s`, drawn by inverse CDF.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(experts: usize, s: f64) -> Self {
        let w: Vec<f64> = (0..experts).map(|i| ((i + 1) as f64).powf(-s)).collect();
        let total: f64 = w.iter().sum();
        let mut acc = 0.0;
        let cdf = w
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        Self { cdf }
    }

    /// The expert for `u` in [0, 1).
    pub fn expert(&self, u: f64) -> usize {
        let i = self.cdf.partition_point(|&c| c <= u);
        i.min(self.cdf.len() - 1)
    }

    /// `k` distinct experts from successive draws of `next` (each in [0, 1)), as a client that
    /// routes its own tokens would pick them.
    pub fn distinct(&self, k: usize, mut next: impl FnMut() -> f64) -> Vec<usize> {
        let k = k.min(self.cdf.len());
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let g = self.expert(next());
            if !out.contains(&g) {
                out.push(g);
            }
        }
        out
    }
}

/// Moves `x` towards `row` (an expert's router row): adds 4 of its unit vector per unit of
/// `x`'s typical value, so that expert's logit stands about 7 noise deviations above the rest
/// for uniform `x` in [-1, 1) (the logit's noise is `|row| / sqrt(3)`).
pub fn pull(x: &mut [f32], row: &[f32]) {
    let norm = row
        .iter()
        .map(|&r| f64::from(r) * f64::from(r))
        .sum::<f64>()
        .sqrt();
    if norm == 0.0 {
        return;
    }
    let scale = (4.0 / norm) as f32;
    x.iter_mut().zip(row).for_each(|(v, &r)| *v += scale * r);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_zero_is_uniform_and_larger_exponents_favour_the_first_experts() {
        let draws = |s: f64| {
            let z = Zipf::new(8, s);
            let mut n = [0usize; 8];
            for i in 0..8000 {
                n[z.expert((i as f64 + 0.5) / 8000.0)] += 1;
            }
            n
        };
        assert_eq!(draws(0.0), [1000; 8]);
        let skewed = draws(1.2);
        assert!(skewed.windows(2).all(|w| w[0] >= w[1]), "{skewed:?}");
        assert!(skewed[0] > 3 * skewed[7], "{skewed:?}");
        let mut u = [0.0, 0.0, 0.99, 0.5].into_iter().cycle();
        assert_eq!(
            Zipf::new(8, 0.0).distinct(3, || u.next().unwrap()),
            vec![0, 7, 4]
        );
    }

    #[test]
    fn a_pull_raises_that_experts_logit_above_the_noise() {
        let row: Vec<f32> = (0..64)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 10.0)
            .collect();
        let mut x = vec![0.0f32; 64];
        pull(&mut x, &row);
        let norm: f32 = row.iter().map(|r| r * r).sum::<f32>().sqrt();
        let logit: f32 = x.iter().zip(&row).map(|(a, b)| a * b).sum();
        assert!((logit - 4.0 * norm).abs() < 1e-4, "{logit}");
    }
}
