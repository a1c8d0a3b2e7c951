//! The models KServe clients see: per MoE layer, one per float type, each also `-gated`.
//! `layer-<L>` declares FP32 and, as it always has, takes any float type and answers in the
//! input's; `layer-<L>-bf16` and `layer-<L>-fp16` declare their type and take only it, so a tool
//! that reads metadata or the configuration (perf_analyzer) finds BF16 and FP16 and sends them.
//! The routing inputs are optional; a `-gated` model declares the hidden states alone (the layer
//! always gates), for tools that cannot leave an optional input out (perf_analyzer 2.41 with
//! shared memory). All of a layer's models run the same layer; each reports the statistics of the
//! requests that named it (epserve.v1 Forward's count under `layer-<L>`), so that each request
//! counts once.

use std::collections::HashMap;

use crate::infer::quote::quote;
use crate::infer::tensor::{Dtype, FLOATS};
use crate::inference::model_metadata_response::TensorMetadata;
use crate::inference::repository_index_response::ModelIndex;
use crate::inference::{
    DataType, ModelConfig, ModelInput, ModelOutput, ModelParameter, ModelTransactionPolicy,
};
use crate::model::MoeSpec;
use crate::request::Failure;

/// Every model's one version; an empty version asks for it.
pub const VERSION: &str = "1";
/// The models' platform and backend, as metadata and the configuration name them.
pub const PLATFORM: &str = "epserve";
pub const HIDDEN: &str = "hidden_states";
pub const IDS_IN: &str = "topk_ids";
pub const WEIGHTS: &str = "topk_weights";
pub const OUTPUT: &str = "output";

/// The typed models' name suffixes.
const TYPED: [(&str, Dtype); 2] = [("bf16", Dtype::Bf16), ("fp16", Dtype::F16)];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model {
    /// The model's own layer index.
    pub layer: u32,
    /// None: `layer-<L>`, any float type in.
    pub float: Option<Dtype>,
    /// No routing inputs: the layer gates.
    pub gated: bool,
}

const ALL_INPUTS: &[&str] = &[HIDDEN, IDS_IN, WEIGHTS];
const GATED_INPUTS: &[&str] = &[HIDDEN];

/// The Open Inference Protocol's datatype names.
pub fn name(d: Dtype) -> &'static str {
    match d {
        Dtype::Bf16 => "BF16",
        Dtype::F16 => "FP16",
        Dtype::F32 => "FP32",
        Dtype::I32 => "INT32",
        Dtype::I64 => "INT64",
    }
}

fn data_type(d: Dtype) -> DataType {
    match d {
        Dtype::Bf16 => DataType::TypeBf16,
        Dtype::F16 => DataType::TypeFp16,
        Dtype::F32 => DataType::TypeFp32,
        Dtype::I32 => DataType::TypeInt32,
        Dtype::I64 => DataType::TypeInt64,
    }
}

impl Model {
    /// Every model, by layer then type.
    pub fn all(spec: &MoeSpec) -> impl Iterator<Item = Model> + '_ {
        spec.moe_layers.iter().flat_map(|&layer| {
            [false, true].into_iter().flat_map(move |gated| {
                std::iter::once(None)
                    .chain(TYPED.iter().map(|t| Some(t.1)))
                    .map(move |float| Model {
                        layer,
                        float,
                        gated,
                    })
            })
        })
    }

    /// The model a request names; an unknown name or version is NOT_FOUND, with what exists.
    pub fn find(spec: &MoeSpec, model: &str, version: &str) -> Result<Model, Failure> {
        let found = Self::all(spec).find(|m| m.name() == model).ok_or_else(|| {
            let plain: Vec<String> = spec.moe_layers.iter().map(|&l| plain(l)).collect();
            Failure::NotFound(format!(
                "unknown model {} (models: {}, each also as <name>-bf16 and <name>-fp16, and \
                 each of those -gated)",
                quote(model),
                plain.join(", ")
            ))
        })?;
        if !version.is_empty() && version != VERSION {
            return Err(Failure::NotFound(format!(
                "model {} has no version {} (versions: {VERSION})",
                quote(model),
                quote(version)
            )));
        }
        Ok(found)
    }

    pub fn name(&self) -> String {
        let mut name = plain(self.layer);
        if let Some((suffix, _)) = self.float.and_then(|d| TYPED.iter().find(|t| t.1 == d)) {
            name = format!("{name}-{suffix}");
        }
        if self.gated {
            name.push_str("-gated");
        }
        name
    }

    /// The inputs it declares and takes.
    pub fn inputs(&self) -> &'static [&'static str] {
        if self.gated {
            GATED_INPUTS
        } else {
            ALL_INPUTS
        }
    }

    /// Its statistics' place: each request counts under the model it named.
    pub fn tally(&self) -> crate::infer::stats::Tally {
        crate::infer::stats::Tally {
            float: self.float,
            gated: self.gated,
        }
    }

    /// The type its hidden states and output are declared in.
    pub fn declared(&self) -> Dtype {
        self.float.unwrap_or(Dtype::F32)
    }

    /// The types its hidden states may come in.
    pub fn accepts(&self) -> &'static [Dtype] {
        match self.float {
            None => FLOATS,
            Some(Dtype::Bf16) => &[Dtype::Bf16],
            Some(_) => &[Dtype::F16],
        }
    }

    /// The output's type when the request does not name one.
    pub fn output(&self, input: Option<Dtype>) -> Dtype {
        self.float.or(input).unwrap_or(Dtype::F32)
    }

    /// ModelMetadata's inputs and outputs.
    pub fn metadata(&self, spec: &MoeSpec) -> (Vec<TensorMetadata>, Vec<TensorMetadata>) {
        let (h, k) = (spec.hidden as i64, spec.top_k as i64);
        let t = |n: &str, d: Dtype, cols: i64| TensorMetadata {
            name: n.into(),
            datatype: name(d).into(),
            shape: vec![-1, cols],
        };
        let x = self.declared();
        let mut inputs = vec![
            t(HIDDEN, x, h),
            t(IDS_IN, Dtype::I32, k),
            t(WEIGHTS, Dtype::F32, k),
        ];
        inputs.truncate(self.inputs().len());
        (inputs, vec![t(OUTPUT, x, h)])
    }

    /// Triton's model configuration: full shapes (max_batch_size 0, the service batches across
    /// requests itself), the routing inputs optional, one response per request.
    pub fn config(&self, spec: &MoeSpec) -> ModelConfig {
        let (h, k) = (spec.hidden as i64, spec.top_k as i64);
        let input = |n: &str, d: Dtype, cols: i64, optional: bool| ModelInput {
            name: n.into(),
            data_type: data_type(d).into(),
            dims: vec![-1, cols],
            optional,
        };
        let x = self.declared();
        let accepts: Vec<&str> = self.accepts().iter().map(|&d| name(d)).collect();
        let routing = if self.gated {
            "the layer's own gate"
        } else {
            "topk_ids and topk_weights together (client routing), or neither (the layer's own gate)"
        };
        let parameters = [
            ("layer", self.layer.to_string()),
            ("hidden_size", spec.hidden.to_string()),
            ("num_experts", spec.num_experts.to_string()),
            ("top_k", spec.top_k.to_string()),
            ("hidden_states_datatypes", accepts.join(",")),
            ("routing", routing.to_string()),
        ];
        let mut inputs = vec![
            input(HIDDEN, x, h, false),
            input(IDS_IN, Dtype::I32, k, true),
            input(WEIGHTS, Dtype::F32, k, true),
        ];
        inputs.truncate(self.inputs().len());
        ModelConfig {
            name: self.name(),
            platform: PLATFORM.into(),
            backend: PLATFORM.into(),
            max_batch_size: 0,
            input: inputs,
            output: vec![ModelOutput {
                name: OUTPUT.into(),
                data_type: data_type(x).into(),
                dims: vec![-1, h],
            }],
            parameters: parameters
                .into_iter()
                .map(|(k, v)| (k.to_string(), ModelParameter { string_value: v }))
                .collect::<HashMap<_, _>>(),
            model_transaction_policy: Some(ModelTransactionPolicy { decoupled: false }),
        }
    }
}

/// `layer-<L>`.
fn plain(layer: u32) -> String {
    format!("layer-{layer}")
}

/// RepositoryIndex: every model, READY while the service admits requests, else UNAVAILABLE with
/// `why`; `ready_only` leaves out the ones not ready.
pub fn index(spec: &MoeSpec, why_not_ready: Option<&str>, ready_only: bool) -> Vec<ModelIndex> {
    if ready_only && why_not_ready.is_some() {
        return Vec::new();
    }
    Model::all(spec)
        .map(|m| ModelIndex {
            name: m.name(),
            version: VERSION.into(),
            state: if why_not_ready.is_some() {
                "UNAVAILABLE"
            } else {
                "READY"
            }
            .into(),
            reason: why_not_ready.unwrap_or_default().into(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_is_found_by_its_name_and_nothing_else_is() {
        let spec = crate::model::synthetic::preset("tiny").unwrap();
        let all: Vec<Model> = Model::all(&spec).collect();
        assert_eq!(all.len(), 6 * spec.moe_layers.len());
        for m in &all {
            assert_eq!(Model::find(&spec, &m.name(), "").unwrap(), *m);
            assert_eq!(Model::find(&spec, &m.name(), VERSION).unwrap(), *m);
            assert!(Model::find(&spec, &m.name(), "2").is_err());
            let c = m.config(&spec);
            assert_eq!(c.input[0].data_type, data_type(m.declared()) as i32);
            assert_eq!(c.output[0].data_type, c.input[0].data_type);
            let optional: Vec<bool> = c.input.iter().map(|i| i.optional).collect();
            let want: &[bool] = if m.gated {
                &[false]
            } else {
                &[false, true, true]
            };
            assert_eq!(optional, want, "{}", m.name());
            assert_eq!(m.metadata(&spec).0.len(), c.input.len());
        }
        let l = spec.moe_layers[0];
        for bad in [
            format!("layer-{l}-fp32"),
            format!("layer-{l}-gated-bf16"),
            format!("layer-{l}-"),
            format!("Layer-{l}"),
            "layer-999".into(),
            String::new(),
        ] {
            let e = Model::find(&spec, &bad, "").unwrap_err();
            assert!(matches!(e, Failure::NotFound(_)), "{bad}: {e:?}");
        }
        let bf16 = Model::find(&spec, &format!("layer-{l}-bf16"), "").unwrap();
        assert_eq!(bf16.accepts(), &[Dtype::Bf16]);
        assert_eq!(bf16.output(Some(Dtype::F32)), Dtype::Bf16);
        let plain = Model::find(&spec, &format!("layer-{l}"), "").unwrap();
        assert_eq!(plain.output(Some(Dtype::Bf16)), Dtype::Bf16);
        assert_eq!(plain.output(None), Dtype::F32);
    }

    #[test]
    fn the_index_lists_every_model_and_says_why_one_is_not_ready() {
        let spec = crate::model::synthetic::preset("tiny").unwrap();
        let ready = index(&spec, None, false);
        assert_eq!(ready.len(), 6 * spec.moe_layers.len());
        assert!(ready
            .iter()
            .all(|m| m.state == "READY" && m.reason.is_empty()));
        let down = index(&spec, Some("starting"), false);
        assert!(down
            .iter()
            .all(|m| m.state == "UNAVAILABLE" && m.reason == "starting"));
        assert!(index(&spec, Some("starting"), true).is_empty());
    }
}
