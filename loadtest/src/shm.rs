//! `--api kserve-shm`: each request's hidden states in the client's system shared memory and its
//! output written back there, as a co-located Triton client does. One pair of POSIX objects per
//! request in flight, created under /dev/shm and registered once; the client writes its rows in
//! and reads the answer out (the copies a client that keeps its tensors elsewhere pays).

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Mutex;

use epserve::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::model_infer_request::InferRequestedOutputTensor;
use epserve::inference::{
    InferParameter, ModelInferRequest, SystemSharedMemoryRegisterRequest,
    SystemSharedMemoryUnregisterRequest,
};
use tokio::sync::Semaphore;
use tonic::transport::Channel;

/// One request's input and output objects.
struct Slot {
    name: String,
    input: File,
    output: File,
}

pub struct Regions {
    slots: Mutex<Vec<Slot>>,
    free: Semaphore,
    paths: Vec<PathBuf>,
    names: Vec<String>,
    len: usize,
}

fn param(p: ParameterChoice) -> InferParameter {
    InferParameter {
        parameter_choice: Some(p),
    }
}

fn params(region: &str, len: usize) -> std::collections::HashMap<String, InferParameter> {
    [
        (
            "shared_memory_region",
            ParameterChoice::StringParam(region.into()),
        ),
        (
            "shared_memory_byte_size",
            ParameterChoice::Int64Param(len as i64),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), param(v)))
    .collect()
}

impl Regions {
    /// `count` pairs of `len`-byte objects, registered with the server behind `c`.
    pub async fn create(
        c: &mut GrpcInferenceServiceClient<Channel>,
        count: usize,
        len: usize,
    ) -> anyhow::Result<Self> {
        let mut me = Self {
            slots: Mutex::new(Vec::new()),
            free: Semaphore::new(count),
            paths: Vec::new(),
            names: Vec::new(),
            len,
        };
        let pid = std::process::id();
        let mut slots = Vec::new();
        for k in 0..count {
            let name = format!("loadtest-{pid}-{k}");
            let mut files = Vec::new();
            for side in ["in", "out"] {
                let object = format!("{name}-{side}");
                let path = PathBuf::from("/dev/shm").join(&object);
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)?;
                f.set_len(len as u64)?;
                me.paths.push(path);
                c.system_shared_memory_register(SystemSharedMemoryRegisterRequest {
                    name: object.clone(),
                    key: format!("/{object}"),
                    offset: 0,
                    byte_size: len as u64,
                })
                .await?;
                me.names.push(object);
                files.push(f);
            }
            let output = files.pop().expect("two files");
            let input = files.pop().expect("two files");
            slots.push(Slot {
                name,
                input,
                output,
            });
        }
        me.slots = Mutex::new(slots);
        Ok(me)
    }

    /// Sends `r` (its hidden states moved into a region) and reads its output back: the
    /// output's byte count.
    pub async fn infer(
        &self,
        c: &mut GrpcInferenceServiceClient<Channel>,
        mut r: ModelInferRequest,
        timeout: std::time::Duration,
    ) -> Result<(epserve::inference::ModelInferResponse, usize), tonic::Status> {
        let _turn = self.free.acquire().await.expect("never closed");
        let slot = self.slots.lock().unwrap().pop().expect("a slot per permit");
        let result = async {
            // The hidden states go in the region; client routing (if any) stays raw entries,
            // which the inputs without a region take in order.
            let data = r.raw_input_contents.remove(0);
            if data.len() > self.len {
                return Err(tonic::Status::invalid_argument(
                    "loadtest: the hidden states are larger than the region",
                ));
            }
            slot.input
                .write_all_at(&data, 0)
                .map_err(|e| tonic::Status::internal(e.to_string()))?;
            r.inputs[0].parameters = params(&format!("{}-in", slot.name), data.len());
            r.outputs = vec![InferRequestedOutputTensor {
                name: "output".into(),
                parameters: params(&format!("{}-out", slot.name), self.len),
            }];
            let mut req = tonic::Request::new(r);
            req.set_timeout(timeout);
            let resp = c.model_infer(req).await?.into_inner();
            let n = match resp.outputs.first().and_then(|o| {
                o.parameters
                    .get("shared_memory_byte_size")?
                    .parameter_choice
                    .clone()
            }) {
                Some(ParameterChoice::Int64Param(n)) if n >= 0 && n as usize <= self.len => {
                    n as usize
                }
                _ => return Err(tonic::Status::internal("loadtest: no output in the region")),
            };
            let mut out = vec![0u8; n];
            slot.output
                .read_exact_at(&mut out, 0)
                .map_err(|e| tonic::Status::internal(e.to_string()))?;
            Ok((resp, n))
        }
        .await;
        self.slots.lock().unwrap().push(slot);
        result
    }

    /// Unregisters the regions (the objects are removed on drop).
    pub async fn close(&self, c: &mut GrpcInferenceServiceClient<Channel>) {
        for name in &self.names {
            let _ = c
                .system_shared_memory_unregister(SystemSharedMemoryUnregisterRequest {
                    name: name.clone(),
                })
                .await;
        }
    }
}

impl Drop for Regions {
    fn drop(&mut self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}
