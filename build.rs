use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc, so a fresh machine needs nothing but cargo.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("epserve_descriptor.bin"))
        // Tensor bytes are shared with the request's buffer, not copied out of it.
        .bytes(".epserve.v1.Tensor.data")
        .compile_protos(&["proto/epserve.proto"], &["proto"])?;
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("inference_descriptor.bin"))
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .compile_protos(&["proto/inference.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/epserve.proto");
    println!("cargo:rerun-if-changed=proto/inference.proto");
    println!("cargo:rerun-if-changed=proto/model_config.proto");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        kernels(&out)?;
    }
    Ok(())
}

const HOW: &str = "install the CUDA 13.0 toolchain, e.g. from pip: \
python3 -m pip install nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85, then set NVCC=<site-packages>/nvidia/cu13/bin/nvcc \
(or CUDA_HOME to a CUDA install)";

/// nvcc: `NVCC`, then `CUDA_HOME/bin/nvcc`, then pip's `nvidia/cu13/bin/nvcc` next to the python3
/// on PATH or in `VIRTUAL_ENV`, then `nvcc` on PATH (as the `cc` crate would find it).
fn find_nvcc() -> Option<PathBuf> {
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            let p = Path::new(&h).join("bin/nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    if let Ok(out) = Command::new("python3")
        .args(["-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'bin', 'nvcc'))"])
        .output()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && p.exists() {
            return Some(p);
        }
    }
    let cc_nvcc = cc::Build::new().cuda(true).get_compiler();
    let p = cc_nvcc.path().to_path_buf();
    Command::new(&p)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| p)
}

/// The DeepGEMM instances `kernels/hopper.cu` compiles, one table for the three places that need
/// them: the template arguments (OUT_DIR/hopper_instances.inc), the mangled symbols (checked in
/// the fatbin) and the constants `server/backend/cuda/kernels/hopper.rs` launches them with
/// (OUT_DIR/hopper_tiles.rs). Measured choices: docs/benchmarks.md, "Expert GEMM on Hopper".
struct HopperTile {
    name: &'static str,
    /// DeepGEMM's `GemmType`: 5 `MGroupedContiguousWithPsumLayout`, 2 `MGroupedMasked`.
    gemm_type: u32,
    block_m: u32,
    block_n: u32,
    stages: u32,
    math_threads: u32,
    /// TMA multicast of the weight tile over a cluster of this many CTAs (1: none).
    multicast: u32,
    /// Most experts a launch takes (`kNumGroups`): the scheduler walks them all at each CTA's
    /// end, so fewer is faster where a rank holds fewer.
    groups: u32,
    /// N and K fixed at compile time, as DeepGEMM's JIT builds every instance; 0: given at
    /// launch.
    shape: [u32; 2],
    /// Persistent CTAs (`kNumSMs`): `HOPPER_CTAS`, or `SHARE_CTAS` for an instance that runs
    /// beside the exchange's kernels.
    ctas: u32,
}

/// Most local experts per launch (`kNumGroups`) and persistent CTAs (`kNumSMs`, one per
/// H100/H200 SM), the same for every instance.
const HOPPER_GROUPS: u32 = 256;
const HOPPER_CTAS: u32 = 132;
/// Two-batch overlap (`GpuStep::split`) runs one micro-batch's experts while the other's rows
/// move: NCCL EP's HT kernels take 16 SMs (`HYBRIDEP_MAX_NUM_SMS_PER_RANK`), so the psum GEMMs
/// that run beside them have instances of 116 persistent CTAs (DeepGEMM schedules its tiles
/// statically over `kNumSMs`: a CTA that waits for a busy SM finishes that much later).
const SHARE_CTAS: u32 = 116;

const HOPPER_TILES: [HopperTile; 3] = [
    HOPPER_BF16_PSUM,
    HopperTile {
        name: "PSUM_SHARE",
        ctas: SHARE_CTAS,
        ..HOPPER_BF16_PSUM
    },
    // Masked, for experts of many rows (a 64-row tile reads each weight tile once per 64 rows);
    // decode's experts of a few rows run on kernels/decode_gemm.cuh.
    HopperTile {
        name: "MASKED",
        gemm_type: 2,
        block_m: 64,
        block_n: 256,
        stages: 4,
        math_threads: 128,
        multicast: 1,
        groups: HOPPER_GROUPS,
        shape: [0, 0],
        ctas: HOPPER_CTAS,
    },
];

const HOPPER_BF16_PSUM: HopperTile = HopperTile {
    name: "PSUM",
    gemm_type: 5,
    block_m: 128,
    block_n: 256,
    stages: 3,
    math_threads: 256,
    multicast: 1,
    groups: HOPPER_GROUPS,
    shape: [0, 0],
    ctas: HOPPER_CTAS,
};

impl HopperTile {
    /// The Itanium-mangled name of `deep_gemm::sm90_bf16_gemm_impl<K, K, 0, N, K, groups, M, N,
    /// 64, 128, 128, 128, stages, 128, math, multicast, false, ctas, type, false, cutlass::bfloat16_t>`
    /// (the first N and K: `shape`).
    fn symbol(&self) -> String {
        format!(
            "_ZN9deep_gemm19sm90_bf16_gemm_implILN4cute4UMMA5MajorE0ELS3_0ELj0ELj{}ELj{}ELj{}ELj{}ELj{}ELj64ELj128ELj128ELj128ELj{}ELj128ELj{}ELj{}ELb0ELj{}ELNS_8GemmTypeE{}ELb0EN7cutlass10bfloat16_tEEEvPijjj14CUtensorMap_stS8_S8_",
            self.shape[0], self.shape[1], self.groups, self.block_m, self.block_n, self.stages, self.math_threads, self.multicast, self.ctas, self.gemm_type
        )
    }
}

/// The FP8 instances `kernels/hopper_fp8.cu` compiles (DeepGEMM's `sm90_fp8_gemm_1d2d`), as
/// `HOPPER_TILES` are for bf16: psum for the contiguous layout (its row tile must be the bf16
/// psum tile's, the exchange's block alignment), masked for the strided one. psum's N tile: 192
/// (4 stages) ran prefill-rank's experts 4.5% faster than 128 (5 stages) on one H200, decode
/// 0.7% slower (docs/benchmarks.md, "FP8 experts"); 256 spills (2 kB; 3.4x slower), and the D
/// store's 64-column boxes rule out 160 and 224 (160 under a 64-byte D swizzle did not finish in
/// the probe). psum's weight tiles multicast over CTA pairs: both
/// GEMMs of prefill-rank 7% faster on one H200, with A multicast instead no better than none
/// (scripts/probes/prefill_fp8.cu; docs/benchmarks.md, "FP8 on the wire"); N of an odd count
/// of column tiles takes the instances without clusters (`PSUM_SOLO`, `PSUM_SHARE_SOLO`).
/// DeepSeek-V3's expert shapes (its family's: gate/up 4096 x 7168, down 7168 x 2048) have psum
/// instances of their own, N and K fixed and at most 64 experts (a rank of EP4 or wider):
/// prefill-rank's ragged GEMMs 5.5% faster alone, its experts phase 2-3%, on one H100
/// (docs/benchmarks.md, "Fixed-shape instances").
const HOPPER_FP8_TILES: [HopperTile; 7] = [
    HOPPER_FP8_PSUM,
    HopperTile {
        name: "PSUM_SHARE",
        ctas: SHARE_CTAS,
        ..HOPPER_FP8_PSUM
    },
    // The same without clusters, for N of an odd count of 192-column tiles (hopper.rs's
    // `Tile::takes`: a cluster's CTAs must get blocks of the same expert).
    HopperTile {
        name: "PSUM_SOLO",
        multicast: 1,
        ..HOPPER_FP8_PSUM
    },
    HopperTile {
        name: "PSUM_SHARE_SOLO",
        multicast: 1,
        ctas: SHARE_CTAS,
        ..HOPPER_FP8_PSUM
    },
    HopperTile {
        name: "MASKED",
        gemm_type: 2,
        block_m: 64,
        block_n: 128,
        stages: 8,
        math_threads: 128,
        multicast: 1,
        groups: HOPPER_GROUPS,
        shape: [0, 0],
        ctas: HOPPER_CTAS,
    },
    HopperTile {
        name: "V3_GATE_UP",
        shape: [4096, 7168],
        groups: 64,
        ..HOPPER_FP8_PSUM
    },
    HopperTile {
        name: "V3_DOWN",
        shape: [7168, 2048],
        groups: 64,
        ..HOPPER_FP8_PSUM
    },
];

/// The general FP8 psum tile, which the fixed-shape ones repeat.
const HOPPER_FP8_PSUM: HopperTile = HopperTile {
    name: "PSUM",
    gemm_type: 5,
    block_m: 128,
    block_n: 192,
    stages: 4,
    math_threads: 256,
    multicast: 2,
    groups: HOPPER_GROUPS,
    shape: [0, 0],
    ctas: HOPPER_CTAS,
};

impl HopperTile {
    /// The Itanium-mangled name of `deep_gemm::sm90_fp8_gemm_1d2d_impl<K, 0, N, K, groups, M, N,
    /// 128, 128, 128, 128, stages, 128, math, multicast, false, ctas, type, cutlass::bfloat16_t,
    /// 128>` (the first N and K: `shape`).
    fn fp8_symbol(&self) -> String {
        format!(
            "_ZN9deep_gemm23sm90_fp8_gemm_1d2d_implILN4cute4UMMA5MajorE0ELj0ELj{}ELj{}ELj{}ELj{}ELj{}ELj128ELj128ELj128ELj128ELj{}ELj128ELj{}ELj{}ELb0ELj{}ELNS_8GemmTypeE{}EN7cutlass10bfloat16_tELj128EEEvPfPijjj14CUtensorMap_stS9_S9_S9_",
            self.shape[0], self.shape[1], self.groups, self.block_m, self.block_n, self.stages, self.math_threads, self.multicast, self.ctas, self.gemm_type
        )
    }
}

const HOW_DEEP_GEMM: &str = "the Hopper expert GEMM needs DeepGEMM's headers: run \
`eval \"$(scripts/cuda-toolchain.sh)\"` (it fetches the pinned sgl-deep-gemm wheel and sets \
DEEP_GEMM_INCLUDE)";

/// Compiles `kernels/epserve.cu`, `kernels/fp8.cu`, `kernels/hopper.cu` and
/// `kernels/hopper_fp8.cu` into one fatbin each (sm_90a code, and compute_90a PTX for the first)
/// for `include_bytes!`.
fn kernels(out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=DEEP_GEMM_INCLUDE");
    let nvcc = find_nvcc().ok_or_else(|| format!("--features cuda needs nvcc: {HOW}"))?;
    // CUB and friends live in include/cccl in pip's layout and in include/ in a CUDA install.
    let include = nvcc
        .parent()
        .and_then(Path::parent)
        .map(|root| root.join("include"));
    let nvcc_cmd = |std: &str| {
        let mut cmd = Command::new(&nvcc);
        cmd.args(["--fatbin", "-O3", "-lineinfo", std]);
        if let Some(inc) = &include {
            cmd.arg("-isystem")
                .arg(inc.join("cccl"))
                .arg("-isystem")
                .arg(inc);
        }
        cmd
    };
    let run = |mut cmd: Command, what: &str| -> Result<(), Box<dyn std::error::Error>> {
        let status = cmd
            .status()
            .map_err(|e| format!("running {}: {e}; {HOW}", nvcc.display()))?;
        match status.success() {
            true => Ok(()),
            false => Err(format!("nvcc failed on {what} ({status})").into()),
        }
    };

    let mut cmd = nvcc_cmd("-std=c++17");
    cmd.args([
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90a,code=compute_90a",
    ])
    .arg("-o")
    .arg(out.join("epserve_kernels.fatbin"))
    .arg("kernels/epserve.cu");
    run(cmd, "kernels/epserve.cu")?;
    let mut cmd = nvcc_cmd("-std=c++17");
    cmd.args(["-gencode=arch=compute_90a,code=sm_90a"])
        // The most experts a quantization pass's psum layout stages: the GEMMs' bound.
        .arg(format!("-DEPSERVE_MAX_GROUPS={HOPPER_GROUPS}"))
        .arg("-o")
        .arg(out.join("fp8_kernels.fatbin"))
        .arg("kernels/fp8.cu");
    run(cmd, "kernels/fp8.cu")?;

    // Set by the toolchain script, the one place that pins DeepGEMM's version.
    let deep_gemm = std::env::var_os("DEEP_GEMM_INCLUDE")
        .map(PathBuf::from)
        .ok_or_else(|| format!("DEEP_GEMM_INCLUDE is not set: {HOW_DEEP_GEMM}"))?;
    if !deep_gemm
        .join("deep_gemm/impls/sm90_bf16_gemm.cuh")
        .exists()
    {
        return Err(format!(
            "no DeepGEMM headers at {}: {HOW_DEEP_GEMM}",
            deep_gemm.display()
        )
        .into());
    }
    let table = |instance: &str, tiles: &[HopperTile]| -> String {
        (tiles.iter().map(|t| {
            format!(
                "{instance}({}, {}, {}, {}, {}, {}, {}, {}, {}, {})\n",
                t.gemm_type,
                t.block_m,
                t.block_n,
                t.stages,
                t.math_threads,
                t.multicast,
                t.groups,
                t.shape[0],
                t.shape[1],
                t.ctas
            )
        }))
        .collect()
    };
    std::fs::write(
        out.join("hopper_instances.inc"),
        table("EPSERVE_INSTANCE", &HOPPER_TILES),
    )?;
    std::fs::write(
        out.join("hopper_fp8_instances.inc"),
        table("EPSERVE_FP8_INSTANCE", &HOPPER_FP8_TILES),
    )?;
    let deep_gemm_cmd = |source: &str, fatbin: &Path| {
        let mut cmd = nvcc_cmd("-std=c++20");
        cmd.args([
            "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a",
        ])
        .arg("-isystem")
        .arg(&deep_gemm)
        .arg("-I")
        .arg(out)
        .arg("-o")
        .arg(fatbin)
        .arg(source);
        cmd
    };
    let consts = |source: &str,
                  fatbin: &Path,
                  tiles: &[HopperTile],
                  symbol: fn(&HopperTile) -> String|
     -> Result<String, Box<dyn std::error::Error>> {
        run(deep_gemm_cmd(source, fatbin), source)?;
        let bin = std::fs::read(fatbin)?;
        let mut consts = format!("pub const GROUPS: usize = {HOPPER_GROUPS};\n");
        for t in tiles {
            let sym = symbol(t);
            if !bin.windows(sym.len()).any(|w| w == sym.as_bytes()) {
                return Err(format!("{source} did not produce {sym}: the DeepGEMM headers or nvcc mangle it differently; update HopperTile's symbols").into());
            }
            consts.push_str(&format!(
                "pub const {}: Tile = Tile {{ name: \"{}\", symbol: \"{sym}\", block_m: {}, block_n: {}, stages: {}, math_threads: {}, multicast: {}, groups: {}, shape: [{}, {}], ctas: {} }};\n",
                t.name, t.name, t.block_m, t.block_n, t.stages, t.math_threads, t.multicast, t.groups, t.shape[0], t.shape[1], t.ctas
            ));
        }
        Ok(consts)
    };
    let bf16 = consts(
        "kernels/hopper.cu",
        &out.join("hopper_kernels.fatbin"),
        &HOPPER_TILES,
        HopperTile::symbol,
    )?;
    std::fs::write(out.join("hopper_tiles.rs"), bf16)?;
    let fp8 = consts(
        "kernels/hopper_fp8.cu",
        &out.join("hopper_fp8_kernels.fatbin"),
        &HOPPER_FP8_TILES,
        HopperTile::fp8_symbol,
    )?;
    std::fs::write(out.join("hopper_fp8_tiles.rs"), fp8)?;
    Ok(())
}
