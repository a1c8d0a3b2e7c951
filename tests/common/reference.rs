//! An independent f64 reference of one MoE layer (router, top-k routing, SwiGLU experts, shared
//! expert, weighted sum), written from the Hugging Face definitions, not from the server's code.

use epserve::model::{LayerWeights, MoeSpec, Routing};

pub struct RefFfn {
    pub gate: Vec<f64>,
    pub up: Vec<f64>,
    pub down: Vec<f64>,
    pub inter: usize,
}

pub struct RefLayer {
    pub router: Vec<f64>,
    pub bias: Option<Vec<f64>>,
    pub experts: Vec<RefFfn>,
    pub shared: Option<RefFfn>,
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

impl RefLayer {
    /// From full weights (all experts), as held in memory by the test.
    pub fn from_weights(w: &LayerWeights, hidden: usize) -> Self {
        let ffn = |f: &epserve::model::Ffn| {
            let n = f.inter * hidden;
            RefFfn {
                gate: f64s(&f.gate_up[..n]),
                up: f64s(&f.gate_up[n..]),
                down: f64s(&f.down),
                inter: f.inter,
            }
        };
        Self {
            router: f64s(&w.router),
            bias: w.bias.as_deref().map(f64s),
            experts: w.experts.iter().map(ffn).collect(),
            shared: w.shared.as_ref().map(ffn),
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn ffn(f: &RefFfn, x: &[f64]) -> Vec<f64> {
    let h = x.len();
    let act: Vec<f64> = (0..f.inter)
        .map(|i| {
            let g = dot(&f.gate[i * h..(i + 1) * h], x);
            let u = dot(&f.up[i * h..(i + 1) * h], x);
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    (0..h)
        .map(|o| dot(&f.down[o * f.inter..(o + 1) * f.inter], &act))
        .collect()
}

/// Descending order of `v`; returns the chosen `k` and the gap between the k-th and the next.
fn top(v: &[f64], k: usize) -> (Vec<usize>, f64) {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap());
    let gap = if k < v.len() {
        v[idx[k - 1]] - v[idx[k]]
    } else {
        f64::INFINITY
    };
    (idx[..k].to_vec(), gap)
}

/// (ids, weights, margin): margin is the smallest gap at any selection boundary; a tiny margin
/// means f32 rounding may legitimately choose differently.
pub fn route(spec: &MoeSpec, layer: &RefLayer, x: &[f64]) -> (Vec<usize>, Vec<f64>, f64) {
    let h = spec.hidden;
    let logits: Vec<f64> = (0..spec.num_experts)
        .map(|e| dot(&layer.router[e * h..(e + 1) * h], x))
        .collect();
    match spec.routing {
        Routing::SoftmaxTopK { renormalize } => {
            let m = logits.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
            let p: Vec<f64> = logits.iter().map(|l| (l - m).exp() / z).collect();
            let (ids, gap) = top(&p, spec.top_k);
            let mut w: Vec<f64> = ids.iter().map(|&i| p[i]).collect();
            if renormalize {
                let s: f64 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= s);
            }
            (ids, w, gap)
        }
        Routing::SigmoidGroupTopK {
            n_group,
            topk_group,
            renormalize,
            scaling,
        } => {
            let s: Vec<f64> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
            let c: Vec<f64> = s
                .iter()
                .enumerate()
                .map(|(i, v)| v + layer.bias.as_ref().map_or(0.0, |b| b[i]))
                .collect();
            let per = spec.num_experts / n_group;
            let gscore: Vec<f64> = c
                .chunks(per)
                .map(|g| {
                    let (two, _) = top(g, 2);
                    g[two[0]] + g[two[1]]
                })
                .collect();
            let (groups, ggap) = top(&gscore, topk_group);
            let masked: Vec<f64> = c
                .iter()
                .enumerate()
                .map(|(i, &v)| if groups.contains(&(i / per)) { v } else { 0.0 })
                .collect();
            let (ids, gap) = top(&masked, spec.top_k);
            let mut w: Vec<f64> = ids.iter().map(|&i| s[i]).collect();
            if renormalize {
                let t: f64 = w.iter().sum::<f64>() + 1e-20;
                w.iter_mut().for_each(|x| *x /= t);
            }
            w.iter_mut().for_each(|x| *x *= f64::from(scaling));
            (ids, w, gap.min(ggap))
        }
    }
}

/// One token's output; `routing` overrides gating (client routing).
pub fn token(
    spec: &MoeSpec,
    layer: &RefLayer,
    x: &[f64],
    routing: Option<(&[usize], &[f64])>,
) -> (Vec<f64>, f64) {
    let (ids, w, margin) = match routing {
        Some((ids, w)) => (ids.to_vec(), w.to_vec(), f64::INFINITY),
        None => route(spec, layer, x),
    };
    let mut out = vec![0.0; x.len()];
    for (&e, &wt) in ids.iter().zip(&w) {
        for (o, y) in out.iter_mut().zip(ffn(&layer.experts[e], x)) {
            *o += wt * y;
        }
    }
    if let Some(sh) = &layer.shared {
        for (o, y) in out.iter_mut().zip(ffn(sh, x)) {
            *o += y;
        }
    }
    (out, margin)
}

/// Rows whose routing margin is below this are near-ties: excluded from the comparison (and
/// counted, so a test can bound how many).
pub const TIE_MARGIN: f64 = 1e-5;

/// Max |out - ref| / max |ref| over the rows that are not near-ties; returns (error, excluded rows).
pub fn compare(
    spec: &MoeSpec,
    layer: &RefLayer,
    x: &[f64],
    out: &[f32],
    routing: Option<(&[usize], &[f64])>,
) -> (f64, usize) {
    let h = spec.hidden;
    let n = x.len() / h;
    let (mut max_err, mut max_ref, mut excluded) = (0.0f64, 0.0f64, 0);
    for t in 0..n {
        let r = routing.map(|(ids, w)| {
            (
                &ids[t * spec.top_k..(t + 1) * spec.top_k],
                &w[t * spec.top_k..(t + 1) * spec.top_k],
            )
        });
        let (want, margin) = token(spec, layer, &x[t * h..(t + 1) * h], r);
        if margin < TIE_MARGIN {
            excluded += 1;
            continue;
        }
        for (o, w) in out[t * h..(t + 1) * h].iter().zip(&want) {
            max_err = max_err.max((f64::from(*o) - w).abs());
            max_ref = max_ref.max(w.abs());
        }
    }
    (
        if max_ref > 0.0 {
            max_err / max_ref
        } else {
            max_err
        },
        excluded,
    )
}
