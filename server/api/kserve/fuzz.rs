//! The KServe decode path under random input (fixed seed and budget): no input panics, every
//! refusal is INVALID_ARGUMENT or NOT_FOUND with a message, and what is accepted is consistent
//! with the model.

use super::*;
use crate::lifecycle::Abort;
use crate::request::Admission;
use prost::Message;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, Notify};
use tonic::Code;

fn pick<T: Clone>(rng: &mut impl Rng, from: &[T]) -> T {
    from[rng.random_range(0..from.len())].clone()
}

fn tensor(rng: &mut impl Rng, name: &str, cols: usize) -> (InferInputTensor, Vec<u8>) {
    if rng.random_bool(0.6) {
        // A valid tensor of 2 rows: distinct ids, or small finite floats.
        let floats: Vec<f32> = (0..2 * cols)
            .map(|_| rng.random_range(0.1f32..1.0))
            .collect();
        let (datatype, data): (&str, Vec<u8>) = if name == "topk_ids" {
            let rows = (0..2).flat_map(|_| 0..cols as i32);
            ("INT32", rows.flat_map(i32::to_le_bytes).collect())
        } else if rng.random_bool(0.5) {
            (
                "FP32",
                floats.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        } else {
            let bf16 = floats
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes());
            ("BF16", bf16.collect())
        };
        let t = InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: vec![2, cols as i64],
            ..Default::default()
        };
        return (t, data);
    }
    let datatype = pick(
        rng,
        &["FP32", "BF16", "FP16", "INT32", "INT64", "FP64", "x", ""],
    );
    let n = pick(rng, &[1i64, 2, 3, 0, -1, i64::MAX]);
    let c = pick(rng, &[cols as i64, cols as i64, cols as i64 + 1, 0]);
    let shape = match rng.random_range(0..6) {
        0 => vec![n],
        1 => vec![n, c, 1],
        _ => vec![n, c],
    };
    let elem = match datatype {
        "BF16" | "FP16" => 2,
        "INT64" | "FP64" => 8,
        _ => 4,
    };
    let rows = usize::try_from(n).unwrap_or(0).min(4);
    let mut len = rows * cols * elem;
    if rng.random_bool(0.2) {
        len = rng.random_range(0..len + 9);
    }
    // Mostly small finite values and in-range distinct-ish ids.
    let data: Vec<u8> = match datatype {
        "FP32" => (0..len / 4)
            .flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes())
            .collect(),
        "INT32" => (0..len / 4)
            .flat_map(|i| ((i % cols.max(1)) as i32).to_le_bytes())
            .collect(),
        _ => (0..len).map(|_| rng.random()).collect(),
    };
    let mut t = InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape,
        ..Default::default()
    };
    if rng.random_bool(0.1) {
        t.contents = Some(crate::inference::InferTensorContents {
            fp32_contents: vec![0.5; rows * cols],
            ..Default::default()
        });
    }
    (t, data)
}

#[test]
fn no_request_panics_and_every_refusal_is_named() {
    let spec = Arc::new(crate::model::synthetic::preset("tiny").unwrap());
    let (jobs, _rx) = mpsc::channel(1);
    let infer = Infer::new(
        spec.clone(),
        jobs,
        Admission::new(1, 1),
        Arc::new(Notify::new()),
        Arc::new(Abort::default()),
    );
    let regions = regions::RegionArgs {
        allow_client_shm: true,
        shm_regions_prefix: String::new(),
        shm_regions_dir: std::env::temp_dir(),
        shm_regions_mode: 0o600,
        shm_regions_max: 1,
    };
    let api = KserveApi::new(Arc::new(infer), 1, regions, Err("a test".into()), 1 << 20);
    let (h, k) = (spec.hidden, spec.top_k);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6b73);
    let mut accepted = 0;
    for i in 0..20_000 {
        let mut r = if i % 4 == 0 {
            let len = rng.random_range(0..96);
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            match ModelInferRequest::decode(bytes.as_slice()) {
                Ok(r) => r,
                Err(_) => continue,
            }
        } else {
            ModelInferRequest::default()
        };
        r.model_name = pick(&mut rng, &["layer-0", "layer-0", "layer-1", "layer-2", ""]).into();
        r.model_version = pick(&mut rng, &["", "", "1", "2"]).into();
        let mut raw = Vec::new();
        for (name, cols, p) in [
            ("hidden_states", h, 0.9),
            ("topk_ids", k, 0.3),
            ("topk_weights", k, 0.3),
            ("other", h, 0.02),
        ] {
            if rng.random_bool(p) {
                let (t, d) = tensor(&mut rng, name, cols);
                r.inputs.push(t);
                raw.push(d.into());
            }
        }
        if rng.random_bool(0.9) {
            r.raw_input_contents = raw;
        }
        if rng.random_bool(0.05) {
            r.parameters.insert(
                pick(&mut rng, &["output_datatype", "timeout", "priority"]).into(),
                pick(
                    &mut rng,
                    &[
                        InferParameter::default(),
                        InferParameter {
                            parameter_choice: Some(ParameterChoice::StringParam("BF16".into())),
                        },
                        InferParameter {
                            parameter_choice: Some(ParameterChoice::Int64Param(-5)),
                        },
                        InferParameter {
                            parameter_choice: Some(ParameterChoice::BoolParam(true)),
                        },
                    ],
                ),
            );
        }
        let model = api.model(&r.model_name, &r.model_version);
        let result = model.and_then(|m| Ok((m, api.decode(&r, m, None)?)));
        match result.map_err(status) {
            Err(s) => {
                assert!(
                    matches!(s.code(), Code::InvalidArgument | Code::NotFound),
                    "{r:?}: {s:?}"
                );
                assert!(!s.message().is_empty());
            }
            Ok((model, Decoded { input, out, .. })) => {
                accepted += 1;
                assert!(out.is_float());
                let x = &input.hidden;
                assert!(model.accepts().contains(&x.dtype), "{model:?}: {x:?}");
                assert_eq!(x.data.len(), input.tokens * h * x.dtype.bytes());
                let mut wide = vec![0f32; input.tokens * h];
                crate::dtype::to_f32(x.dtype, x.data.host().expect("host rows"), &mut wide);
                assert!(wide.iter().all(|v| v.is_finite()));
                assert_eq!(input.output, out);
                if let Some((ids, w)) = &input.routing {
                    assert_eq!((ids.len(), w.len()), (input.tokens * k, input.tokens * k));
                    assert!(ids
                        .iter()
                        .all(|&e| (0..spec.num_experts as i32).contains(&e)));
                }
            }
        }
    }
    assert!(accepted > 100, "only {accepted} requests were valid");
}
