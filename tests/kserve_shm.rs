//! Triton's system shared memory over KServe v2: a region's inputs and outputs equal to the same
//! request over the wire, regions listed and unregistered, and the catalogue's shared-memory
//! refusals.

mod common;

use common::*;
use epserve::inference::infer_parameter::ParameterChoice;
use epserve::inference::model_infer_request::InferRequestedOutputTensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tonic::Code;

use common::kserve::*;

/// Triton's system shared memory: inputs read from the client's region and the output written
/// to it, equal per token to the same request over the wire (client routing and a mix of
/// regions and raw entries included), regions listed and unregistered, and each refusal of the
/// catalogue's shared-memory rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_shared_memory_round_trip_and_refusals() {
    use epserve::inference::{
        SystemSharedMemoryRegisterRequest, SystemSharedMemoryStatusRequest,
        SystemSharedMemoryUnregisterRequest,
    };
    use std::os::unix::fs::{FileExt, PermissionsExt};
    let dir = TempDir::new("regions");
    let group = Group::launch(
        2,
        "synthetic:tiny",
        &[
            "--allow-client-shm",
            "--shm-regions-dir",
            dir.0.to_str().unwrap(),
        ],
    );
    let mut c = client(&group.addr).await;
    let object = |name: &str, len: u64, mode: u32| {
        let p = dir.0.join(name);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.set_len(len).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        f
    };
    let registrar = c.clone();
    let register = |name: &str, key: &str, offset: u64, byte_size: u64| {
        let mut c = registrar.clone();
        let r = SystemSharedMemoryRegisterRequest {
            name: name.into(),
            key: key.into(),
            offset,
            byte_size,
        };
        async move { c.system_shared_memory_register(r).await }
    };
    let input_obj = object("in", 1 << 20, 0o600);
    let output_obj = object("out", 1 << 20, 0o600);
    register("in", "/in", 512, 64 << 10).await.unwrap();
    register("out", "/out", 0, 64 << 10).await.unwrap();

    let mut rng = ChaCha8Rng::seed_from_u64(363);
    let n = 6;
    let x: Vec<f32> = (0..n * H).map(|_| rng.random_range(-1.0..1.0)).collect();
    let ids: Vec<i32> = (0..n)
        .flat_map(|t| [(t % E) as i32, ((t + 3) % E) as i32])
        .collect();
    let w: Vec<f32> = (0..n * K).map(|_| rng.random_range(0.1..1.0)).collect();
    input_obj.write_all_at(&le_f32(&x), 512 + 128).unwrap();
    let bytes = n * H * 4;
    for routed in [false, true] {
        // Over the wire.
        let mut inputs = vec![hidden(n, &x)];
        if routed {
            inputs.push((
                input("topk_ids", "INT32", &[n as i64, K as i64]),
                ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
            inputs.push((
                input("topk_weights", "FP32", &[n as i64, K as i64]),
                le_f32(&w),
            ));
        }
        let plain = c
            .model_infer(raw_request("layer-0", "wire", inputs.clone()))
            .await
            .unwrap()
            .into_inner();
        let want = output_f32(&plain);
        // Through the regions: the hidden states from "in", the routing (if any) as raw
        // entries for the inputs that carry no region, the output into "out".
        let mut req = raw_request("layer-0", "shm", inputs);
        req.raw_input_contents.remove(0);
        req.inputs[0].parameters = shm_params("in", 128, bytes);
        req.outputs = vec![InferRequestedOutputTensor {
            name: "output".into(),
            parameters: shm_params("out", 256, bytes + 100),
        }];
        let resp = c.model_infer(req).await.unwrap().into_inner();
        assert_eq!(resp.raw_output_contents, vec![bytes::Bytes::new()]);
        let o = &resp.outputs[0];
        assert_eq!(
            (o.datatype.as_str(), o.shape.clone()),
            ("FP32", vec![n as i64, H as i64])
        );
        assert_eq!(
            o.parameters["shared_memory_byte_size"].parameter_choice,
            Some(ParameterChoice::Int64Param(bytes as i64))
        );
        let mut got = vec![0u8; bytes];
        output_obj.read_exact_at(&mut got, 256).unwrap();
        let got: Vec<f32> = got
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        for t in 0..n {
            let e = row_error(&got[t * H..(t + 1) * H], &want[t * H..(t + 1) * H]);
            assert!(e <= 1e-6, "routed {routed}, token {t}: {e}");
        }
    }

    // A non-finite value in a region is found as its rows are read into the step: refused by
    // row and column, and the next request is answered.
    let mut bad = x.clone();
    bad[4 * H + 5] = f32::NAN;
    input_obj.write_all_at(&le_f32(&bad), 512 + 128).unwrap();
    let mut req = raw_request("layer-0", "nan", vec![hidden(n, &x)]);
    req.raw_input_contents.clear();
    req.inputs[0].parameters = shm_params("in", 128, bytes);
    let e = c.model_infer(req).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("non-finite value at row 4, column 5"),
        "{e:?}"
    );
    input_obj.write_all_at(&le_f32(&x), 512 + 128).unwrap();

    // Status of one and of all; unregistering one.
    let status = c
        .system_shared_memory_status(SystemSharedMemoryStatusRequest::default())
        .await
        .unwrap()
        .into_inner()
        .regions;
    assert_eq!(status.len(), 2);
    assert_eq!(
        (
            status["in"].key.as_str(),
            status["in"].offset,
            status["in"].byte_size
        ),
        ("/in", 512, 64 << 10)
    );

    // The refusals.
    let mut outcomes: Vec<(&str, Code, String)> = Vec::new();
    let mut note = |case: &'static str, e: tonic::Status| {
        outcomes.push((case, e.code(), e.message().to_string()));
    };
    object("wide", 4096, 0o666);
    std::os::unix::fs::symlink(dir.0.join("in"), dir.0.join("link")).unwrap();
    for key in ["in", "/a/b", "/", "/.."] {
        note(
            "a region key that is not a POSIX shared-memory name",
            register("k", key, 0, 16).await.unwrap_err(),
        );
    }
    note(
        "a region key that does not open",
        register("k", "/missing", 0, 16).await.unwrap_err(),
    );
    let link = register("k", "/link", 0, 16).await.unwrap_err();
    assert_eq!(link.code(), Code::InvalidArgument, "{link:?}");
    note(
        "a region object of a wider mode than --shm-regions-mode",
        register("k", "/wide", 0, 16).await.unwrap_err(),
    );
    note(
        "a region past the end of its object",
        register("k", "/in", (1 << 20) - 8, 16).await.unwrap_err(),
    );
    note(
        "a region name registered twice",
        register("in", "/in", 0, 16).await.unwrap_err(),
    );
    note(
        "SystemSharedMemoryStatus of a region not registered",
        c.system_shared_memory_status(SystemSharedMemoryStatusRequest { name: "k".into() })
            .await
            .unwrap_err(),
    );
    let shm_request = |region: &str, offset: i64, len: usize| {
        let mut r = good(2);
        r.raw_input_contents.clear();
        r.inputs[0].parameters = shm_params(region, offset, len);
        r
    };
    let two = 2 * H * 4;
    for (case, req) in [
        (
            "a tensor naming a region not registered",
            shm_request("k", 0, two),
        ),
        (
            "a tensor's offset and byte size outside its region",
            shm_request("in", (64 << 10) - 16, two),
        ),
        (
            "a tensor's offset and byte size outside its region",
            shm_request("in", i64::MAX, two),
        ),
        ("data both in shared memory and in the request", {
            let mut r = good(2);
            r.inputs[0].parameters = shm_params("in", 0, two);
            r
        }),
        ("an output region smaller than the output", {
            let mut r = good(2);
            r.outputs = vec![InferRequestedOutputTensor {
                name: "output".into(),
                parameters: shm_params("out", 0, two - 1),
            }];
            r
        }),
        (
            "shared-memory parameters incomplete or of the wrong type",
            {
                let mut r = shm_request("in", 0, two);
                r.inputs[0].parameters.remove("shared_memory_byte_size");
                r
            },
        ),
        (
            "shared-memory parameters incomplete or of the wrong type",
            {
                let mut r = shm_request("in", 0, two);
                r.inputs[0].parameters.insert(
                    "shared_memory_offset".into(),
                    param(ParameterChoice::Int64Param(-1)),
                );
                r
            },
        ),
    ] {
        note(case, c.model_infer(req).await.unwrap_err());
    }
    let e = c
        .cuda_shared_memory_register(epserve::inference::CudaSharedMemoryRegisterRequest {
            name: "g".into(),
            raw_handle: vec![0; 64],
            device_id: 0,
            byte_size: 16,
        })
        .await
        .unwrap_err();
    note(
        "CudaSharedMemoryRegister on the cpu backend (CUDA shared memory needs a GPU rank)",
        e,
    );
    c.cuda_shared_memory_unregister(
        epserve::inference::CudaSharedMemoryUnregisterRequest::default(),
    )
    .await
    .expect("nothing to unregister is not an error");
    // A region whose object the client truncates: the read fails cleanly.
    let t = object("t", 4096, 0o600);
    register("t", "/t", 0, 4096).await.unwrap();
    t.set_len(10).unwrap();
    note(
        "a region's object truncated under a request",
        c.model_infer(shm_request("t", 0, two)).await.unwrap_err(),
    );
    check_bad_calls(&outcomes, true);

    // Unregistered, a region is gone for new requests; all of them at once with an empty name.
    c.system_shared_memory_unregister(SystemSharedMemoryUnregisterRequest { name: "in".into() })
        .await
        .unwrap();
    let e = c.model_infer(shm_request("in", 0, two)).await.unwrap_err();
    assert!(e.message().contains("is not registered"), "{e:?}");
    c.system_shared_memory_unregister(SystemSharedMemoryUnregisterRequest::default())
        .await
        .unwrap();
    let left = c
        .system_shared_memory_status(SystemSharedMemoryStatusRequest::default())
        .await
        .unwrap()
        .into_inner()
        .regions;
    assert!(left.is_empty(), "{left:?}");
    let metrics = common::prom::scrape(&group.metrics_addrs(2)[0]);
    let tensors = |d| common::prom::sum(&metrics, "epserve_shm_tensors_total", &[("direction", d)]);
    // The non-finite and the truncated objects' requests named their regions too (rows are
    // read as their step is packed): counted as tensors; bytes as far as they were read.
    assert_eq!((tensors("in"), tensors("out")), (4.0, 2.0));
    let read = common::prom::sum(&metrics, "epserve_shm_bytes_total", &[("direction", "in")]);
    assert_eq!(read, 3.0 * bytes as f64);
    c.model_infer(good(1))
        .await
        .expect("serving after the refusals");
}
