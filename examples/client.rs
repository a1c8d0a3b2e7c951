//! A minimal client: asks the service what it serves, sends random tokens through its first MoE
//! layer, and prints what came back.
//!
//!     cargo run --example client -- [http://127.0.0.1:50051] [tokens]

use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::{DType, ForwardRequest, GetModelInfoRequest, Tensor};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:50051".into());
    let tokens: usize = args.next().map_or(Ok(8), |s| s.parse())?;
    let mut client = MoeServiceClient::connect(addr).await?;
    let info = client
        .get_model_info(GetModelInfoRequest {})
        .await?
        .into_inner();
    println!(
        "model {} ({}): hidden {}, {} experts, top-{}, MoE layers {:?}, {} ranks on {}",
        info.model,
        info.architecture,
        info.hidden_size,
        info.num_experts,
        info.top_k,
        info.moe_layers,
        info.world_size,
        info.backend
    );
    println!("each rank's node: {}", info.rank_nodes.join(" "));
    let h = info.hidden_size as usize;
    // A small deterministic pseudo-random input, so the example needs no RNG crate.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let x: Vec<f32> = (0..tokens * h)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    let request = ForwardRequest {
        id: "example".into(),
        layer: info.moe_layers[0],
        hidden_states: Some(Tensor {
            dtype: DType::F32 as i32,
            shape: vec![tokens as i64, h as i64],
            data: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }),
        topk_ids: None,
        topk_weights: None,
        output_dtype: DType::F32 as i32,
    };
    let out = client
        .forward(request)
        .await?
        .into_inner()
        .output
        .ok_or("no output")?;
    let y: Vec<f32> = out
        .data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let norm = y.iter().map(|v| v * v).sum::<f32>().sqrt();
    println!(
        "output shape {:?}, first values {:?}, L2 norm {norm:.4}",
        out.shape,
        &y[..4.min(y.len())]
    );
    Ok(())
}
