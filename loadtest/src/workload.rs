//! Request payloads: random data of the target's hidden size, sizes drawn per request.

use epserve::proto::{DType, ForwardRequest, ModelInfo, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::{Dtype, Tokens};
use epserve::eplb::skew::{pull, Zipf};

/// What a client checks of an answer: dtype (epserve.v1's enum), shape, and data bytes.
pub struct Out {
    pub dtype: i32,
    pub shape: Vec<i64>,
    pub bytes: usize,
}

impl Out {
    pub fn of(t: &Tensor) -> Self {
        Self {
            dtype: t.dtype,
            shape: t.shape.clone(),
            bytes: t.data.len(),
        }
    }
}

/// What the target serves, as far as the load needs to know.
#[derive(Clone, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub layer: u32,
    pub top_k: usize,
    pub experts: usize,
}

impl Shape {
    pub fn from_info(info: &ModelInfo, layer: Option<u32>) -> Result<Self, String> {
        let layer = layer
            .or(info.moe_layers.first().copied())
            .ok_or("the target lists no MoE layers")?;
        if !info.moe_layers.contains(&layer) {
            return Err(format!(
                "layer {layer} is not among the target's MoE layers {:?}",
                info.moe_layers
            ));
        }
        Ok(Self {
            hidden: info.hidden_size as usize,
            layer,
            top_k: info.top_k as usize,
            experts: info.num_experts as usize,
        })
    }
}

/// `--skew`: who draws the experts, and the router row of each (None: client routing only).
pub struct Skewed {
    pub zipf: Zipf,
    /// `[experts, hidden]`: the target's router of the loaded layer.
    pub router: Option<Vec<f32>>,
}

impl Skewed {
    /// `--skew s`, with the router of `shape.layer` read from `model` where one is given.
    pub fn load(s: f64, model: Option<&str>, seed: u64, shape: &Shape) -> anyhow::Result<Self> {
        let router = match model {
            None => None,
            Some(m) => {
                let source = epserve::model::ModelSource::parse(m, seed)?;
                let mut spec = source.spec()?;
                if !spec.moe_layers.contains(&shape.layer) {
                    anyhow::bail!("--skew-model {m} has no MoE layer {}", shape.layer);
                }
                if (spec.hidden, spec.num_experts) != (shape.hidden, shape.experts) {
                    anyhow::bail!(
                        "--skew-model {m} is {} x {} experts, the target serves {} x {}",
                        spec.hidden,
                        spec.num_experts,
                        shape.hidden,
                        shape.experts
                    );
                }
                spec.moe_layers = vec![shape.layer];
                let dtype = epserve::model::ExpertDtype::Bf16;
                let w = source.load(&spec, &[Vec::new()], dtype, &mut |_| {})?;
                w.layers.into_iter().next().map(|l| l.router)
            }
        };
        Ok(Self {
            zipf: Zipf::new(shape.experts, s),
            router,
        })
    }
}

pub struct Workload {
    shape: Shape,
    tokens: Tokens,
    dtype: Dtype,
    client_routing: bool,
    skew: Option<Skewed>,
    rng: StdRng,
    /// Random values, already encoded; requests copy a window of it.
    /// Pre-built payload bytes; each request shares a slice of them instead of copying.
    pool: tonic::codegen::Bytes,
}

/// A request and the sizes the report counts.
pub struct Item {
    pub request: ForwardRequest,
    pub tokens: usize,
    pub bytes_out: usize,
}

const POOL_TOKENS: usize = 4096;

impl Workload {
    pub fn new(
        shape: Shape,
        tokens: Tokens,
        dtype: Dtype,
        client_routing: bool,
        skew: Option<Skewed>,
        seed: u64,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let h = shape.hidden;
        let mut values: Vec<f32> = (0..POOL_TOKENS * h)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        // --skew: each token pulled towards top-k experts drawn by popularity, through the
        // target's gate.
        if let Some(Skewed {
            zipf,
            router: Some(router),
        }) = &skew
        {
            for x in values.chunks_exact_mut(h) {
                for g in zipf.distinct(shape.top_k, || rng.random()) {
                    pull(x, &router[g * h..(g + 1) * h]);
                }
            }
        }
        let pool: Vec<u8> = match dtype {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::Bf16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        };
        Self {
            shape,
            tokens,
            dtype,
            client_routing,
            skew,
            rng,
            pool: pool.into(),
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The most tokens one request may have.
    pub fn max_tokens(&self) -> usize {
        match self.tokens {
            Tokens::Fixed(n) => n.clamp(1, POOL_TOKENS),
            Tokens::Uniform(_, b) => b.clamp(1, POOL_TOKENS),
            Tokens::Exp(_) => POOL_TOKENS,
        }
    }

    fn draw_tokens(&mut self) -> usize {
        let n = match self.tokens {
            Tokens::Fixed(n) => n,
            Tokens::Uniform(a, b) => self.rng.random_range(a..=b),
            Tokens::Exp(mean) => (-(1.0 - self.rng.random::<f64>()).ln() * mean).round() as usize,
        };
        n.clamp(1, POOL_TOKENS)
    }

    pub fn next(&mut self, id: String) -> Item {
        let (h, n) = (self.shape.hidden, self.draw_tokens());
        let row = h * self.dtype.bytes();
        let start = self.rng.random_range(0..=POOL_TOKENS - n) * row;
        let dtype = match self.dtype {
            Dtype::Bf16 => DType::Bf16,
            Dtype::F32 => DType::F32,
        };
        let hidden = Tensor {
            dtype: dtype as i32,
            shape: vec![n as i64, h as i64],
            data: self.pool.slice(start..start + n * row),
        };
        let mut request = ForwardRequest {
            id,
            layer: self.shape.layer,
            hidden_states: Some(hidden),
            topk_ids: None,
            topk_weights: None,
            output_dtype: dtype as i32,
        };
        let mut bytes_out = n * row;
        if self.client_routing {
            let k = self.shape.top_k;
            let mut ids = Vec::with_capacity(n * k);
            for _ in 0..n {
                match &self.skew {
                    Some(s) => {
                        let rng = &mut self.rng;
                        let row = s.zipf.distinct(k, || rng.random());
                        ids.extend(row.into_iter().map(|e| e as i32));
                    }
                    None => {
                        let row = rand::seq::index::sample(&mut self.rng, self.shape.experts, k);
                        ids.extend(row.into_iter().map(|e| e as i32));
                    }
                }
            }
            let w: Vec<f32> = (0..n * k)
                .map(|_| self.rng.random_range(0.05f32..1.0))
                .collect();
            let shape = vec![n as i64, k as i64];
            request.topk_ids = Some(Tensor {
                dtype: DType::I32 as i32,
                shape: shape.clone(),
                data: ids
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>()
                    .into(),
            });
            request.topk_weights = Some(Tensor {
                dtype: DType::F32 as i32,
                shape,
                data: w
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>()
                    .into(),
            });
            bytes_out += n * k * 8;
        }
        Item {
            request,
            tokens: n,
            bytes_out,
        }
    }

    /// Checks a response's output against what was asked for; returns its bytes.
    pub fn check(&self, tokens: usize, out: &Out) -> Result<usize, String> {
        let want = match self.dtype {
            Dtype::Bf16 => DType::Bf16,
            Dtype::F32 => DType::F32,
        } as i32;
        let shape = vec![tokens as i64, self.shape.hidden as i64];
        if out.dtype != want
            || out.shape != shape
            || out.bytes != tokens * self.shape.hidden * self.dtype.bytes()
        {
            return Err(format!(
                "output {:?} {:?} ({} bytes), expected {want} {shape:?}",
                out.dtype, out.shape, out.bytes
            ));
        }
        Ok(out.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_the_asked_shape_and_bad_answers_are_caught() {
        let shape = Shape {
            hidden: 8,
            layer: 3,
            top_k: 2,
            experts: 4,
        };
        let mut w = Workload::new(shape, Tokens::Uniform(2, 5), Dtype::Bf16, true, None, 1);
        for i in 0..50 {
            let item = w.next(i.to_string());
            let h = item.request.hidden_states.as_ref().unwrap();
            assert_eq!(h.shape, vec![item.tokens as i64, 8]);
            assert_eq!(h.data.len(), item.tokens * 8 * 2);
            assert!((2..=5).contains(&item.tokens));
            let ids = item.request.topk_ids.as_ref().unwrap();
            for row in ids.data.chunks_exact(8) {
                let (a, b) = (
                    i32::from_le_bytes(row[..4].try_into().unwrap()),
                    i32::from_le_bytes(row[4..].try_into().unwrap()),
                );
                assert!(a != b && (0..4).contains(&a) && (0..4).contains(&b));
            }
            assert!(w.check(item.tokens, &Out::of(h)).is_ok());
            let mut wrong = h.clone();
            wrong.shape[0] += 1;
            assert!(w.check(item.tokens, &Out::of(&wrong)).is_err());
            let f32_out = Tensor {
                dtype: DType::F32 as i32,
                ..h.clone()
            };
            assert!(w.check(item.tokens, &Out::of(&f32_out)).is_err());
            let mut short = h.clone();
            short.data.truncate(short.data.len() - 1);
            assert!(w.check(item.tokens, &Out::of(&short)).is_err());
        }
    }

    #[test]
    fn token_distributions_parse() {
        assert_eq!("7".parse::<Tokens>(), Ok(Tokens::Fixed(7)));
        assert_eq!("uniform:2-9".parse::<Tokens>(), Ok(Tokens::Uniform(2, 9)));
        assert_eq!("exp:12.5".parse::<Tokens>(), Ok(Tokens::Exp(12.5)));
        for bad in ["0", "uniform:5-2", "exp:0.5", "x"] {
            assert!(bad.parse::<Tokens>().is_err(), "{bad}");
        }
    }
}
