//! Every malformed request the service can receive, and what it answers, on each protocol. The
//! README's tables are these lists (a test keeps them in step); `tests/service.rs` sends each
//! epserve.v1 case and `tests/kserve.rs` each KServe v2 case and each bad call.

use tonic::Code;

/// Which protocols a case can arise on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    Both,
    /// epserve.v1 (`Forward`, `ForwardStream`) only.
    V1,
    /// KServe v2 (`ModelInfer`, `ModelStreamInfer`) only.
    Kserve,
    /// KServe v2 REST only (`POST .../infer` and the other routes of the HTTP port).
    Rest,
}

impl On {
    /// How the README's table names it.
    pub fn label(self) -> &'static str {
        match self {
            On::Both => "both",
            On::V1 => "epserve.v1",
            On::Kserve => "KServe v2",
            On::Rest => "KServe REST",
        }
    }

    pub fn v1(self) -> bool {
        matches!(self, On::Both | On::V1)
    }

    pub fn kserve(self) -> bool {
        matches!(self, On::Both | On::Kserve)
    }
}

pub struct BadInput {
    /// A short name for the case (tests key their requests by it).
    pub case: &'static str,
    pub on: On,
    pub code: Code,
    /// A fragment every answer to this case contains.
    pub message: &'static str,
}

const fn bad(case: &'static str, message: &'static str) -> BadInput {
    BadInput {
        case,
        on: On::Both,
        code: Code::InvalidArgument,
        message,
    }
}

const fn only(on: On, code: Code, case: &'static str, message: &'static str) -> BadInput {
    BadInput {
        case,
        on,
        code,
        message,
    }
}

pub const BAD_INPUT: &[BadInput] = &[
    bad("no hidden_states", "hidden_states is required"),
    bad(
        "hidden size other than the model's",
        "does not match the model's",
    ),
    bad("shape not [n, hidden]", "must be [n, "),
    bad("zero tokens", "no tokens"),
    bad(
        "bytes not matching shape and dtype",
        "bytes of data for shape",
    ),
    only(
        On::V1,
        Code::InvalidArgument,
        "dtype number outside the enum",
        "unknown dtype",
    ),
    bad(
        "integer hidden states or weights, float ids",
        "not accepted here",
    ),
    bad(
        "NaN or infinity in hidden states or weights",
        "non-finite value at row",
    ),
    only(
        On::V1,
        Code::InvalidArgument,
        "layer that is not an MoE layer",
        "is not an MoE layer of this model",
    ),
    bad("expert id outside 0..E", "is out of range 0.."),
    bad("an expert twice in one row", "names one expert twice"),
    bad("topk_ids or topk_weights not [n, top_k]", "must be ["),
    bad(
        "topk_weights without topk_ids",
        "topk_weights given without topk_ids",
    ),
    bad(
        "topk_ids without topk_weights",
        "topk_ids given without topk_weights",
    ),
    bad("output_dtype not a float dtype", "is not a float dtype"),
    only(
        On::Both,
        Code::OutOfRange,
        "message over --max-request-bytes",
        "decoded message length too large",
    ),
    only(
        On::Both,
        Code::ResourceExhausted,
        "more tokens than --max-queued-tokens",
        "exceeds --max-queued-tokens",
    ),
    only(On::Kserve, Code::NotFound, "unknown model", "unknown model"),
    only(
        On::Kserve,
        Code::NotFound,
        "model version other than 1",
        "has no version",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "datatype string outside the protocol",
        "unknown datatype",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "input other than hidden_states, topk_ids, topk_weights",
        "unknown input",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "an input twice",
        "given twice",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "output other than output",
        "unknown output",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "raw_input_contents not one per input",
        "entries for",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "data both in contents and raw_input_contents",
        "data given both in contents and in raw_input_contents",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "an input without data",
        "no data (neither contents nor raw_input_contents)",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "typed contents in another field than the datatype's",
        "which is empty",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "BF16 or FP16 data in contents",
        "goes in raw_input_contents",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "tensor parameter other than the shared-memory ones (input or output)",
        "is not supported",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "request parameter read here (output_datatype, timeout, triton_enable_empty_final_response) or passed by Triton's client (priority, sequence_id, sequence_start, sequence_end) of the wrong type",
        "is not valid here",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "hidden states in another type than a typed model's (layer-L-bf16, layer-L-fp16)",
        "not accepted here",
    ),
];

/// Refusals of a call rather than of a tensor (the method, the encoding, Triton's catalogue
/// calls), and of system shared memory, its regions and the tensors that name them. The README's
/// second table; `tests/kserve.rs` makes each call.
pub const BAD_CALL: &[BadInput] = &[
    only(
        On::Both,
        Code::Unimplemented,
        "a method not served",
        "is not served here",
    ),
    only(
        On::Both,
        Code::Unimplemented,
        "grpc-encoding other than gzip, deflate, identity",
        "which isn't supported",
    ),
    only(
        On::Both,
        Code::ResourceExhausted,
        "a compressed message inflating past --max-request-bytes",
        "exceeded while decompressing",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "ModelStatistics with a version but no model name",
        "a version without a model name",
    ),
    only(
        On::Kserve,
        Code::NotFound,
        "RepositoryIndex of a named repository",
        "unknown repository",
    ),
    only(
        On::Kserve,
        Code::NotFound,
        "ModelConfig or ModelStatistics of an unknown model or version",
        "unknown model",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "a region key that is not a POSIX shared-memory name",
        "not a POSIX shared-memory name",
    ),
    only(
        On::Kserve,
        Code::NotFound,
        "a region key that does not open",
        "does not open",
    ),
    only(
        On::Kserve,
        Code::PermissionDenied,
        "a region object of a wider mode than --shm-regions-mode",
        "is wider than the service accepts",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "a region past the end of its object",
        "exceeds the object's",
    ),
    only(
        On::Kserve,
        Code::AlreadyExists,
        "a region name registered twice",
        "is already registered",
    ),
    only(
        On::Kserve,
        Code::NotFound,
        "SystemSharedMemoryStatus of a region not registered",
        "no shared-memory region",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "a tensor naming a region not registered",
        "is not registered",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "a tensor's offset and byte size outside its region",
        "lies outside region",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "an output region smaller than the output",
        "is less than the output's",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "data both in shared memory and in the request",
        "both in shared memory and in the request",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "shared-memory parameters incomplete or of the wrong type",
        "shared_memory_",
    ),
    only(
        On::Kserve,
        Code::InvalidArgument,
        "a region's object truncated under a request",
        "was the object truncated?",
    ),
    only(
        On::Kserve,
        Code::Unavailable,
        "CudaSharedMemoryRegister on the cpu backend (CUDA shared memory needs a GPU rank)",
        "CUDA shared memory is not served",
    ),
];

/// What only the REST port refuses (its answers are the gRPC code's HTTP status, with the
/// message as `{"error": ...}`); REST requests are refused for everything above too.
pub const BAD_HTTP: &[BadInput] = &[
    only(
        On::Rest,
        Code::InvalidArgument,
        "a body that is not the protocol's JSON (unknown fields included)",
        "the request's JSON",
    ),
    only(
        On::Rest,
        Code::ResourceExhausted,
        "a body over --max-request-bytes (declared, sent or inflated)",
        "--max-request-bytes",
    ),
    only(
        On::Rest,
        Code::DeadlineExceeded,
        "a body that does not arrive within --upload-timeout",
        "did not arrive within --upload-timeout",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "Content-Encoding other than gzip, deflate, identity",
        "is not served (gzip, deflate, identity)",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "binary tensor sizes that do not add up to the body",
        "binary tensor data",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "an input with no data",
        "no data (neither data",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "JSON data not fitting the input's shape or datatype",
        "data does not fit",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "a parameter that is an array, an object or null",
        "a parameter is a bool, a number or a string",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "binary_data, binary_data_output or binary_data_size of the wrong type",
        "parameter binary_data",
    ),
    only(
        On::Rest,
        Code::InvalidArgument,
        "an output in JSON with a NaN or infinite value",
        "which JSON cannot carry",
    ),
    only(On::Rest, Code::NotFound, "a path not served", "no route"),
    only(
        On::Rest,
        Code::Unimplemented,
        "a method a path does not take (HTTP 405)",
        "does not take",
    ),
];

#[cfg(test)]
mod tests {
    #[test]
    fn the_readme_lists_every_case() {
        let readme = include_str!("../../README.md");
        for b in super::BAD_INPUT
            .iter()
            .chain(super::BAD_CALL)
            .chain(super::BAD_HTTP)
        {
            let row = readme
                .lines()
                .find(|l| l.starts_with(&format!("| {} |", b.case)))
                .unwrap_or_else(|| panic!("README has no row for '{}'", b.case));
            let code = format!("{:?}", b.code);
            assert!(
                row.contains(b.message),
                "README row for '{}' lacks '{}'",
                b.case,
                b.message
            );
            let upper = code_name(&code);
            assert!(
                row.contains(&upper),
                "README row for '{}' lacks {upper}",
                b.case
            );
            assert!(
                row.contains(&format!("| {} |", b.on.label())),
                "README row for '{}' lacks '{}'",
                b.case,
                b.on.label()
            );
        }
    }

    /// `InvalidArgument` → `INVALID_ARGUMENT`.
    fn code_name(camel: &str) -> String {
        let mut out = String::new();
        for (i, c) in camel.chars().enumerate() {
            if c.is_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_uppercase());
        }
        out
    }
}
