//! An independent f64 reference of one MoE layer (router, top-k routing, SwiGLU experts, shared
//! expert, weighted sum), written from the Hugging Face definitions, not from the server's code;
//! with FP8 experts, DeepSeek-V3's recipe (its reference inference code): weights in 128x128
//! blocks scaled by amax / 448, activations quantized per token per 128 channels before each
//! expert GEMM, then f64 math on the quantized values; activations bf16 where DeepSeek-V3's
//! inference holds them so (an expert's input, the gate/up outputs).

use epserve::model::{LayerWeights, Matrix, MoeSpec, Routing};

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
    /// FP8 experts: the weights above are already the dequantized FP8 values, and every expert
    /// quantizes its activations.
    pub fp8: bool,
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn values(m: &Matrix) -> &[f32] {
    match m {
        Matrix::F32(v) => v,
        Matrix::Fp8(_) => panic!("the reference takes weights as values"),
    }
}

impl RefLayer {
    /// From full weights (all experts), as held in memory by the test.
    pub fn from_weights(w: &LayerWeights, hidden: usize) -> Self {
        let ffn = |f: &epserve::model::Ffn| {
            let n = f.inter * hidden;
            let gate_up = values(&f.gate_up);
            RefFfn {
                gate: f64s(&gate_up[..n]),
                up: f64s(&gate_up[n..]),
                down: f64s(values(&f.down)),
                inter: f.inter,
            }
        };
        Self {
            router: f64s(&w.router),
            bias: w.bias.as_deref().map(f64s),
            experts: w.experts.iter().map(ffn).collect(),
            shared: w.shared.as_ref().map(ffn),
            fp8: false,
        }
    }

    /// The same weights with FP8 experts: every expert matrix quantized in 128x128 blocks.
    pub fn from_weights_fp8(w: &LayerWeights, hidden: usize) -> Self {
        let mut r = Self::from_weights(w, hidden);
        r.quantize_experts(hidden);
        r
    }

    /// Quantizes every expert matrix held as values (FP8 experts of a checkpoint that ships
    /// other dtypes, or of a synthetic model).
    pub fn quantize_experts(&mut self, hidden: usize) {
        for f in self.experts.iter_mut().chain(self.shared.as_mut()) {
            f.quantize(hidden);
        }
        self.fp8 = true;
    }
}

impl RefFfn {
    /// Each matrix quantized in 128x128 blocks (as values).
    pub fn quantize(&mut self, hidden: usize) {
        self.gate = fp8::quantize_blocks(&self.gate, self.inter, hidden);
        self.up = fp8::quantize_blocks(&self.up, self.inter, hidden);
        self.down = fp8::quantize_blocks(&self.down, hidden, self.inter);
    }
}

/// DeepSeek-V3's FP8 recipe, written from its definition: OCP E4M3FN from its fields, round to
/// nearest with ties to the even code, scales amax / 448 in f32.
pub mod fp8 {
    pub const BLOCK: usize = 128;

    /// The value of code `c` (0..=0x7E, positive), from its fields: 4 exponent bits (bias 7),
    /// 3 mantissa bits, subnormals below exponent 1.
    fn value(c: u8) -> f64 {
        let (e, m) = (i32::from(c >> 3), f64::from(c & 7));
        if e == 0 {
            m / 8.0 * 2f64.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    /// `x` (in f32, |x| <= 448) rounded to E4M3, as a value.
    pub fn round(x: f32) -> f64 {
        let a = f64::from(x.abs());
        // Codes 0..=0x7E increase in value: the two around `a`, then the nearer, ties to even.
        let (mut lo, mut hi) = (0u8, 0x7Eu8);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if value(mid) <= a {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let (dl, dh) = (a - value(lo), value(hi) - a);
        let c = if dl < dh || (dl == dh && lo % 2 == 0) {
            lo
        } else {
            hi
        };
        value(c).copysign(f64::from(x))
    }

    /// A group's scale: amax / 448 in f32; 0 (all values to 0) when that is not a normal f32.
    fn scale(group: impl Iterator<Item = f32>) -> f32 {
        let s = group.fold(0f32, |m, v| m.max(v.abs())) / 448.0;
        if s.is_normal() {
            s
        } else {
            0.0
        }
    }

    /// One activation row quantized per 128 channels, as values.
    pub fn quantize_row(x: &[f32]) -> Vec<f64> {
        x.chunks(BLOCK)
            .flat_map(|g| {
                let s = scale(g.iter().copied());
                g.iter().map(move |&v| {
                    if s == 0.0 {
                        0.0
                    } else {
                        round(v / s) * f64::from(s)
                    }
                })
            })
            .collect()
    }

    /// A `[rows, cols]` weight (values exactly representable in f32) quantized in 128x128
    /// blocks, as values.
    pub fn quantize_blocks(w: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        assert!(rows % BLOCK == 0 && cols % BLOCK == 0);
        let mut out = vec![0.0; rows * cols];
        for br in 0..rows / BLOCK {
            for bc in 0..cols / BLOCK {
                let at = |i: usize| (br * BLOCK + i / BLOCK) * cols + bc * BLOCK + i % BLOCK;
                let s = scale((0..BLOCK * BLOCK).map(|i| w[at(i)] as f32));
                for i in 0..BLOCK * BLOCK {
                    out[at(i)] = if s == 0.0 {
                        0.0
                    } else {
                        round(w[at(i)] as f32 / s) * f64::from(s)
                    };
                }
            }
        }
        out
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// A value rounded to f32, then to bf16 (nearest even), as a GPU's f32 accumulator is stored.
fn bf16(v: f64) -> f64 {
    half::bf16::from_f32(v as f32).to_f64()
}

/// One expert; with `fp8`, its input (in bf16) and its SwiGLU output (of gate/up in bf16, as
/// f32) quantized per 128 channels.
fn ffn(f: &RefFfn, x: &[f64], fp8: bool) -> Vec<f64> {
    let h = x.len();
    let q;
    let x = if fp8 {
        q = fp8::quantize_row(&x.iter().map(|&v| bf16(v) as f32).collect::<Vec<_>>());
        &q
    } else {
        x
    };
    let mut act: Vec<f64> = (0..f.inter)
        .map(|i| {
            let g = dot(&f.gate[i * h..(i + 1) * h], x);
            let u = dot(&f.up[i * h..(i + 1) * h], x);
            let (g, u) = if fp8 { (bf16(g), bf16(u)) } else { (g, u) };
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    if fp8 {
        act = fp8::quantize_row(&act.iter().map(|&v| v as f32).collect::<Vec<_>>());
    }
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
        for (o, y) in out.iter_mut().zip(ffn(&layer.experts[e], x, layer.fp8)) {
            *o += wt * y;
        }
    }
    if let Some(sh) = &layer.shared {
        for (o, y) in out.iter_mut().zip(ffn(sh, x, layer.fp8)) {
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

/// Per token: max |out - ref| / max |ref| over the token's row, the largest over the tokens that
/// are not near-ties, with the token it was found at; returns (error, token, excluded rows).
pub fn compare_tokens(
    spec: &MoeSpec,
    layer: &RefLayer,
    x: &[f64],
    out: &[f32],
    routing: Option<(&[usize], &[f64])>,
) -> (f64, usize, usize) {
    let (h, k) = (spec.hidden, spec.top_k);
    let (mut worst, mut at, mut excluded) = (0.0f64, 0, 0);
    for t in 0..x.len() / h {
        let r = routing.map(|(ids, w)| (&ids[t * k..(t + 1) * k], &w[t * k..(t + 1) * k]));
        let (want, margin) = token(spec, layer, &x[t * h..(t + 1) * h], r);
        if margin < TIE_MARGIN {
            excluded += 1;
            continue;
        }
        let (mut err, mut top) = (0.0f64, 0.0f64);
        for (o, w) in out[t * h..(t + 1) * h].iter().zip(&want) {
            err = err.max((f64::from(*o) - w).abs());
            top = top.max(w.abs());
        }
        let e = if top > 0.0 { err / top } else { err };
        if e > worst {
            (worst, at) = (e, t);
        }
    }
    (worst, at, excluded)
}
